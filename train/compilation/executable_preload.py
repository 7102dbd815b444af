"""A repeat run's cached executables, loaded on threads while the run is still tracing them.

Why: on a TPU v5e a cache hit of Gemma3 270M's (8, 2048) train step still took 21.9 s before step 1:
JAX traces the step (5.7 s) and lowers it (1.1 s) to compute the cache key, and only then loads the
executable (14.3 s, inside the TPU runtime's deserialize; docs/benchmarks.md, "On a TPU v5e"). The load
does not need the trace, only the key, and the key of a repeat run is the last run's.

How: a run writes down, in a record beside the compilation cache, the cache key JAX computed for each
executable it looked up (with the compile options and devices JAX loaded it for). The next run with
the same `hint` (the options that shape its programs) starts loading those cache entries on threads
as soon as the cache is enabled, before the weights load; the deserialize runs in the runtime without
Python's lock, so the trace goes on meanwhile. JAX's own cache lookup (`compiler._cache_read`, wrapped
here) then takes a loaded executable only when the key it computed from the program it has just
lowered is the recorded key, with the same compile options and devices: exactly the entry its own
lookup would have deserialized. A stale or planted record can only cost a load in the background;
it can never run a program other than the one JAX keyed. A record names the runtime that wrote it
(the platform and its version, JAX's and jaxlib's): another runtime's entries are never deserialized,
as JAX itself would never read them. A record is read as a stranger's file (a regular file inside the
cache folder, no link; its size, names, types and counts are checked, and a key must have the shape of
JAX's key for its module, so it names a file of the folder; one that fails is ignored and named in
one line). The loads read entries as JAX's own lookup does, bounded (train/compilation/cache_files.py),
on daemon threads: the process never waits for a load to end.

`--compile-cache off` preloads and records nothing; `--compile-preload off` keeps the cache and only
turns the preload off (for a measurement against it, docs/benchmarks.md).
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import queue
import re
import stat
import threading
import time
from collections.abc import Mapping
from typing import Any, TextIO

FOLDER = "prepack-preload"
FORMAT = "prepack-preload/1"
ON, OFF = "on", "off"
MAX_FILE_BYTES = 256 << 10
MAX_ENTRIES = 32  # a train run looks up a handful (the adapters' init, the step, an eval step)
MAX_OPTIONS_BYTES = 64 << 10  # serialized CompileOptions are ~1 KB
MAX_DEVICES = 4096
MAX_RUNTIME_CHARS = 1000
MAX_THREADS = 4
# JAX's cache keys are "<module name>-<sha256 hex>" and its module names jit_<python name> (letters,
# digits, _ . -: jax/_src/interpreters/mlir.py, sanitize_name); a record's key must be its module's.
_MODULE = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
_KEY = re.compile(r"(?P<module>[A-Za-z0-9_.\-]{1,200})-[0-9a-f]{64}")
_HINT = re.compile(r"[0-9a-f]{64}")
RUNTIME_FIELDS = ("platform", "platform_version", "jax", "jaxlib")


class PreloadRecordError(ValueError):
    """A preload record that fails a check (one line naming the file and field); the record is ignored."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One cache lookup of a run: what JAX keyed, and what it loads the entry for."""

    module: str
    key: str
    options: bytes  # xla CompileOptions, serialized
    devices: tuple[int, ...]  # the executable's device ids, in order

    def as_json(self) -> dict[str, Any]:
        return {"module": self.module, "key": self.key, "options": base64.b64encode(self.options).decode("ascii"),
                "devices": list(self.devices)}


@dataclasses.dataclass(frozen=True)
class Record:
    """A run's lookups, and the runtime that made them: only the same runtime loads them (an entry of
    another libtpu or JAX is one JAX itself would never read, and deserializing it is not tried)."""

    runtime: dict[str, str]
    entries: tuple[Entry, ...]


def runtime_of(backend: Any) -> dict[str, str]:
    import jax
    import jaxlib

    return {"platform": backend.platform, "platform_version": backend.platform_version, "jax": jax.__version__,
            "jaxlib": jaxlib.__version__}


