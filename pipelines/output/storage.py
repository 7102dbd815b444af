"""Local disks and gs:// behind one small interface: the only place that asks which one a path is.

Light on purpose (no Beam at import): `prepack pack` refuses an existing set before
it imports Beam, and the lock and the commit need what Beam's FileSystems does not
expose: exclusive creation, replace-if-unchanged and delete-if-unchanged.

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
from typing import Protocol

from prepack.storage.gcs import GCS_PREFIX, gcs_client, is_gcs, split_gcs

Version = str | int


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

    def read(self, path: str) -> Versioned | None: ...
    def version(self, path: str) -> Version: ...
    def exists(self, path: str) -> bool: ...
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


def _refused(path: str, current: bytes | None) -> SwitchRefused:
    what = "removed" if current is None else "changed"
    return SwitchRefused(f"{path} was {what} by another run since this one started", current)


# ----------------------------------------------------------------------------- local


class LocalStorage:
    absent: Version = ""
    os_locks = True

    def read(self, path: str) -> Versioned | None:
        try:
            with open(path, "rb") as f:
                data = f.read()
                return Versioned(data, self._stat_version(os.fstat(f.fileno())))
        except FileNotFoundError:
            return None

    @staticmethod
    def _stat_version(st: os.stat_result) -> str:
        return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"

    def version(self, path: str) -> Version:
        try:
            return self._stat_version(os.stat(path))
        except FileNotFoundError:
            return self.absent

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def write(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)

    def create(self, path: str, data: bytes) -> Version | None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return None
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return self.version(path)

    def write_if(self, path: str, data: bytes, expected: Version, tmp: str) -> Version:
        """Writes `tmp` (same file system, outside the published set), then links it
        exclusively (new file) or renames it over the old one after checking it is unchanged.
        The output lock (an OS lock) keeps other runs out between the check and the rename."""
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if expected == self.absent:
                try:
                    os.link(tmp, path)
                except FileExistsError as e:
                    raise _refused(path, self._bytes(path)) from e
            else:
                if self.version(path) != expected:
                    raise _refused(path, self._bytes(path))
                os.replace(tmp, path)
            return self.version(path)
        finally:
            try:
                os.remove(tmp)
            except FileNotFoundError:
                pass

    def _bytes(self, path: str) -> bytes | None:
        found = self.read(path)
        return None if found is None else found.data

    def delete_if(self, path: str, version: Version) -> bool:
        if self.version(path) != version:
            return False
        try:
            os.remove(path)
        except FileNotFoundError:
            return False
        return True

    def versions(self, folder: str) -> dict[str, Version]:
        """name -> version of each file directly in `folder`."""
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return {}
        return {e.name: self._stat_version(e.stat()) for e in entries if e.is_file(follow_symlinks=False)}

    def list_files(self, folder: str) -> list[str]:
        out = []
        for root, _, files in os.walk(folder):
            out.extend(os.path.join(root, f) for f in files)
        return sorted(out)

    def size(self, path: str) -> int:
        try:
            return os.path.getsize(path)
        except OSError:
            return 0

    def delete(self, paths: list[str]) -> None:
        for path in paths:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def move(self, sources: list[str], targets: list[str]) -> None:
        for source, target in zip(sources, targets):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.rename(source, target)

    def delete_tree(self, folder: str) -> None:
        self.delete(self.list_files(folder))
        for root, _, _ in sorted(os.walk(folder, topdown=False), key=lambda t: -len(t[0])):
            try:
                os.rmdir(root)
            except OSError:
                pass

    def remove_if_empty(self, folder: str) -> None:
        try:
            os.rmdir(folder)
        except OSError:
            pass


# ----------------------------------------------------------------------------- gs://


class GcsStorage:
    absent: Version = 0
    os_locks = False

    @staticmethod
    def _blob(path: str, generation: int | None = None):
        bucket, key = split_gcs(path)
        return gcs_client().bucket(bucket).blob(key, generation=generation)

    def read(self, path: str) -> Versioned | None:
        from google.api_core import exceptions

        for _ in range(5):
            blob = self._blob(path)
            try:
                blob.reload()
            except exceptions.NotFound:
                return None
            generation = int(blob.generation)  # read first: a download may reset the blob's properties
            try:
                return Versioned(blob.download_as_bytes(if_generation_match=generation), generation)
            except (exceptions.NotFound, exceptions.PreconditionFailed):
                continue  # replaced between the two requests: read the new one
        raise RuntimeError(f"{path} keeps changing while it is read")

    def version(self, path: str) -> Version:
        from google.api_core import exceptions

        blob = self._blob(path)
        try:
            blob.reload()
        except exceptions.NotFound:
            return self.absent
        return int(blob.generation)

    def exists(self, path: str) -> bool:
        return self._blob(path).exists()

    def write(self, path: str, data: bytes) -> None:
        self._blob(path).upload_from_string(data)

    def _upload_if(self, path: str, data: bytes, expected: int) -> Version:
        from google.api_core import exceptions

        blob = self._blob(path)
        try:
            blob.upload_from_string(data, content_type="application/json", if_generation_match=int(expected))
            return int(blob.generation)
        except exceptions.PreconditionFailed as e:
            # A retry after a lost response meets its own first attempt: read it back.
            now = self.read(path)
            if now is not None and now.data == data:
                return now.version
            raise _refused(path, None if now is None else now.data) from e

    def create(self, path: str, data: bytes) -> Version | None:
        try:
            return self._upload_if(path, data, 0)
        except SwitchRefused:
            return None

    def write_if(self, path: str, data: bytes, expected: Version, tmp: str) -> Version:
        return self._upload_if(path, data, int(expected))

    def delete_if(self, path: str, version: Version) -> bool:
        from google.api_core import exceptions

        try:
            self._blob(path).delete(if_generation_match=int(version))
        except exceptions.PreconditionFailed:
            return False  # a later generation under the same name: not the file this run replaced
        except exceptions.NotFound:
            return False  # gone already (a retried delete whose first attempt landed)
        return True

    def versions(self, folder: str) -> dict[str, Version]:
        bucket, key = split_gcs(folder)
        prefix = key.rstrip("/") + "/" if key else ""
        out = {}
        for blob in gcs_client().list_blobs(bucket, prefix=prefix, delimiter="/"):
            out[blob.name[len(prefix):]] = int(blob.generation)
        return out

    def list_files(self, folder: str) -> list[str]:
        bucket, key = split_gcs(folder)
        prefix = key.rstrip("/") + "/" if key else ""
        return [f"{GCS_PREFIX}{bucket}/{b.name}" for b in gcs_client().list_blobs(bucket, prefix=prefix)]

    def size(self, path: str) -> int:
        return 0  # not summed on gs:// (a request per file)

    def delete(self, paths: list[str]) -> None:
        from google.api_core import exceptions

        for path in paths:
            try:
                self._blob(path).delete()
            except exceptions.NotFound:
                pass

    def move(self, sources: list[str], targets: list[str]) -> None:
        if sources:
            from apache_beam.io.filesystems import FileSystems  # batched copy + delete

            FileSystems.rename(sources, targets)

    def delete_tree(self, folder: str) -> None:
        self.delete(self.list_files(folder))

    def remove_if_empty(self, folder: str) -> None:
        pass  # gs:// has no folders


_LOCAL, _GCS = LocalStorage(), GcsStorage()


def storage_for(path: str) -> Storage:
    """The storage holding `path`: the one place that tells gs:// from a local path."""
    return _GCS if is_gcs(path) else _LOCAL
