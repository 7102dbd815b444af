"""How counts and rates read in the commands' one-line summaries: "1 example", "2 examples",
and a rate with the digits it has ("0.27 examples/s" for a tiny run, never "0 examples/s")."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` with its noun, singular only for exactly one: "1 example", "1,200 examples"."""
    return f"{n:,} {noun if n == 1 else (plural or noun + 's')}"


def rate(count: float, seconds: float, unit: str) -> str:
    """count / seconds per second: whole numbers from 100 up, three significant digits below,
    "under 0.01" below that; "no time measured" when `seconds` is not positive."""
    if seconds <= 0:
        return "no time measured"
    per_s = count / seconds
    if per_s >= 100:
        return f"{per_s:,.0f} {unit}/s"
    if per_s >= 0.01:
        return f"{per_s:.3g} {unit}/s"
    return f"under 0.01 {unit}/s" if per_s > 0 else f"0 {unit}/s"