def hint_of(fields: Mapping[str, Any]) -> str:
    """The record's name for a run's program-shaping options (any JSON-able mapping)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def record_path(cache_folder: str, hint: str) -> str:
    return os.path.join(cache_folder, FOLDER, f"{hint}.json")


def read_record(path: str) -> Record | None:
    """The record at `path` (<cache>/prepack-preload/<name>, as record_path makes it); None where there is
    none. Raises PreloadRecordError for one that fails a check: a link, a FIFO or anything but a regular
    file in the cache folder, one over MAX_FILE_BYTES (train/compilation/cache_files.py), bad JSON or fields."""
    from train.compilation import cache_files

    folder, name = os.path.split(path)
    try:
        raw = cache_files.read(os.path.dirname(folder), f"{os.path.basename(folder)}/{name}", MAX_FILE_BYTES)
    except cache_files.NotRead as e:
        raise PreloadRecordError(f"{path}: {e}; not read") from None
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser goes
        raise PreloadRecordError(f"{path}: not a JSON record ({type(e).__name__})") from None
    return record_of(data, path)


def record_of(data: Any, where: str) -> Record:
    """The checked record of parsed JSON."""
    if not isinstance(data, dict) or set(data) != {"format", "runtime", "entries"}:
        raise PreloadRecordError(f"{where}: not a preload record (an object of format, runtime and entries expected)")
    if data["format"] != FORMAT:
        raise PreloadRecordError(f"{where}: format: {str(data['format'])[:40]!r}, expected {FORMAT!r}")
    runtime = data["runtime"]
    if (not isinstance(runtime, dict) or set(runtime) != set(RUNTIME_FIELDS)
            or not all(isinstance(v, str) and len(v) <= MAX_RUNTIME_CHARS for v in runtime.values())):
        raise PreloadRecordError(f"{where}: runtime: an object of {', '.join(RUNTIME_FIELDS)} (strings) expected")
    raw = data["entries"]
    if not isinstance(raw, list) or len(raw) > MAX_ENTRIES:
        raise PreloadRecordError(f"{where}: entries: a list of at most {MAX_ENTRIES} expected")
    entries = [entry_of(item, f"{where}: entries[{i}]") for i, item in enumerate(raw)]
    unique = {e.key: e for e in reversed(entries)}  # a key named twice is loaded once (its first entry)
    return Record(dict(runtime), tuple(e for e in entries if unique[e.key] is e))


def entry_of(item: Any, where: str) -> Entry:
    if not isinstance(item, dict) or set(item) != {"module", "key", "options", "devices"}:
        raise PreloadRecordError(f"{where}: an object of module, key, options and devices expected")
    if not isinstance(item["module"], str) or not _MODULE.fullmatch(item["module"]):
        raise PreloadRecordError(f"{where}.module: not a JAX module name (letters, digits, _ . -; at most 200)")
    if not is_key_of(item["key"], item["module"]):
        raise PreloadRecordError(f"{where}.key: not a JAX cache key of its module (<module>-<64 hex digits>)")
    options = item["options"]
    if not isinstance(options, str) or len(options) > MAX_OPTIONS_BYTES * 4 // 3 + 4:
        raise PreloadRecordError(f"{where}.options: base64 of at most {MAX_OPTIONS_BYTES:,} bytes expected")
    try:
        decoded = base64.b64decode(options, validate=True)
    except ValueError:
        raise PreloadRecordError(f"{where}.options: not base64") from None
    devices = item["devices"]
    if (not isinstance(devices, list) or not 0 < len(devices) <= MAX_DEVICES
            or not all(type(d) is int and 0 <= d < 1 << 31 for d in devices)):
        raise PreloadRecordError(f"{where}.devices: a list of 1 to {MAX_DEVICES} device ids expected")
    return Entry(item["module"], item["key"], decoded, tuple(devices))


def is_key_of(key: Any, module: str) -> bool:
    """Whether `key` has the shape of JAX's cache key for `module` (so it names a file in the cache folder)."""
    found = _KEY.fullmatch(key) if isinstance(key, str) else None
    return found is not None and found["module"] == module


def write_record(path: str, record: Record) -> None:
    """The record, whole or not at all (prepack.storage writes through a temporary name), in a folder of the user's alone."""
    from prepack import storage
    from train.compilation import cache_files

    cache_files.make_folder(os.path.dirname(path))
    storage.write_text(path, json.dumps({"format": FORMAT, "runtime": record.runtime,
                                         "entries": [e.as_json() for e in record.entries[:MAX_ENTRIES]]}))


def in_cache(cache_folder: str, key: str) -> bool:
    """Whether JAX's file cache holds an entry for `key` (its LRUCache names a file <key>-cache): a regular file, no link."""
    from train.compilation import cache_files

    try:
        return stat.S_ISREG(os.lstat(os.path.join(cache_folder, cache_files.entry_name(key))).st_mode)
    except OSError:
        return False


