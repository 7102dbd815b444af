"""Every file a run reads from its compilation cache folder, read one bounded way: the remat verdicts
(train/compilation/unfit_steps.py), the preload records (train/compilation/executable_preload.py) and
JAX's own entries, whether the preload or JAX's own lookup reads them.

Why: the folder outlives the run and anything may lie in it. A FIFO where a file is expected blocked
a plain `prepack train` forever; a link to /dev/zero grew the process by gigabytes; a link out of the
folder reads a file the cache never wrote. So a file is read only when it is a regular file directly
at its name inside the folder (no link is followed past the folder itself, a FIFO is opened without
blocking and then refused), no larger than its cap, and no more than cap + 1 bytes are ever read.
Anything else is a miss: a verdict or record not found, an entry compiled again.

JAX reads its entries through `LRUCache.get` (jax/_src/lru_cache.py), both in its own lookup and in the
preload's loads (`compilation_cache.get_executable_and_time`): `install()` replaces that one method,
so one reader serves both. It also checks that an executable from the cache has the outputs of the
program JAX lowered (an entry of another program made JAX fail its own assertion, a traceback): one
that does not is compiled instead, with one line.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
import threading
import time
from typing import Any, TextIO

# A cache entry is a compressed executable: Gemma3 270M's (8, 2048) step is 76 MB on a TPU v5e
# (train/README.md), a 1B model's ~100 MB; 1 GiB leaves ten times that. The cap only has to stop a
# /dev/zero or a huge file, never a real entry.
MAX_ENTRY_BYTES = 1 << 30
# Decompressed, an executable is a few times its entry: 4 GiB bounds what a damaged or planted
# entry's header may make the decompressor allocate.
MAX_EXECUTABLE_BYTES = 4 << 30
FOLDER_MODE = 0o700  # the folders the project makes for the cache: the user's alone (compile_cache.py)


class NotRead(Exception):
    """A file in the cache folder that is not read (a link, not a regular file, over its cap): a miss."""


def read(folder: str, relative: str, cap: int) -> bytes | None:
    """The bytes of `folder/relative`, at most `cap`; None where there is no such file. Raises NotRead
    (its reason, one phrase) for a link anywhere below `folder`, anything but a regular file, a file over
    `cap`, or one that cannot be read."""
    parts = relative.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise NotRead(f"{relative!r} is not a name inside the folder")
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    dir_fd = -1
    try:
        dir_fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)  # the folder itself: the user's choice
        for part in parts[:-1]:
            inner = os.open(part, flags | os.O_DIRECTORY, dir_fd=dir_fd)
            os.close(dir_fd)
            dir_fd = inner
        # O_NONBLOCK: a FIFO opens at once (and is refused below) instead of waiting for a writer.
        fd = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW met a link (or a link to a folder)
            raise NotRead("a symbolic link, not a file the cache wrote") from None
        raise NotRead(f"cannot be read ({e.strerror or e})") from None
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise NotRead("not a regular file")
        if info.st_size > cap:
            raise NotRead(f"larger than {cap:,} bytes")
        try:
            data = f.read(cap + 1)
        except OSError as e:
            raise NotRead(f"cannot be read ({e.strerror or e})") from None
    if len(data) > cap:  # grew since fstat
        raise NotRead(f"larger than {cap:,} bytes")
    return data


def make_folder(path: str) -> None:
    """Makes `path` (and missing parents) with mode 0700 whatever the umask; an existing folder is left as it is."""
    if os.path.isdir(path):
        return
    make_folder(os.path.dirname(os.path.abspath(path)))
    try:
        os.mkdir(path, FOLDER_MODE)
    except FileExistsError:
        return
    os.chmod(path, FOLDER_MODE)  # mkdir's mode is masked by the umask


def entry_name(key: str) -> str:
    from jax._src import lru_cache

    return f"{key}{lru_cache._CACHE_SUFFIX}"


# Where install() reports a skipped entry (compile_cache.enable's stream), and what it reported.
_say: TextIO | None = None
_said: set[str] = set()
_said_lock = threading.Lock()
_jax_get: Any = None
_jax_compile_or_get_cached: Any = None


def _note(line: str) -> None:
    with _said_lock:
        if line in _said:
            return
        _said.add(line)
    print(line, file=_say if _say is not None else sys.stderr, flush=True)


def read_entry(folder: str, key: str) -> bytes | None:
    """JAX's entry for `key` (compressed, as JAX wrote it), or None: missing, or not read (said in one line)."""
    name = entry_name(key)
    try:
        if "/" in key or key.startswith("."):  # JAX's keys are <module name>-<sha256 hex>
            raise NotRead("not a cache key")
        data = read(folder, name, MAX_ENTRY_BYTES)
        if data is not None:
            _check_declared_size(data)
        return data
    except NotRead as e:
        _note(f"XLA compilation cache: {os.path.join(folder, name)}: {e}; not read (compiled instead)")
        return None


