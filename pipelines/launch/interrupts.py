"""SIGINT and SIGTERM end `prepack pack` within seconds, workers included, staging cleaned.

Beam's local runner starts its SDK workers as child processes and waits on them
from threads; a signal sent to the main process alone (kill -INT / kill -TERM)
used to leave the main process waiting for workers that never heard of it. So,
on the first signal:
1. every descendant process (the workers) gets SIGTERM at once;
2. KeyboardInterrupt is raised in the main thread, which unwinds through the
   job's clean-up (staging removed, lock released) and exits non-zero;
3. a watchdog gives that GRACE_S seconds; if the process is still alive then, it
   SIGKILLs the descendants, runs the registered clean-ups itself and exits with
   128 + the signal number.
A second signal goes straight to step 3. On Dataflow, the job's KeyboardInterrupt
handler cancels the submitted job (pipelines/launch/graph.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

GRACE_S = 5.0

_cleanups: dict[int, Callable[[], None]] = {}
_received: int | None = None
_lock = threading.Lock()


def register(cleanup: Callable[[], None]) -> int:
    """A clean-up the watchdog runs if the main thread cannot; returns a key for unregister."""
    key = id(cleanup)
    _cleanups[key] = cleanup
    return key


def unregister(key: int) -> None:
    _cleanups.pop(key, None)


def received() -> int | None:
    """The signal that interrupted this process, if any."""
    return _received


def descendants(pid: int | None = None) -> list[int]:
    """Process ids of every descendant (Linux /proc; elsewhere none are found)."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _run_cleanups() -> None:
    for cleanup in list(_cleanups.values()):
        try:
            cleanup()
        except Exception:
            pass


def _exit_now(signum: int) -> None:
    _signal_all(descendants(), signal.SIGKILL)
    _run_cleanups()
    print(f"prepack pack: stopped by signal {signum}; nothing new was published by this run", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def _watchdog(signum: int) -> None:
    threading.Event().wait(GRACE_S)
    _exit_now(signum)


def _handler(signum: int, frame: object) -> None:
    global _received
    with _lock:
        first = _received is None
        _received = signum
    if not first:
        _exit_now(signum)
    # The runner's threads report their dying workers with tracebacks: the line we print says it all.
    threading.excepthook = lambda args: None
    _signal_all(descendants(), signal.SIGTERM)
    threading.Thread(target=_watchdog, args=(signum,), name="prepack-interrupt-watchdog", daemon=True).start()
    raise KeyboardInterrupt(f"signal {signum}")


def stop_main() -> None:
    """Stops the job from another thread (the lock renewer, when the lock is lost): as SIGTERM
    would, workers included, where the handler is installed (`prepack pack`); otherwise a
    KeyboardInterrupt in the main thread."""
    if signal.getsignal(signal.SIGTERM) is _handler:
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        import _thread

        _thread.interrupt_main()


def install() -> None:
    """Installs the handler for SIGINT and SIGTERM (main thread only)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _handler)


def exit_if_signalled(code: int) -> None:
    """After a signal, exit at once: Beam's leftover non-daemon threads would otherwise hold
    the interpreter open at shutdown."""
    if _received is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
