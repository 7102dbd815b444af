"""Progress lines of long work where no bar can be drawn: `prepack pack`'s worker processes
(their stderr is a pipe the launcher copies) and `prepack preflight` reading and tokenizing in
process. tqdm counts and times the work; each of its redraws is printed as one line of its own,
at most every `every_s` seconds, none before the first `every_s` (short runs stay quiet)."""

from __future__ import annotations

import sys
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


def counter(desc: str, unit: str, every_s: float = EVERY_S, out: TextIO | None = None) -> tqdm:
    """A counter printing `<desc>: <n> <unit> in <elapsed> (<rate> <unit>/s)`; `update(n)` counts."""
    return tqdm(desc=desc, unit=f" {unit}", mininterval=every_s, miniters=1, delay=every_s, file=_Lines(out),
                disable=False, leave=False, dynamic_ncols=False,
                bar_format="{desc}: {n_fmt}{unit} in {elapsed} ({rate_fmt})")