def _check_declared_size(data: bytes) -> None:
    """A zstd entry names its decompressed size, which the decompressor allocates: bounded here."""
    from jax._src import compilation_cache

    if getattr(compilation_cache, "zstd", None) is None and getattr(compilation_cache, "zstandard", None) is not None:
        try:
            size = compilation_cache.zstandard.frame_content_size(data)
        except compilation_cache.zstandard.ZstdError:
            raise NotRead("not a zstd frame") from None
        if not 0 <= size <= MAX_EXECUTABLE_BYTES:
            raise NotRead(f"declares {size:,} bytes decompressed, more than {MAX_EXECUTABLE_BYTES:,}" if size > 0
                          else "does not declare its decompressed size")


def _bounded_get(self: Any, key: str) -> bytes | None:
    """LRUCache.get with its read of `<folder>/<key>-cache` bounded (the module doc); its LRU bookkeeping
    (a lock and an access-time file, only when jax_compilation_cache_max_size is set) is JAX's own."""
    from jax._src import lru_cache

    if not key:
        raise ValueError("key cannot be empty")
    if not lru_cache._is_local_filesystem(str(self.path)):
        return _jax_get(self, key)
    if self.eviction_enabled:
        self.lock.acquire(timeout=self.lock_timeout_secs)
    try:
        data = read_entry(str(self.path), key)
        if data is not None and self.eviction_enabled:
            (self.path / f"{key}{lru_cache._ATIME_SUFFIX}").write_bytes(time.time_ns().to_bytes(8, "little"))
        return data
    finally:
        if self.eviction_enabled:
            self.lock.release()


def _result_count(computation: Any) -> int | None:
    """How many results the lowered program's main function has (None: not found)."""
    from jax._src.lib.mlir import ir

    try:
        for op in computation.body.operations:
            if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main":
                return len(op.type.results)
    except Exception:  # noqa: BLE001  (a program this check cannot read is left to JAX)
        return None
    return None


def _output_count(executable: Any) -> int | None:
    try:
        return len(executable.get_output_memory_kinds()[0])
    except Exception:  # noqa: BLE001  (JAX's own check tolerates the same)
        return None


def _checked_compile_or_get_cached(backend: Any, computation: Any, devices: Any, compile_options: Any,
                                   host_callbacks: Any, executable_devices: Any, pgle_profiler: Any = None) -> Any:
    """JAX's compile_or_get_cached; an executable (from the cache) whose outputs are not the program's is compiled again."""
    from jax._src import compiler

    executable = _jax_compile_or_get_cached(backend, computation, devices, compile_options, host_callbacks,
                                            executable_devices, pgle_profiler)
    expected, got = _result_count(computation), _output_count(executable)
    if expected is None or got is None or expected == got:
        return executable
    from jax._src.lib.mlir import ir

    name = ir.StringAttr(computation.operation.attributes["sym_name"]).value
    _note(f"XLA compilation cache: the entry for {name} holds another program ({got} outputs, not {expected}); "
          f"compiled {name} instead (delete its {name}-*-cache files from the cache folder to stop this line)")
    return compiler.backend_compile_and_load(backend, computation, executable_devices, compile_options, host_callbacks)


def install(say: TextIO) -> None:
    """Bounds JAX's read of its entries and checks what it loads, once per process; `say`: where a skipped
    entry is named (one line each)."""
    global _say, _jax_get, _jax_compile_or_get_cached
    from jax._src import compiler, lru_cache

    _say = say
    if _jax_get is None:
        _jax_get = lru_cache.LRUCache.get
        lru_cache.LRUCache.get = _bounded_get
    if _jax_compile_or_get_cached is None:
        _jax_compile_or_get_cached = compiler.compile_or_get_cached
        compiler.compile_or_get_cached = _checked_compile_or_get_cached
