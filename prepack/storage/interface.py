"""The one storage interface: local disks and gs:// behind it (prepack/storage/local.py, gcs.py).

Light on purpose (no Beam at import): `prepack pack` refuses an existing set before
it imports Beam, and the lock and the commit need what Beam's FileSystems does not
expose: exclusive creation, replace-if-unchanged and delete-if-unchanged. The job's
streamed files (inputs read on the workers, part files, shards) go through it too, so
nothing in the project opens a file through Beam's FileSystems.

A version says what a file is now, for a later conditional write or delete: on gs://
the object's generation (ABSENT_GCS = 0: no object), locally its inode, size and
mtime ('' : no file). Versions come only from this module.

Conditional writes on gs:// are idempotent: the client retries a request whose
response was lost, and the retry then meets the precondition its own first attempt
changed (412). So after a 412 the object is read back; if it holds exactly the bytes
this call wrote, the write is this run's and goes on; otherwise the real writer's
bytes are reported (SwitchRefused.current).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import BinaryIO, Protocol


Version = str | int
STREAM_BUFFER_BYTES = 16 << 20  # a streamed gs:// read or upload moves this much per request


class SwitchRefused(RuntimeError):
    """The file changed since this run read it (another writer); it was not replaced.
    `current` holds what is there now (None: nothing), so the caller can name the writer."""

    def __init__(self, message: str, current: bytes | None = None):
        super().__init__(message)
        self.current = current


@dataclasses.dataclass(frozen=True)
class Versioned:
    data: bytes
    version: Version


class Storage(Protocol):
    absent: Version
    os_locks: bool  # the output lock can be an OS lock (flock) here; else a renewed lease

    # limit: a file of more bytes is refused (ManifestError, one line) before its bytes are read
    def read(self, path: str, limit: int | None = None) -> Versioned | None: ...
    def version(self, path: str) -> Version: ...
    def exists(self, path: str) -> bool: ...
    def is_file(self, path: str) -> bool: ...  # a file (a gs:// object), not a folder
    def write(self, path: str, data: bytes) -> None: ...
    def create(self, path: str, data: bytes) -> Version | None: ...
    def write_if(self, path: str, data: bytes, expected: Version, tmp: str) -> Version: ...
    def delete_if(self, path: str, version: Version) -> bool: ...
    def versions(self, folder: str) -> dict[str, Version]: ...
    def list_files(self, folder: str) -> list[str]: ...
    def size(self, path: str) -> int: ...
    def delete(self, paths: list[str]) -> None: ...
    def move(self, sources: list[str], targets: list[str]) -> None: ...
    def delete_tree(self, folder: str) -> None: ...
    def remove_if_empty(self, folder: str) -> None: ...
    # plain reads and writes of small files and whole shards
    def read_bytes(self, path: str) -> bytes | None: ...
    # the first `limit` bytes only (a capped config file: a huge object is never downloaded whole);
    # None: no such file; OSError with one line when it exists but cannot be read
    def read_head(self, path: str, limit: int) -> bytes | None: ...
    def replace(self, path: str, data: bytes, content_type: str = "application/json") -> None: ...
    def sizes(self, folder: str, names: list[str]) -> dict[str, int | None]: ...
    def chunks(self, path: str, block: int) -> Iterator[bytes]: ...
    def download(self, path: str, out: BinaryIO) -> None: ...
    # streamed files of any size (the job's inputs, part files and shards), as stored: never
    # decompressed. open_stream is seekable; on gs:// each request fetches `buffer_bytes`.
    def open_stream(self, path: str, buffer_bytes: int = STREAM_BUFFER_BYTES) -> BinaryIO: ...
    # a new file written as a stream (its folders created; an existing file is replaced when it closes)
    def create_stream(self, path: str) -> BinaryIO: ...
    # (path, size) of each file a path or pattern matches (prepack/storage/patterns.py), sorted
    def match(self, pattern: str) -> list[tuple[str, int]]: ...


def over_limit(path: str, size: int, limit: int | None) -> None:
    """Raises ManifestError (one line) when a file of `size` bytes is over `limit` (None: no limit)."""
    if limit is not None and size > limit:
        from prepack.format.manifest import ManifestError
        from prepack.hostile_input.untrusted import too_large

        raise ManifestError(too_large(path, limit))


def refused(path: str, current: bytes | None) -> SwitchRefused:
    what = "removed" if current is None else "changed"
    return SwitchRefused(f"{path} was {what} by another run since this one started", current)


