"""One writer per output: OUTPUT/.lock, and the fence every publishing step goes through.

    lock = OutputLock.acquire(output, run_id, expiry_s)   # raises LockHeld naming the owner
    lock.check()                                          # before each step: raises LockLost
    lock.release()

Liveness is proven by something a pause or a PID namespace cannot fake, never by
whether a pid exists here:

* Local disk: an OS lock, fcntl.flock on OUTPUT/.lock, opened close-on-exec (Beam's
  worker processes do not inherit it) and held for the run's life. The kernel drops it
  when the process ends, however it ends, so a killed run's lock is free at once. A
  paused (SIGSTOP) run still holds it: the output stays that run's until the process
  ends or is continued; an operator frees it by ending that process. The file's content
  (run id, host, pid) only names the owner in messages. Across PID namespaces on one
  kernel the flock is the same lock. On NFS, flock is emulated with byte-range locks
  (Linux >= 2.6.12) and is visible to other clients only with a working lock manager
  (NFSv4, or NFSv3 with lockd); gcsfuse does not share locks between machines at all:
  write to gs://OUTPUT instead, which uses the lease below.
* gs://: a lease object OUTPUT/.lock created with ifGenerationMatch=0 and rewritten by a
  renewer thread within the expiry (--lock-expiry-s) with ifGenerationMatch = this run's
  generation. A lock not renewed within its expiry is stale and is taken over: deleted
  with ifGenerationMatch = the generation judged stale (of two runs judging it, one
  wins), then created exclusively. `check()` is itself a conditional renewal, so a run
  paused past its expiry learns, the moment it resumes, that another run owns the output;
  every publishing write is also conditioned on generations it read under its lock
  (pipelines/output/commit.py), so a write in flight when the lease ran out fails too.
  Each create and renewal is timed: a round trip over a third of the expiry stops the run
  in one line (LeaseTooShort), since such a lease would look expired while its run is healthy.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import math
import os
import socket
import stat
import threading
import time
from collections.abc import Callable

from pipelines.faults import failpoints
from prepack.storage import GcsStorage, SwitchRefused, Versioned, storage_for
from prepack.format import layout
from prepack.format.manifest import ManifestError
from prepack.hostile_input.untrusted import MAX_METADATA_FILE_BYTES

DEFAULT_EXPIRY_S = 600.0  # a gs:// lease not renewed for this long is stale
RENEW_EVERY_S = 60.0  # at most; a third of the expiry when that is shorter
MIN_EXPIRY_S = 10.0  # --lock-expiry-s below this is refused: a healthy run's lease would look expired
MAX_EXPIRY_S = 86400.0  # --lock-expiry-s above this is refused
# A lock file is a small JSON object (LockInfo); a bigger one is no run's and is read as corrupt, unread.
MAX_LOCK_BYTES = 1 << 16
# How far ahead of this machine's clock another host's may run. A lease that expires later than
# MAX_EXPIRY_S + this from now was written by no run (1e308, Infinity): it is read as corrupt.
CLOCK_SKEW_S = 86400.0

log = logging.getLogger("prepack.pack")
TRIPS_PER_EXPIRY = 3  # a lease must outlast this many renewal round trips, else the run stops


class LockHeld(RuntimeError):
    """Another live run holds the output."""


class LockLost(RuntimeError):
    """This run's lock was taken over or removed while it ran; the message names the owner now."""


class LeaseTooShort(LockLost):
    """A renewal round trip took more than a third of the lease: other runs would take over a
    healthy run; the message says which --lock-expiry-s to pass."""


def _judge_trip(output: str, trip_s: float, expiry_s: float) -> None:
    if TRIPS_PER_EXPIRY * trip_s > expiry_s:
        need = max(MIN_EXPIRY_S, float(int(TRIPS_PER_EXPIRY * trip_s * 2) + 1))
        raise LeaseTooShort(
            f"the lease on {output} cannot be kept: a renewal round trip took {trip_s:.2f} s and --lock-expiry-s "
            f"{expiry_s:g} is under {TRIPS_PER_EXPIRY}x that, so other runs could take over this healthy one; pass "
            f"--lock-expiry-s {need:g} or more")


@dataclasses.dataclass(frozen=True)
class LockInfo:
    run_id: str
    host: str
    pid: int
    created: float
    expires: float

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes | None, now: float | None = None) -> "LockInfo | None":
        """The lock's content, or None for a corrupt one: half-written (its writer died mid-write),
        not a lock's JSON, or times no run writes (not finite, before 1970, or expiring more than
        MAX_EXPIRY_S + CLOCK_SKEW_S from `now`, default this machine's clock)."""
        try:
            if data is None or len(data) > MAX_LOCK_BYTES:
                return None
            d = json.loads(data.decode("utf-8"))
            info = cls(str(d["run_id"]), str(d["host"]), int(d["pid"]), float(d["created"]), float(d["expires"]))
        except Exception:
            return None
        now = time.time() if now is None else now
        if not all(math.isfinite(t) and t >= 0 for t in (info.created, info.expires)) \
                or max(info.created, info.expires) > now + MAX_EXPIRY_S + CLOCK_SKEW_S:
            return None
        return info

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.created))
        return f"run {self.run_id} (pid {self.pid} on {self.host}, since {when})"


