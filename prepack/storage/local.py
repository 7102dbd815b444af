"""Local disks (and gcsfuse mounts) behind the storage interface (prepack/storage/interface.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import BinaryIO

from prepack.storage.new_file import write_bytes
from prepack.storage.interface import STREAM_BUFFER_BYTES, Version, Versioned, over_limit, refused
from prepack.storage.patterns import folder_pattern, has_wildcard, literal_head, pattern_regex



class LocalStorage:
    absent: Version = ""
    os_locks = True

    def read(self, path: str, limit: int | None = None) -> Versioned | None:
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                over_limit(path, st.st_size, limit)
                data = f.read() if limit is None else f.read(limit + 1)
                over_limit(path, len(data), limit)  # it grew since
                return Versioned(data, self._stat_version(st))
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

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

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
                    raise refused(path, self._bytes(path)) from e
            else:
                if self.version(path) != expected:
                    raise refused(path, self._bytes(path))
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

    def read_bytes(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, IsADirectoryError):
            return None

    def read_head(self, path: str, limit: int) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read(limit)
        except FileNotFoundError:
            return None

    def replace(self, path: str, data: bytes, content_type: str = "application/json") -> None:
        """Writes a new file and renames it over `path` (prepack/storage/new_file.py): a crash
        leaves the old file, and another name of the old file (a hard link) keeps its bytes."""
        write_bytes(path, data)

    def sizes(self, folder: str, names: list[str]) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for n in names:
            try:
                out[n] = os.path.getsize(os.path.join(folder, n))
            except FileNotFoundError:
                out[n] = None
        return out

    def chunks(self, path: str, block: int) -> Iterator[bytes]:
        with open(path, "rb") as f:
            yield from iter(lambda: f.read(block), b"")

    def download(self, path: str, out: BinaryIO) -> None:
        with open(path, "rb") as f:
            shutil.copyfileobj(f, out)

    def open_stream(self, path: str, buffer_bytes: int = STREAM_BUFFER_BYTES) -> BinaryIO:
        return open(path, "rb")

    def create_stream(self, path: str) -> BinaryIO:
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        return open(path, "wb")

    def match(self, pattern: str) -> list[tuple[str, int]]:
        pattern = folder_pattern(pattern)
        if not has_wildcard(pattern):
            return [(pattern, os.path.getsize(pattern))] if os.path.exists(pattern) else []
        regex = pattern_regex(pattern)
        found = []
        for path in self.list_files(os.path.dirname(literal_head(pattern))):
            if regex.match(path):
                try:
                    found.append((path, os.path.getsize(path)))
                except OSError:
                    pass  # removed while listed
        return sorted(found)