@dataclasses.dataclass
class Load:
    """One entry loading (or loaded) on a preload thread."""

    entry: Entry
    future: concurrent.futures.Future | None = None  # None once JAX took it or it was let go
    seconds: float | None = None  # the load's own time, once done


class Preload:
    """This process's preloads for one run, and the lookups it records for the next run."""

    def __init__(self, cache_folder: str, path: str, backend: Any) -> None:
        self.cache_folder = cache_folder
        self.path = path
        self.backend = backend  # the default backend: the one whose lookups are recorded and preloaded
        self.loads: dict[str, Load] = {}  # by key: started, not yet asked for
        self.history: list[Load] = []
        self.seen: list[Entry] = []
        self.used: list[str] = []  # module names JAX took from the preload
        self.waited_s = 0.0  # time JAX's lookups waited for a load still running
        self._recorded: collections.Counter[str] = collections.Counter()  # the record's entries per function
        self._lock = threading.Lock()

    def start(self, record: Record) -> None:
        """Starts loading the record's entries, where this process has the same runtime and their devices."""
        if record.runtime != runtime_of(self.backend):
            return
        by_id = {d.id: d for d in self.backend.devices()}
        wanted = [e for e in record.entries if all(i in by_id for i in e.devices)]
        if not wanted:
            return
        self._recorded.update(e.module for e in wanted)
        work: queue.SimpleQueue[tuple[Load, concurrent.futures.Future, tuple[Any, ...]]] = queue.SimpleQueue()
        for entry in wanted:
            load = Load(entry, concurrent.futures.Future())
            work.put((load, load.future, tuple(by_id[i] for i in entry.devices)))
            self.loads[entry.key] = load
            self.history.append(load)
        # Daemon threads, not a ThreadPoolExecutor (whose exit hook joins its threads): the process
        # ends with its run whatever a load is doing.
        for _ in range(min(MAX_THREADS, len(wanted))):
            threading.Thread(target=_work, args=(work, self.backend), name="prepack-preload", daemon=True).start()

    def lookup(self, original: Any, module_name: str, cache_key: str, compile_options: Any, backend: Any,
               executable_devices: Any) -> tuple[Any, Any]:
        """JAX's `_cache_read`, answered from a preload only when it loaded exactly this lookup's entry:
        the key JAX computed from the program it lowered, the same compile options, devices and backend."""
        if backend is not self.backend:
            return original(module_name, cache_key, compile_options, backend, executable_devices)
        entry = Entry(module_name, cache_key, compile_options.SerializeAsString(),
                      tuple(d.id for d in executable_devices))
        with self._lock:
            if all(e.key != cache_key for e in self.seen):
                self.seen.append(entry)
            load = self.loads.pop(cache_key, None)
            # A function the record holds once, asked for under another key: its recorded program is
            # stale, so the loaded one is let go now rather than held to the run's end.
            stale = [k for k, other in self.loads.items() if other.entry.module == module_name]
            if load is None and len(stale) == 1 and self._recorded[module_name] == 1:
                _let_go(self.loads.pop(stale[0]))
        if load is not None and load.entry != entry:
            _let_go(load)  # the key JAX asks for, loaded for other options or devices: JAX reads it its own way
        elif load is not None:
            executable, compile_time = self._take(load)
            if executable is not None:
                self.used.append(module_name)
                return executable, compile_time
        return original(module_name, cache_key, compile_options, backend, executable_devices)

    def _take(self, load: Load) -> tuple[Any, Any]:
        """The load's executable (waiting for it if it is still loading); (None, None) if it failed."""
        future, load.future = load.future, None
        if future is None:
            return None, None
        started, running = time.perf_counter(), not future.done()
        try:
            return future.result()
        except Exception:  # noqa: BLE001  (JAX's own lookup, which follows, reports a damaged entry its way)
            return None, None
        finally:
            if running:
                self.waited_s += time.perf_counter() - started

    def stop(self) -> None:
        """Lets every load nobody asked for go: queued ones never start, finished ones are dropped
        (a deserialize already running ends by itself, on a daemon thread the process does not wait for)."""
        with self._lock:
            loads, self.loads = list(self.loads.values()), {}
        for load in loads:
            _let_go(load)

    def finish(self) -> dict[str, Any]:
        """Stops the loads and writes the record of this run's lookups that JAX's cache holds (when
        there are any); returns what the preload did, for the run's summary."""
        self.stop()
        with self._lock:
            # The entries JAX read and those it wrote after compiling (programs that compile faster
            # than its threshold are not kept, nor worth a thread); names the reader would refuse are left out.
            kept = tuple(e for e in self.seen if _MODULE.fullmatch(e.module) and is_key_of(e.key, e.module)
                         and in_cache(self.cache_folder, e.key))
        if kept:
            write_record(self.path, Record(runtime_of(self.backend), kept))
        return {
            "record": self.path,
            "loaded": [load.entry.module for load in self.history],
            "used": list(self.used),
            "load_s": [round(load.seconds, 3) if load.seconds is not None else None for load in self.history],
            "waited_s": round(self.waited_s, 3),
        }


