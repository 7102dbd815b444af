"""After Ctrl-C, `prepack pack` says one line, not the workers' dying words; nor their tracebacks of a failure the launcher states in one line.

Ctrl-C signals the terminal's whole process group: Beam's SDK workers (child processes
sharing the launcher's stderr) get SIGINT too and print KeyboardInterrupt tracebacks,
"CRITICAL ... sdk harness failed" and gRPC's "terminate called without an active
exception"; the runner's threads log their lost workers. None of it says more than the
launcher's last line. (Keeping SIGINT from the workers is not possible from here: Beam
starts them through `sh -c`, and dash clears the signal mask of what it forks.)

So while the job runs, file descriptor 2, which the workers inherit, is a pipe that a
thread copies to the real stderr; the launcher's own Python output goes to the real stderr
directly. The copying thread blocks SIGINT and SIGTERM itself, so a signal the main thread
has not taken yet shows in its sigpending(); once taken, Python's C-level handler writes
the wakeup byte (signal.set_wakeup_fd). Each chunk is held HOLD_S before it is copied: a
signal seen by then drops it and everything after, and switches logging off. A worker that
took the same Ctrl-C before the launcher was even signalled is covered by that hold.
Progress lines and warnings pass through, HOLD_S late; `--verbose` does not use this class.

A worker whose bundle fails prints the whole traceback to its stderr (Beam's SDK harness does,
besides logging it); for a failure the launcher states in one line itself (a truncated .gz, an
input over a limit: pipelines/faults/failures.is_known) that traceback is dropped here
(KnownFailureTracebacks), so the line is the only one; other tracebacks, a bug's, pass through.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from typing import IO, Any

HOLD_S = 0.25
_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_TRACEBACK = b"Traceback (most recent call last):"
_CHAINED = (b"During handling of the above exception, another exception occurred:",
            b"The above exception was the direct cause of the following exception:")


class KnownFailureTracebacks:
    """Drops, from a stream of lines, each Python traceback (chained ones included) that reports a
    failure pipelines/faults/failures.py states in one line; passes everything else through, in order.
    A traceback is held until it is complete: a blank line after its exception line followed by a
    line that chains no further traceback, or `flush()` (nothing more came for a while, or the end)."""

    def __init__(self) -> None:
        self._partial = b""  # an unfinished line
        self._block: list[bytes] = []  # the traceback held so far
        self._state = "out"  # out | frames (inside a traceback) | message (its exception) | gap (a blank after it)

    def feed(self, data: bytes) -> bytes:
        """What may be written now of `data`."""
        out = []
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            out.append(self._line(line + b"\n"))
        return b"".join(out)

    def flush(self, final: bool = False) -> bytes:
        """A complete traceback held (or, `final`, whatever is held), judged; and an unfinished line at the end."""
        out = b""
        if self._block and (final or self._state in ("message", "gap")):
            out = self._judged()
        if final and self._partial:
            out, self._partial = out + self._partial, b""
        return out

    def _line(self, line: bytes) -> bytes:
        bare = line.rstrip(b"\r\n")
        if self._state == "out":
            if bare.startswith(_TRACEBACK):
                self._block, self._state = [line], "frames"
                return b""
            return line
        if self._state == "gap" and bare and not bare.startswith(_TRACEBACK) and bare not in _CHAINED:
            return self._judged() + self._line(line)  # the traceback ended before this line
        self._block.append(line)
        if bare.startswith(_TRACEBACK) or bare in _CHAINED:
            self._state = "frames"
        elif self._state == "frames" and bare and not bare[:1].isspace():
            self._state = "message"  # the exception line: `module.Error: what`
        elif self._state in ("message", "gap") and not bare:
            self._state = "gap"
        return b""

    def _judged(self) -> bytes:
        from pipelines.faults.failures import is_known

        block, self._block, self._state = b"".join(self._block), [], "out"
        return b"" if is_known(block.decode("utf-8", "replace")) else block


class QuietAfterSignal:
    """Context manager around the job (main thread only; POSIX)."""

    def __init__(self) -> None:
        self.interrupted = threading.Event()
        self._real_fd = -1
        self._saved_stderr: IO[str] | None = None
        self._wake: tuple[int, int] = (-1, -1)
        self._previous_wakeup_fd = -1
        self._thread: threading.Thread | None = None
        self._tracebacks = KnownFailureTracebacks()

    def __enter__(self) -> "QuietAfterSignal":
        sys.stderr.flush()
        self._real_fd = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        self._wake = os.pipe()
        os.set_blocking(self._wake[0], False)
        os.set_blocking(self._wake[1], False)
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._wake[1], warn_on_full_buffer=False)
        if sys.stderr is sys.__stderr__:  # not when a test captures sys.stderr itself
            self._saved_stderr = sys.stderr
            sys.stderr = open(self._real_fd, "w", buffering=1, closefd=False, errors="backslashreplace")
        self._thread = threading.Thread(target=self._copy, args=(read_end,), name="prepack-worker-stderr", daemon=True)
        self._thread.start()
        return self

    def _signalled(self, wait_s: float, watched: list[int]) -> bool:
        """Whether a signal came, waiting up to wait_s for one."""
        deadline = time.monotonic() + wait_s
        while not self.interrupted.is_set():
            if _SIGNALS & signal.sigpending():
                self._drop_from_now()
                break
            if self._wake[0] in watched:
                try:
                    data = os.read(self._wake[0], 64)
                except BlockingIOError:
                    data = None
                if data:
                    if any(s in data for s in _SIGNALS):
                        self._drop_from_now()
                        break
                elif data == b"":  # __exit__ closed the write end: only the pipe is left to drain
                    watched.remove(self._wake[0])
            left = deadline - time.monotonic()
            if left <= 0:
                break
            select.select([fd for fd in watched if fd == self._wake[0]], [], [], min(left, 0.05))
        return self.interrupted.is_set()

    def _copy(self, read_end: int) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)  # so that sigpending() shows them here
        watched = [read_end, self._wake[0]]
        idle = 0.0
        try:
            while True:
                ready, _, _ = select.select(watched, [], [], 0.05)
                if read_end not in ready:
                    self._signalled(0, watched)
                    idle += 0.05
                    if idle >= HOLD_S:  # a traceback held this long is complete: judge it
                        self._write(self._tracebacks.flush())
                    continue
                idle = 0.0
                data = os.read(read_end, 65536)
                if not data:
                    self._write(self._tracebacks.flush(final=True))
                    return
                if not self._signalled(HOLD_S, watched):
                    self._write(self._tracebacks.feed(data))
        except OSError:
            return
        finally:
            os.close(read_end)
            os.close(self._wake[0])
            os.close(self._real_fd)

    def _write(self, data: bytes) -> None:
        if data and not self.interrupted.is_set():
            os.write(self._real_fd, data)

    def _drop_from_now(self) -> None:
        if not self.interrupted.is_set():
            self.interrupted.set()
            # The runner's threads report their killed workers; the process ends after the
            # launcher's last line, so logging stays off.
            logging.disable(logging.CRITICAL)

    def __exit__(self, *exc: Any) -> None:
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        sys.stderr.flush()
        # Workers still alive keep the pipe open (the thread, a daemon, drains it); otherwise
        # the pipe's last write end closes here and the thread ends.
        os.dup2(self._real_fd, 2)
        if self._saved_stderr is not None:
            sys.stderr = self._saved_stderr
        os.close(self._wake[1])
        if not self.interrupted.is_set():
            self._thread.join(timeout=2 * HOLD_S + 1)  # the workers' last lines, still held
