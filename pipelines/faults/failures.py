"""Turning a failed pipeline into one line that names the file and what to do.

A worker's exception reaches the launcher wrapped by the runner (its message then
holds the worker's whole traceback). Errors raised on purpose in the workers are
InputFileError, whose message is already the line to show; it is found again in
the runner's text by its class name. A full disk is recognised by errno 28.
"""

from __future__ import annotations

import errno
import re


class ShardCheckError(AssertionError):
    """The rows that reached a writer are not the rows the plan put there (elements were lost
    or duplicated between steps); `one_line` turns it into the job's one-line error."""


class InputFileError(RuntimeError):
    """An input file cannot be read as a whole (truncated, corrupt, changed while the job ran);
    the message names the file and what to do."""


_INJECTED_FAULT = re.compile(r"InjectedFault: (?P<line>failpoint [^\n]+)")
_INPUT_FILE_ERROR = re.compile(r"InputFileError: (?P<line>[^\n]+)")
_SHARD_CHECK_ERROR = re.compile(r"ShardCheckError: (?P<line>[^\n]+)")
_RUNNER_SUFFIX = re.compile(r"\s*\[while running '[^\n]*'\]\s*$")  # Beam's note of the step
_NO_SPACE = re.compile(r"\[Errno 28\][^\n]*|No space left on device[^\n]*")


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


_KNOWN = re.compile(r"\b(InputFileError|InjectedFault|ShardCheckError): ")


def is_known(text: str) -> bool:
    """Whether `text` (a worker's log relayed by the runner, a traceback) reports a failure that
    `one_line` states itself: the launcher's last line says it, so the relay is noise."""
    return _KNOWN.search(text) is not None


def one_line(exc: BaseException, output: str) -> str | None:
    """The line to show for a pipeline failure we know, else None."""
    for e in _chain(exc):
        if isinstance(e, InputFileError):  # the in-process runner re-raises it, with a note appended
            return _RUNNER_SUFFIX.sub("", str(e).splitlines()[0]).strip()
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return no_space(output, getattr(e, "filename", None))
        if type(e).__name__ == "InjectedFault":  # pipelines.faults.failpoints, in a worker
            return injected(str(e).splitlines()[0])
        if type(e).__name__ == "ShardCheckError":
            return lost_rows(_RUNNER_SUFFIX.sub("", str(e).splitlines()[0]).strip())
    text = str(exc)
    m = _INPUT_FILE_ERROR.search(text)
    if m:
        return _RUNNER_SUFFIX.sub("", m.group("line")).strip()
    m = _INJECTED_FAULT.search(text)
    if m:
        return injected(m.group("line"))
    m = _SHARD_CHECK_ERROR.search(text)
    if m:
        return lost_rows(_RUNNER_SUFFIX.sub("", m.group("line")).strip())
    if _NO_SPACE.search(text):
        return no_space(output, None)
    return None


def injected(line: str) -> str:
    """A failpoint's `error` (PREPACK_FAILPOINTS) before anything was published."""
    return (f"{_RUNNER_SUFFIX.sub('', line).strip()} (PREPACK_FAILPOINTS); nothing new was published, the previous "
            "shard sets are intact")


def no_space(output: str, where: str | None) -> str:
    place = f" ({where})" if where else ""
    return (f"no space left on device while writing{place}: free space on the disk holding {output} and the temp "
            "folder, or choose another --output; nothing new was published, the previous shard sets are intact")


def lost_rows(detail: str) -> str:
    """The writers' row check (writer.ShardCheckError) failed: the runner lost or duplicated
    elements between steps. Never the input's fault, so the line says what to run instead."""
    return (f"the shard check failed, nothing was published, the previous shard sets are intact: {detail}. "
            "Elements were lost or duplicated between pipeline steps (a runner fault): run the job again; "
            "locally use --direct_running_mode=multi_processing (the default) or in_memory")
