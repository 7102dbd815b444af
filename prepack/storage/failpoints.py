"""Named failpoints, set from the environment: PREPACK_FAILPOINTS="NAME=ACTION[;NAME=ACTION]".

Tests and operators pause, stop or break a run at a chosen step instead of by timing
luck (as TiKV's fail-rs does with FAILPOINTS). Code marks a step with

    failpoints.hit("after_manifest_switch", "L64")

which acts when PREPACK_FAILPOINTS names `after_manifest_switch:L64` (that hit only)
or `after_manifest_switch` (every hit). Actions:

    stop             the process sends itself SIGSTOP, as an OS pause would: every thread
                     stops (the lock renewer included) until someone sends SIGCONT
    sleep(SECONDS)   the calling thread sleeps
    exit(CODE)       the process ends at once with CODE (os._exit: no clean-up runs)
    error            raises InjectedFault, as a storage or program error would

The points are listed in POINTS (and in docs/manifest.md), the details each takes in DETAILS;
they mark steps of `prepack pack`'s commit (pipelines/, which imports this module as
pipelines.faults.failpoints) and of the core's own writers (prepack/storage/own_files.py);
a name not listed there, a detail its point does not take, a detail the run never hits (a max
length it does not pack, `tokens` when it publishes no tokenized set), or an action not above,
is refused with one line before any work (`check`). An injected error is the job's one-line failure.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
import re
import signal
import time

ENV = "PREPACK_FAILPOINTS"

# name -> when it is hit. A ":DETAIL" suffix (a length, `tokens`) narrows a point to one hit.
POINTS: dict[str, str] = {
    "after_lock": "the output lock is held, before the pipeline runs",
    "before_publish": "the pipeline's result is checked, before anything is moved into the output",
    "shards_in_place": "every new file is beside the old ones, before the first manifest switch",
    "after_manifest_switch": "after each set's manifest switch (`:L<length>` or `:tokens` for one)",
    "before_tokens_switch": "the shard sets are switched, before the tokenized set's manifest",
    "after_tokens_switch": "the tokenized set's manifest is switched, before the run record",
    "after_run_record": "published.json is written, before old files are deleted",
    "before_delete": "before the old files this run replaced are deleted (`:L<length>` or `:tokens`)",
    "after_publish": "everything is published and cleaned, before the lock is released",
    "lock_renew": "the gs:// lease renewer wakes, before it renews (`error`: a storage error it retries at its next tick)",
    "input_read": "a worker starts reading an input file (`:start`), and has read it whole, before its change check (`:whole_file`)",
    # prepack/storage/own_files.py's swap of a folder's own files (--save-lora, export --merge, tokenizer-folder)
    "own_files_staged": "every new file of a folder's own files is staged whole beside it, before its swap journal",
    "own_files_journal": "the swap journal is written, before the first old file is moved aside",
    "own_files_aside": "after each old file is moved aside (`:<k>` for the k-th, from 1)",
    "own_files_placed": "after each new file is moved in (`:<k>` for the k-th, from 1)",
}

# The details a point takes (a ":DETAIL" suffix): a spec with any other detail is refused,
# since it would never fire. Points not listed here take none.
DETAILS: dict[str, tuple[str, re.Pattern[str]]] = {
    "after_manifest_switch": ("L<length> or tokens", re.compile(r"L[1-9][0-9]{0,8}|tokens")),
    "before_delete": ("L<length> or tokens", re.compile(r"L[1-9][0-9]{0,8}|tokens")),
    "input_read": ("start or whole_file", re.compile(r"start|whole_file")),
    "own_files_aside": ("a count from 1", re.compile(r"[1-9][0-9]{0,5}")),
    "own_files_placed": ("a count from 1", re.compile(r"[1-9][0-9]{0,5}")),
}

_LENGTH_DETAILS = ("after_manifest_switch", "before_delete")  # the points whose `L<length>` names one set

_ACTION = re.compile(r"^(?P<kind>stop|error|sleep|exit)(?:\((?P<arg>[^()]*)\))?$")


class FailpointError(ValueError):
    """PREPACK_FAILPOINTS cannot be read; the message is the one line to show."""


class InjectedFault(RuntimeError):
    """Raised by the `error` action."""


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # stop | sleep | exit | error
    arg: float = 0.0

    def run(self, point: str) -> None:
        if self.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.kind == "sleep":
            time.sleep(self.arg)
        elif self.kind == "exit":
            os._exit(int(self.arg))
        else:
            raise InjectedFault(f"failpoint {point}: injected error")


def _bad(spec: str, why: str) -> FailpointError:
    return FailpointError(f"{ENV}: {spec!r}: {why}")


def _action(spec: str, text: str) -> Action:
    m = _ACTION.match(text.strip())
    if not m:
        raise _bad(spec, f"unknown action {text.strip()!r}; use stop, sleep(SECONDS), exit(CODE) or error")
    kind, arg = m["kind"], m["arg"]
    if kind in ("stop", "error"):
        if arg is not None:
            raise _bad(spec, f"{kind} takes no argument")
        return Action(kind)
    if arg is None:
        raise _bad(spec, f"{kind} needs an argument: {kind}({'SECONDS' if kind == 'sleep' else 'CODE'})")
    if kind == "sleep":
        try:
            seconds = float(arg)
        except ValueError:
            seconds = -1.0
        if not seconds >= 0 or seconds == float("inf"):
            raise _bad(spec, f"sleep needs a number of seconds >= 0, got {arg!r}")
        return Action("sleep", seconds)
    if not re.fullmatch(r"\d{1,3}", arg.strip()) or int(arg) > 255:
        raise _bad(spec, f"exit needs an exit status 0-255, got {arg!r}")
    return Action("exit", int(arg))


def parse(text: str) -> dict[str, Action]:
    """NAME[:DETAIL]=ACTION entries separated by ';' -> {NAME[:DETAIL]: Action}; raises FailpointError."""
    out: dict[str, Action] = {}
    for spec in (s.strip() for s in text.split(";")):
        if not spec:
            continue
        name, eq, action = spec.partition("=")
        name = name.strip()
        if not eq or not name:
            raise _bad(spec, "expected NAME=ACTION (for example before_publish=stop)")
        base, colon, detail = name.partition(":")
        if base not in POINTS:
            raise _bad(spec, f"unknown failpoint {base!r}; known: {', '.join(POINTS)}")
        if colon:
            _check_detail(spec, base, detail)
        if name in out:
            raise _bad(spec, f"{name} is set twice")
        out[name] = _action(spec, action)
    return out


def _check_detail(spec: str, point: str, detail: str) -> None:
    if point not in DETAILS:
        raise _bad(spec, f"{point} takes no detail (it is hit once per run); use {point}=ACTION")
    takes, pattern = DETAILS[point]
    if not pattern.fullmatch(detail):
        raise _bad(spec, f"{point} takes the detail {takes}, not {detail[:40]!r}")


_cache: tuple[str, dict[str, Action]] = ("", {})


def configured() -> dict[str, Action]:
    """The failpoints set in the environment now (re-read when it changes); raises FailpointError."""
    global _cache
    text = os.environ.get(ENV, "")
    if text != _cache[0]:
        _cache = (text, parse(text))
    return _cache[1]


def check(max_lengths: Iterable[int] | None = None, publishes_tokens: bool = True) -> None:
    """Raises FailpointError (one line) when PREPACK_FAILPOINTS is set but cannot be read, or (given
    the run's max lengths and whether it publishes a tokenized set) names a hit the run never makes:
    `before_delete:L9999=error` was accepted and never fired."""
    points = configured()
    if max_lengths is None:
        return
    lengths = sorted(set(max_lengths))
    for name in points:
        base, _, detail = name.partition(":")
        if detail == "tokens" and not publishes_tokens:
            raise FailpointError(f"{ENV}: {name!r}: this run publishes no tokenized set (--no-tokens or --from-tokens), "
                                 "so it would never fire")
        if base in _LENGTH_DETAILS and detail.startswith("L") and int(detail[1:]) not in lengths:
            raise FailpointError(f"{ENV}: {name!r}: this run packs no max length {detail[1:]} (its --max-length: "
                                 f"{' '.join(map(str, lengths))}), so it would never fire")


def hit(point: str, detail: str | None = None) -> None:
    """Marks the step `point` (with an optional DETAIL such as `L64`): runs its action, if set."""
    assert point in POINTS, f"undeclared failpoint {point}"
    points = configured()
    action = points.get(f"{point}:{detail}") if detail is not None else None
    action = action or points.get(point)
    if action is not None:
        action.run(point if detail is None else f"{point}:{detail}")
