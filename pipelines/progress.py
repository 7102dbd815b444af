"""Progress lines of long work where no bar can be drawn: `prepack pack`'s worker processes
(their stderr is a pipe the launcher copies) and `prepack preflight` reading and tokenizing in
process. tqdm counts and times the work; each of its redraws is printed as one line of its own,
at most every `every_s` seconds, none before the first `every_s` (short runs stay quiet)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

from tqdm import tqdm

EVERY_S = 10.0


class _Lines:
    """A file for tqdm that turns its in-place redraws ("\\r" + status) into one line each, and
    drops the clearing it writes when it closes."""

    def __init__(self, out: TextIO | None) -> None:
        self._out = out

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line:
            out = self._out or sys.stderr  # looked up when written: a test may capture stderr meanwhile
            out.write(line + "\n")
            out.flush()

    def flush(self) -> None:
        (self._out or sys.stderr).flush()


def counter(desc: str, unit: str, every_s: float = EVERY_S, out: TextIO | None = None, total: int | None = None) -> tqdm:
    """A counter printing `<desc>: <n> <unit> in <elapsed> (<rate> <unit>/s)`, or with a total
    `<desc>: <n>/<total> <unit> in <elapsed>, about <remaining> left`; `update(n)` counts."""
    shown = ("{desc}: {n_fmt}{unit} in {elapsed} ({rate_fmt})" if total is None
             else "{desc}: {n_fmt}/{total_fmt}{unit} in {elapsed}, about {remaining} left")
    return tqdm(desc=desc, unit=f" {unit}", total=total, mininterval=every_s, miniters=1, delay=every_s, file=_Lines(out),
                disable=False, leave=False, dynamic_ncols=False, bar_format=shown)


@contextlib.contextmanager
def progress_of(desc: str, unit: str, out: TextIO | None = None, every_s: float = EVERY_S
                ) -> Iterator[Callable[[int, int], None]]:
    """A callback progress(done, total) for work that knows its total only when it starts (the
    model calls of `verify --model`, of `generate --score`): a `counter` with that total, made at
    the first call, closed on leaving."""
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = counter(desc, unit, every_s, out, total=total)
        bar.update(done - bar.n)

    try:
        yield progress
    finally:
        if bar is not None:
            bar.close()
