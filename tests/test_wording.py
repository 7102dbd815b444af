"""Counts and rates in the one-line summaries (prepack/wording.py): grammatical, and a tiny run's
rate is its rate, not 0."""

from __future__ import annotations

from pipelines.launch.report import run_line
from prepack.wording import counted, rate


def test_counts_are_singular_only_for_one():
    assert [counted(n, "example") for n in (0, 1, 2, 1200)] == ["0 examples", "1 example", "2 examples", "1,200 examples"]
    assert counted(1, "entry", "entries") == "1 entry" and counted(3, "entry", "entries") == "3 entries"


def test_rates_keep_their_digits():
    assert rate(1, 3.7, "examples") == "0.27 examples/s"
    assert rate(400, 7.3, "examples") == "54.8 examples/s"
    assert rate(40_000, 7.3, "examples") == "5,479 examples/s"
    assert rate(1, 1000, "rows") == "under 0.01 rows/s"
    assert rate(0, 2.0, "rows") == "0 rows/s" and rate(5, 0.0, "rows") == "no time measured"


def test_pack_ends_with_a_grammatical_line():
    assert run_line(1, 3.7) == "1 example in 3.7 s (0.27 examples/s)"
    assert run_line(400, 7.3) == "400 examples in 7.3 s (54.8 examples/s)"