def _owner_now(output: str, holder: LockInfo | None) -> str:
    """Who owns the output now: the lock's holder, else the run whose record is published there."""
    if holder is not None:
        return holder.describe()
    from prepack.format.run_record import RunRecord

    try:
        found = storage_for(output).read(layout.run_record_path(output), MAX_METADATA_FILE_BYTES)
        return f"run {RunRecord.from_json(found.data.decode('utf-8')).run_id} (it published {layout.RUN_RECORD_NAME}; no run holds the lock now)"
    except Exception:
        return "no run (nobody holds the lock now)"


def _lost(output: str, run_id: str, holder: LockInfo | None, why: str) -> LockLost:
    return LockLost(f"this run (run {run_id}) lost the lock on {output} ({why}); the output now belongs to "
                    f"{_owner_now(output, holder)}. This run stopped and changed nothing more")


class OutputLock:
    """The lock of one run on one output (LocalLock or LeaseLock)."""

    output: str
    run_id: str
    took_over: LockInfo | None  # the killed (or stale) run whose lock this one replaced
    lost: LockLost | None = None  # set when the lock was found lost (a lease, by its renewer)
    on_lost: Callable[[], None] | None = None

    @staticmethod
    def acquire(output: str, run_id: str, expiry_s: float | None = None, renew: bool = True) -> "OutputLock":
        expiry_s = DEFAULT_EXPIRY_S if expiry_s is None else float(expiry_s)
        if storage_for(output).os_locks:
            return LocalLock.take(output, run_id, expiry_s)
        return LeaseLock.take(output, run_id, expiry_s, renew)

    def check(self) -> None:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError


def read_lock(output: str) -> LockInfo | None:
    found = _read_lock_file(storage_for(output), layout.lock_path(output))
    return LockInfo.from_bytes(found.data) if found else None


def _read_lock_file(store, path: str) -> Versioned | None:
    """The lock file's bytes and version; one over MAX_LOCK_BYTES (no run's) as empty bytes, unread."""
    try:
        return store.read(path, MAX_LOCK_BYTES)
    except ManifestError:
        version = store.version(path)
        return None if version == store.absent else Versioned(b"", version)


# ----------------------------------------------------------------------------- local: an OS lock


