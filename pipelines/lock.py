"""One writer per output: OUTPUT/.lock, created exclusively, with an owner and an expiry.

    lock = OutputLock.acquire(output, run_id)   # raises LockHeld naming the owner
    ...                                          # a daemon thread renews the expiry
    lock.check()                                 # at publish time: still ours?
    lock.release()

Exclusive creation is the storage's own: locally O_CREAT|O_EXCL, on gs:// an
upload with ifGenerationMatch=0. Only one of two racing runs gets the lock.

A lock is stale when its expiry has passed (the owner stopped renewing it: it was
killed) or, on the same host, its owner's process is gone. Taking over is as
exclusive as creating: on gs:// the stale lock is deleted with ifGenerationMatch
= the generation that was judged stale, so of two runs judging it stale only one
deletes it, and then both race for the exclusive create. Locally a takeover
marker (O_EXCL) admits one run at a time to re-read, delete and re-create; a
marker older than TAKEOVER_MARKER_S is itself stale (its run was killed between
two file operations) and is removed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from typing import Any

LOCK_NAME = ".lock"
TAKEOVER_NAME = ".lock.takeover"
EXPIRY_S = 600.0  # a lock not renewed for this long is stale
RENEW_EVERY_S = 60.0
TAKEOVER_MARKER_S = 30.0


class LockHeld(RuntimeError):
    """Another live run holds the output."""


class LockLost(RuntimeError):
    """This run's lock was taken over or removed while it ran."""


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
    def from_bytes(cls, data: bytes) -> "LockInfo | None":
        try:
            d = json.loads(data.decode("utf-8"))
            return cls(str(d["run_id"]), str(d["host"]), int(d["pid"]), float(d["created"]), float(d["expires"]))
        except Exception:  # a half-written lock: its writer died mid-write
            return None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.created))
        return f"run {self.run_id} (pid {self.pid} on {self.host}, since {when})"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale(info: LockInfo | None, now: float | None = None) -> bool:
    if info is None:
        return True
    now = time.time() if now is None else now
    if info.expires < now:
        return True
    return info.host == socket.gethostname() and not _pid_alive(info.pid)


def lock_path(output: str) -> str:
    return f"{output.rstrip('/')}/{LOCK_NAME}"


# ----------------------------------------------------------------------------- storage


class _LocalStore:
    def __init__(self, path: str):
        self.path = path
        self.marker = os.path.join(os.path.dirname(path), TAKEOVER_NAME)

    def create(self, data: bytes) -> bool:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return True

    def read(self) -> tuple[bytes, Any] | None:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return data, data  # locally the content is the version

    def replace_if(self, version: Any, data: bytes) -> bool:
        current = self.read()
        if current is None or current[1] != version:
            return False
        tmp = f"{self.path}.renew-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.path)
        return True

    def delete_if(self, version: Any) -> bool:
        """Deletes the lock if it still holds `version`; one process at a time (takeover marker)."""
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                if time.time() - os.path.getmtime(self.marker) > TAKEOVER_MARKER_S:
                    os.remove(self.marker)
            except FileNotFoundError:
                pass
            return False
        os.close(fd)
        try:
            current = self.read()
            if current is None or current[1] != version:
                return False
            os.remove(self.path)
            return True
        finally:
            os.remove(self.marker)


class _GcsStore:
    def __init__(self, path: str):
        from pipelines import outputs

        bucket, key = outputs.split_gcs(path)
        self.blob_name = key
        self.bucket = outputs.gcs_client().bucket(bucket)

    def _blob(self):
        return self.bucket.blob(self.blob_name)

    def create(self, data: bytes) -> bool:
        from google.api_core import exceptions

        try:
            self._blob().upload_from_string(data, if_generation_match=0)
        except exceptions.PreconditionFailed:
            return False
        return True

    def read(self) -> tuple[bytes, Any] | None:
        from google.api_core import exceptions

        blob = self._blob()
        try:
            blob.reload()
        except exceptions.NotFound:
            return None
        generation = blob.generation  # read first: a download may reset the blob's properties
        try:
            return blob.download_as_bytes(if_generation_match=generation), generation
        except (exceptions.NotFound, exceptions.PreconditionFailed):
            return self.read()

    def replace_if(self, version: Any, data: bytes) -> bool:
        from google.api_core import exceptions

        try:
            self._blob().upload_from_string(data, if_generation_match=version)
        except (exceptions.PreconditionFailed, exceptions.NotFound):
            return False
        return True

    def delete_if(self, version: Any) -> bool:
        from google.api_core import exceptions

        try:
            self._blob().delete(if_generation_match=version)
        except (exceptions.PreconditionFailed, exceptions.NotFound):
            return False
        return True


