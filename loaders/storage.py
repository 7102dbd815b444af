"""The few file operations the reader needs, for local paths, gcsfuse mounts and gs:// URLs.

A gcsfuse mount is a local path, so only gs:// needs code of its own, all
through google-cloud-storage (which honors STORAGE_EMULATOR_HOST): the manifest,
file sizes (one listing), and whole-shard downloads into the local shard cache
(loaders/shard_cache.py). Records are then read from local files: array_record's
own gs:// reader costs one HTTP request per record.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from typing import BinaryIO

from prepack.storage.gcs import gcs_client, is_gcs, split_gcs  # noqa: F401  (also used through loaders.storage)
from prepack.format.manifest import ManifestError


def join(folder: str, name: str) -> str:
    if is_gcs(folder):
        return folder.rstrip("/") + "/" + name
    return os.path.join(folder, name)


def read_text(path: str) -> str | None:
    """The file's text, or None if it does not exist; ManifestError (one line) if its bytes are
    not UTF-8: the manifests and records read here are written by strangers."""
    data = _read_bytes(path)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{path}: not UTF-8 text (byte {e.start} is {data[e.start:e.start + 1]!r}); the file was "
                            "edited or is damaged: republish the set") from None


def _read_bytes(path: str) -> bytes | None:
    if is_gcs(path):
        from google.api_core import exceptions

        bucket, key = split_gcs(path)
        try:
            return gcs_client().bucket(bucket).blob(key).download_as_bytes(raw_download=True)
        except exceptions.NotFound:
            return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def write_text(path: str, text: str) -> None:
    """Writes a small text file; local writes go through a temp name so a crash leaves the old file."""
    if is_gcs(path):
        bucket, key = split_gcs(path)
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
        bucket, key = split_gcs(folder)
        prefix = key.rstrip("/") + "/" if key else ""
        listed = {b.name[len(prefix) :]: b.size for b in gcs_client().bucket(bucket).list_blobs(prefix=prefix)}
        return {n: listed.get(n) for n in names}
    sizes: dict[str, int | None] = {}
    for n in names:
        try:
            sizes[n] = os.path.getsize(os.path.join(folder, n))
        except FileNotFoundError:
            sizes[n] = None
    return sizes


class _HashingWriter:
    """A write-only file object that hashes what passes through it on its way to `out`."""

    def __init__(self, out: BinaryIO):
        self._out = out
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self._out.write(data)


def download(url: str, out: BinaryIO) -> tuple[int, str]:
    """Copies a whole gs:// object into `out` with one GET; returns (bytes, sha256 hex).

    GCS's own checksum is skipped: the caller compares the sha256 with the manifest's.
    """
    bucket, key = split_gcs(url)
    writer = _HashingWriter(out)
    gcs_client().bucket(bucket).blob(key).download_to_file(writer, raw_download=True, checksum=None)
    return writer.size, writer.digest.hexdigest()


def _mount_points() -> list[tuple[str, str]]:
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            rows = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return []
    return [(point.replace("\\040", " "), fstype) for point, fstype in rows]


def is_network_mount(path: str) -> bool:
    """True if `path` lies on a FUSE (gcsfuse) or network file system, where each read waits on the network."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    for point, kind in _mount_points():
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, fstype = point, kind
    return fstype.startswith("fuse") or fstype in {"nfs", "nfs4", "cifs", "smb3"}


def _chunks(path: str, block: int = 1 << 22) -> Iterator[bytes]:
    if is_gcs(path):
        bucket, key = split_gcs(path)
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