def _open_lock_file(path: str) -> int:
    """OUTPUT/.lock opened for the OS lock. Never through a symbolic link (the file it points to,
    outside the output, would be truncated and overwritten with the lock's JSON), and only a
    regular file: anything else is refused in one line (LockHeld) naming it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise LockHeld(f"{path} is a symbolic link (to {os.readlink(path)!r}): the output lock is never taken "
                           "through a link, which would write outside the output. Remove the link, or choose another "
                           "--output") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LockHeld(f"{path} is not a regular file: the output lock cannot be taken there. Remove it, or choose "
                       "another --output")
    return fd


class LocalLock(OutputLock):
    def __init__(self, output: str, info: LockInfo, fd: int, took_over: LockInfo | None):
        self.output, self.run_id, self.info, self._fd, self.took_over = output, info.run_id, info, fd, took_over
        self.path = layout.lock_path(output)

    @classmethod
    def take(cls, output: str, run_id: str, expiry_s: float) -> "LocalLock":
        path = layout.lock_path(output)
        os.makedirs(output, exist_ok=True)
        for _ in range(5):
            fd = _open_lock_file(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = LockInfo.from_bytes(os.pread(fd, 1 << 16, 0))
                os.close(fd)
                who = holder.describe() if holder else "another run (its lock file is still being written)"
                raise LockHeld(
                    f"{output} is being written by {who}, whose process holds the OS lock on {path} "
                    "(a paused run keeps it until it ends). Wait for that run to end, end that process to free the "
                    "output, or choose another --output") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the file was released (unlinked) between our open and our lock
                os.close(fd)
                continue
            previous = LockInfo.from_bytes(os.pread(fd, 1 << 16, 0))
            now = time.time()
            info = LockInfo(run_id, socket.gethostname(), os.getpid(), now, now + expiry_s)
            os.ftruncate(fd, 0)
            os.pwrite(fd, info.to_bytes(), 0)
            os.fsync(fd)
            return cls(output, info, fd, previous)
        raise LockHeld(f"could not take the lock {path}: other runs keep taking and releasing it; try again")

    def check(self) -> None:
        if self._fd < 0:
            raise _lost(self.output, self.run_id, None, "it was released")
        try:
            same = os.stat(self.path).st_ino == os.fstat(self._fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            raise _lost(self.output, self.run_id, read_lock(self.output), f"{self.path} was removed or replaced")

    def release(self) -> None:
        if self._fd < 0:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.remove(self.path)  # while still locked: a run waiting on it re-opens the new file
        except OSError:
            pass
        os.close(self._fd)
        self._fd = -1


# ----------------------------------------------------------------------------- gs://: a renewed lease


class LeaseLock(OutputLock):
    def __init__(self, output: str, info: LockInfo, generation: int, expiry_s: float, took_over: LockInfo | None):
        self.output, self.run_id, self.info, self.took_over = output, info.run_id, info, took_over
        self.path = layout.lock_path(output)
        self._store: GcsStorage = storage_for(output)  # type: ignore[assignment]
        self._generation = generation
        self._expiry_s = expiry_s
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self.lost: LockLost | None = None
        self.on_lost: Callable[[], None] | None = None  # called by the renewer when it finds the lease lost
        self._thread = threading.Thread(target=self._renew_loop, name="prepack-lock-renew", daemon=True)

    @classmethod
    def take(cls, output: str, run_id: str, expiry_s: float, renew: bool = True) -> "LeaseLock":
        store = storage_for(output)
        path = layout.lock_path(output)
        took_over = None
        for _ in range(5):
            now = time.time()
            info = LockInfo(run_id, socket.gethostname(), os.getpid(), now, now + expiry_s)
            started = time.monotonic()
            generation = store.create(path, info.to_bytes())  # idempotent: a retried create finds its own bytes
            if generation is not None:
                lock = cls(output, info, int(generation), expiry_s, took_over)
                try:
                    _judge_trip(output, time.monotonic() - started, expiry_s)  # before any work
                except LeaseTooShort:
                    lock.release()
                    raise
                if renew:
                    lock._thread.start()
                return lock
            current = _read_lock_file(store, path)
            if current is None:
                continue  # released between our create and our read: try again
            holder = LockInfo.from_bytes(current.data)
            if holder is not None and holder.run_id == run_id:
                # Our own lock (a create retried after its response was lost wrote other bytes
                # than these: a new `created`); adopt it rather than refuse ourselves.
                lock = cls(output, holder, int(current.version), expiry_s, took_over)
                lock.check()
                if renew:
                    lock._thread.start()
                return lock
            if holder is not None and holder.expires >= time.time():
                raise LockHeld(
                    f"{output} is being written by {holder.describe()}; its lease {path} expires "
                    f"{time.strftime('%H:%M:%S UTC', time.gmtime(holder.expires))} unless that run renews it. Wait "
                    "for that run to end, or choose another --output")
            if holder is None:  # its writer died mid-write, or no run wrote it
                log.warning(f"{path} is corrupt (not a lock any run writes: half-written, or times such as an expiry of "
                            "1e308 or Infinity); taking it over as a stale lock")
            took_over = holder or LockInfo("unreadable", "unknown", 0, 0.0, 0.0)
            store.delete_if(path, current.version)  # of the runs judging it stale, one deletes it
        raise LockHeld(f"could not take the lock {path}: other runs keep taking it; try again")

    def _renew_loop(self) -> None:
        every = min(RENEW_EVERY_S, self._expiry_s / 3)
        while not self._stop.wait(every):
            try:
                failpoints.hit("lock_renew")
                self.check()
            except LockLost:
                if self.on_lost is not None and not self._stop.is_set():
                    self.on_lost()  # stop the run at once, mid-pipeline included
                return
            except Exception:  # a storage hiccup: the next tick, or the next check, tries again
                pass

    def check(self) -> None:
        """Renews the lease if this run still holds it (ifGenerationMatch = its generation);
        raises LockLost naming the owner otherwise. Storage decides, not this process's clock.
        Once the main thread has found the loss, the renewer just stops."""
        with self._guard:
            if self.lost is not None:
                if threading.current_thread() is self._thread:
                    self._stop.set()
                raise self.lost
            info = dataclasses.replace(self.info, expires=time.time() + self._expiry_s)
            started = time.monotonic()
            try:
                self._generation = int(self._store.write_if(self.path, info.to_bytes(), self._generation, tmp=""))
                self.info = info
            except SwitchRefused as e:
                why = "its lease expired and was taken over" if e.current is not None else f"{self.path} was removed"
                self.lost = _lost(self.output, self.run_id, LockInfo.from_bytes(e.current), why)
                raise self.lost from None
            try:
                _judge_trip(self.output, time.monotonic() - started, self._expiry_s)
            except LeaseTooShort as e:
                self.lost = e
                raise

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._guard:
            try:
                self._store.delete_if(self.path, self._generation)
            except Exception:
                pass
