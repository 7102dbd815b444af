"""The launcher's file operations on the output, local or gs://, without Beam.

Light on purpose: `prepack pack` checks for an existing shard set before it
imports Beam (under 2 s), and the lock and the publishing switch need storage
features Beam's FileSystems does not expose: exclusive creation (O_EXCL /
ifGenerationMatch=0) and replace-if-unchanged (a generation precondition).
"""

from __future__ import annotations

import hashlib
import os

from prepack.gcs import GCS_PREFIX, gcs_client, is_gcs, split_gcs  # noqa: F401  (the lock reaches them through here)


class SwitchRefused(RuntimeError):
    """The file changed since this run looked at it (another writer), so it was not replaced."""


def _blob(path: str):
    bucket, key = split_gcs(path)
    return gcs_client().bucket(bucket).blob(key)


def exists(path: str) -> bool:
    if is_gcs(path):
        return _blob(path).exists()
    return os.path.exists(path)


def read_bytes(path: str) -> bytes | None:
    if is_gcs(path):
        from google.api_core import exceptions

        try:
            return _blob(path).download_as_bytes()
        except exceptions.NotFound:
            return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def version(path: str) -> str | int:
    """What the file is now, for a later replace_if: its gs:// generation (0: absent), or
    locally its sha256 ('' : absent)."""
    if is_gcs(path):
        blob = _blob(path)
        try:
            blob.reload()
        except Exception:  # NotFound
            return 0
        return int(blob.generation)
    data = read_bytes(path)
    return "" if data is None else hashlib.sha256(data).hexdigest()


def absent_version(path: str) -> str | int:
    return 0 if is_gcs(path) else ""


def switch(path: str, data: bytes, expected: str | int, tmp: str | None = None) -> None:
    """Makes `path` hold `data` in one atomic step, only if it is still `expected`
    (absent_version: must not exist). gs:// uploads with ifGenerationMatch; locally `tmp`
    (a path on the same file system, outside the published set) is written, then linked
    exclusively (new file) or renamed over the old one (after checking it is unchanged).
    A failure before the switch leaves `path` as it was; raises SwitchRefused when it changed."""
    if is_gcs(path):
        from google.api_core import exceptions

        try:
            _blob(path).upload_from_string(data, content_type="application/json", if_generation_match=int(expected))
        except exceptions.PreconditionFailed as e:
            raise SwitchRefused(f"{path} was changed by another run since this one started") from e
        return
    assert tmp is not None, "a local switch needs a temp path"
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if expected == "":
            try:
                os.link(tmp, path)
            except FileExistsError as e:
                raise SwitchRefused(f"{path} was created by another run since this one started") from e
        else:
            if version(path) != expected:
                raise SwitchRefused(f"{path} was changed by another run since this one started")
            os.replace(tmp, path)
    finally:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass


def list_files(folder: str) -> list[str]:
    """Every file under a folder (recursively), as full paths; [] when it does not exist."""
    if is_gcs(folder):
        bucket, key = split_gcs(folder)
        prefix = key.rstrip("/") + "/" if key else ""
        return [f"{GCS_PREFIX}{bucket}/{b.name}" for b in gcs_client().list_blobs(bucket, prefix=prefix)]
    out = []
    for root, _, files in os.walk(folder):
        out.extend(os.path.join(root, f) for f in files)
    return sorted(out)


def delete(paths: list[str]) -> None:
    for path in paths:
        if is_gcs(path):
            from google.api_core import exceptions

            try:
                _blob(path).delete()
            except exceptions.NotFound:
                pass
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def delete_tree(folder: str) -> None:
    """Deletes a folder and everything under it; locally also the (then empty) folders."""
    delete(list_files(folder))
    if not is_gcs(folder):
        for root, dirs, _ in sorted(os.walk(folder, topdown=False), key=lambda t: -len(t[0])):
            try:
                os.rmdir(root)
            except OSError:
                pass


def remove_if_empty(folder: str) -> None:
    if not is_gcs(folder):
        try:
            os.rmdir(folder)
        except OSError:
            pass