def _let_go(load: Load) -> None:
    future, load.future = load.future, None
    if future is not None:
        future.cancel()  # a load not yet started never starts


def _work(work: queue.SimpleQueue, backend: Any) -> None:
    """A preload thread: loads queued entries until none is left (a cancelled one is skipped)."""
    while True:
        try:
            load, future, devices = work.get_nowait()
        except queue.Empty:
            return
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(_load_entry(load, backend, devices))
        except BaseException as e:  # noqa: BLE001  (handed to the lookup that takes it, as a pool would)
            future.set_exception(e)


def _load_entry(load: Load, backend: Any, devices: tuple[Any, ...]) -> tuple[Any, Any]:
    """JAX's own read of one cache entry (read, decompress, deserialize), on a preload thread; the read is
    bounded as every read of JAX's entries is (train/compilation/cache_files.py)."""
    from jax._src import compilation_cache
    from jax._src.lib import xla_client

    started = time.perf_counter()
    try:
        options = xla_client.CompileOptions.ParseFromString(load.entry.options)
        return compilation_cache.get_executable_and_time(load.entry.key, options, backend,
                                                         xla_client.DeviceList(devices))
    finally:
        load.seconds = time.perf_counter() - started


# The process's one hook on JAX's cache lookup, and the run it answers for (None: JAX's lookup as is).
_active: Preload | None = None
_original: Any = None


def _cache_read(module_name: str, cache_key: str, compile_options: Any, backend: Any, executable_devices: Any) -> Any:
    preload = _active
    if preload is None:
        return _original(module_name, cache_key, compile_options, backend, executable_devices)
    return preload.lookup(_original, module_name, cache_key, compile_options, backend, executable_devices)


def _install() -> None:
    """Wraps JAX's cache lookup once per process (JAX calls it by its module-level name)."""
    global _original
    from jax._src import compiler

    if _original is None:
        _original = compiler._cache_read
        compiler._cache_read = _cache_read


def begin(cache_folder: str | None, hint: str, out: TextIO) -> Preload | None:
    """Starts the run's preloads from the record of `hint` (on threads) and records its lookups;
    None where the cache is off. A record that fails a check is named in one line and ignored."""
    global _active
    import jax

    if cache_folder is None or not _HINT.fullmatch(hint):
        return None
    from train.compilation import cache_files

    cache_files.install(out)  # compile_cache.enable did, for a run; the loads read entries bounded
    _install()
    abandon(_active)  # a run of this process that never ended (a plan, a test driving setup by hand)
    preload = Preload(cache_folder, record_path(cache_folder, hint), jax.devices()[0].client)
    try:
        record = read_record(preload.path)
    except PreloadRecordError as e:
        print(f"compile preload: {e}; ignored", file=out, flush=True)
        record = None
    if record is not None:
        preload.start(record)
    _active = preload
    return preload


def abandon(preload: Preload | None) -> None:
    """A run that ended before it trained: its lookups are no longer answered, its loads let go, and
    nothing is recorded."""
    global _active
    if preload is None:
        return
    if _active is preload:
        _active = None
    preload.stop()


def end(preload: Preload | None, out: TextIO) -> dict[str, Any] | None:
    """Stops answering JAX's lookups and writes the record; what the preload did (None: there was none)."""
    global _active
    if preload is None:
        return None
    if _active is preload:
        _active = None
    try:
        return preload.finish()
    except OSError as e:  # the run's work is done; the next run only loses its preload
        print(f"compile preload: could not write {preload.path} ({e.strerror or e})", file=out, flush=True)
        return None
