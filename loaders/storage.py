"""The few file operations the reader needs, for local paths, gcsfuse mounts and gs:// URLs.

A gcsfuse mount is a local path, so only gs:// needs code of its own: the
manifest and file sizes come from google-cloud-storage (which honors
STORAGE_EMULATOR_HOST), while the shard records are read by array_record
itself, which opens gs:// natively since 0.8.3 (google/array_record commit 6662d1d; 0.8.1 and
0.8.2 cannot).
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterator

GCS_PREFIX = "gs://"


def is_gcs(path: str) -> bool:
    return path.startswith(GCS_PREFIX)


def join(folder: str, name: str) -> str:
    if is_gcs(folder):
        return folder.rstrip("/") + "/" + name
    return os.path.join(folder, name)


def _split_gcs(path: str) -> tuple[str, str]:
    bucket, _, key = path[len(GCS_PREFIX) :].partition("/")
    if not bucket:
        raise ValueError(f"{path}: a gs:// path needs a bucket name")
    return bucket, key


def _mirror_emulator_for_array_record() -> None:
    # array_record reads gs:// through google-cloud-cpp, which looks at
    # CLOUD_STORAGE_EMULATOR_ENDPOINT, while the Python client looks at
    # STORAGE_EMULATOR_HOST. Mirroring one into the other makes both halves talk
    # to the same emulator; it never touches a real-GCS setup (neither is set there).
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    if host and not os.environ.get("CLOUD_STORAGE_EMULATOR_ENDPOINT"):
        os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = host if "://" in host else f"http://{host}"


@functools.lru_cache(maxsize=None)
def _gcs_client(emulator: str | None):  # keyed by the emulator so tests can switch it
    from google.cloud import storage

    return storage.Client()


def gcs_client():
    _mirror_emulator_for_array_record()
    return _gcs_client(os.environ.get("STORAGE_EMULATOR_HOST"))


def read_text(path: str) -> str | None:
    """The file's text, or None if it does not exist."""
    if is_gcs(path):
        from google.api_core import exceptions

        bucket, key = _split_gcs(path)
        try:
            return gcs_client().bucket(bucket).blob(key).download_as_text()
        except exceptions.NotFound:
            return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None


def write_text(path: str, text: str) -> None:
    """Writes a small text file; local writes go through a temp name so a crash leaves the old file."""
    if is_gcs(path):
        bucket, key = _split_gcs(path)
        gcs_client().bucket(bucket).blob(key).upload_from_string(text, content_type="application/json")
        return
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def file_sizes(folder: str, names: list[str]) -> dict[str, int | None]:
    """Size in bytes of each named file in `folder`, None where it is missing.

    For gs:// one listing of the folder answers all names, instead of a request per shard.
    """
    if is_gcs(folder):
        bucket, key = _split_gcs(folder)
        prefix = key.rstrip("/") + "/" if key else ""
        listed = {b.name[len(prefix) :]: b.size for b in gcs_client().list_blobs(bucket, prefix=prefix)}
        return {n: listed.get(n) for n in names}
    sizes: dict[str, int | None] = {}
    for n in names:
        try:
            sizes[n] = os.path.getsize(os.path.join(folder, n))
        except FileNotFoundError:
            sizes[n] = None
    return sizes


def _chunks(path: str, block: int = 1 << 22) -> Iterator[bytes]:
    if is_gcs(path):
        bucket, key = _split_gcs(path)
        with gcs_client().bucket(bucket).blob(key).open("rb", chunk_size=block) as f:
            yield from iter(lambda: f.read(block), b"")
        return
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(block), b"")


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    for chunk in _chunks(path):
        digest.update(chunk)
    return digest.hexdigest()