def _store(path: str):
    return _GcsStore(path) if path.startswith("gs://") else _LocalStore(path)


# ----------------------------------------------------------------------------- the lock


class OutputLock:
    def __init__(self, output: str, info: LockInfo, store: Any, version: Any):
        self.output = output
        self.path = lock_path(output)
        self.info = info
        self._store = store
        self._version = version
        self._stop = threading.Event()
        self._guard = threading.Lock()
        self.lost: str | None = None
        self._thread = threading.Thread(target=self._renew_loop, name="prepack-lock-renew", daemon=True)

    @classmethod
    def acquire(cls, output: str, run_id: str, expiry_s: float | None = None, renew: bool = True) -> "OutputLock":
        """Creates the lock exclusively, taking over a stale one; raises LockHeld for a live one."""
        expiry_s = EXPIRY_S if expiry_s is None else expiry_s
        store = _store(lock_path(output))
        for _ in range(5):
            now = time.time()
            info = LockInfo(run_id, socket.gethostname(), os.getpid(), now, now + expiry_s)
            data = info.to_bytes()
            if store.create(data):
                current = store.read()
                lock = cls(output, info, store, current[1] if current else None)
                lock._expiry_s = expiry_s
                if renew:
                    lock._thread.start()
                return lock
            current = store.read()
            if current is None:
                continue  # released between our create and read: try again
            holder = LockInfo.from_bytes(current[0])
            if not is_stale(holder):
                raise LockHeld(
                    f"{output} is being written by {holder.describe()}; its lock {lock_path(output)} expires "
                    f"{time.strftime('%H:%M:%S UTC', time.gmtime(holder.expires))}. Wait for that run to end, or "
                    f"choose another --output"
                )
            store.delete_if(current[1])  # one of the runs judging it stale deletes it
        raise LockHeld(f"could not take the lock {lock_path(output)}: other runs keep taking it; try again")

    def _renew_loop(self) -> None:
        every = min(RENEW_EVERY_S, self._expiry_s / 3)
        while not self._stop.wait(every):
            try:
                self.renew()
            except Exception:  # a storage hiccup: the next tick tries again; check() decides at publish
                pass

    def renew(self) -> None:
        with self._guard:
            if self.lost:
                return
            info = dataclasses.replace(self.info, expires=time.time() + self._expiry_s)
            if not self._store.replace_if(self._version, info.to_bytes()):
                self.lost = "the lock file was changed or removed by someone else"
                return
            current = self._store.read()
            self.info = info
            self._version = current[1] if current else None

    def check(self) -> None:
        """Raises LockLost unless this run still holds the lock (called right before publishing)."""
        with self._guard:
            current = self._store.read()
            holder = LockInfo.from_bytes(current[0]) if current else None
            if self.lost or holder is None or holder.run_id != self.info.run_id or current[1] != self._version:
                who = holder.describe() if holder else "nobody"
                raise LockLost(
                    f"the lock {self.path} is no longer held by this run (run {self.info.run_id}; it is held by {who}); "
                    "nothing was published. Make sure one run at a time writes this output, then run again"
                )

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._guard:
            try:
                self._store.delete_if(self._version)
            except Exception:
                pass


def read_lock(output: str) -> LockInfo | None:
    current = _store(lock_path(output)).read()
    return LockInfo.from_bytes(current[0]) if current else None
