"""Exact fills over a length histogram: rows that hold exactly L tokens wherever the lengths allow.

Best-fit-decreasing lands a few rows above the lower bound ceil(tokens / L) because it
never looks ahead: each long item takes the fullest row it fits, and the small gaps it
leaves add up (EN-FR at L 512: 514 rows against a bound of 507). Here each row is built
whole: take the longest length left, then fill the rest of the row with the subset of the
remaining lengths whose sum comes closest to the room left (a bounded subset-sum over the
histogram, at most L sums), and repeat that row, a *pattern*, as often as the counts left
allow. Rows are therefore described by patterns (a few per distinct length, not one per
row), so planning costs the same at 1B examples as at 1M and the state is O(patterns).

The work is counted in subset-sum cells (one cell: one sum, at one item count under a
segment cap, updated by one chunk of one length), plus the cells' worth of each chunk's,
each length's and each fill's fixed costs (CHUNK_CELLS, LENGTH_CELLS, FILL_CELLS), never in
seconds, so the result is the same on any machine: past `budget` cells the fill gives up and
the caller keeps BFD's plan (HistogramPlan.budget_exhausted, the manifest's
stats.planner_fallback).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

import numpy as np

# Cells of work one plan may spend: at most ~9 CPU-s on a shared 2-core machine, on any
# histogram (the fitted cost is 2.9 ns a cell there; docs/benchmarks.md, "The planner's budget").
DEFAULT_BUDGET_CELLS = 3_000_000_000


class BudgetExhausted(Exception):
    """The fill needed more subset-sum cells than its budget."""


@dataclasses.dataclass(frozen=True)
class Pattern:
    """One row's contents, `counts[i]` items of `lengths[i]` (lengths descending; a row lays
    its items out in that order), repeated on `repeats` consecutive rows."""

    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    repeats: int

    @property
    def tokens(self) -> int:
        return sum(n * k for n, k in zip(self.lengths, self.counts))

    @property
    def segments(self) -> int:
        return sum(self.counts)


@dataclasses.dataclass(frozen=True)
class PatternPlan:
    """Rows as patterns in row order: pattern p covers rows first_row[p] .. first_row[p] + repeats - 1."""

    max_length: int
    patterns: tuple[Pattern, ...]
    work: int  # subset-sum cells spent

    @property
    def num_rows(self) -> int:
        return sum(p.repeats for p in self.patterns)

    def segment_range(self) -> tuple[int, int]:
        counts = [p.segments for p in self.patterns]
        return (min(counts), max(counts)) if counts else (0, 0)

    def rows(self) -> list[list[int]]:
        """Rows as lists of lengths in row order (small plans: tests)."""
        out = []
        for p in self.patterns:
            row = [n for n, k in zip(p.lengths, p.counts) for _ in range(k)]
            out.extend(list(row) for _ in range(p.repeats))
        return out

    def class_runs(self) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        """(length, row, start, items) of every length's runs, longest length first, rows
        ascending: a length's run in a pattern is `items` slots from position `start` on each
        of the pattern's rows. O(rows the length touches) per length, one length at a time."""
        first_rows = np.cumsum([0] + [p.repeats for p in self.patterns])
        where: dict[int, list[tuple[int, int, int]]] = {}
        for index, p in enumerate(self.patterns):
            start = 0
            for n, k in zip(p.lengths, p.counts):
                where.setdefault(n, []).append((index, start, k))
                start += k
        for n in sorted(where, reverse=True):
            spans = where[n]
            repeats = np.array([self.patterns[i].repeats for i, _, _ in spans], dtype=np.int64)
            firsts = first_rows[[i for i, _, _ in spans]]
            # Rows of each span: firsts[j] .. firsts[j] + repeats[j] - 1, spans in row order.
            rows = np.repeat(firsts - np.cumsum(repeats) + repeats, repeats) + np.arange(int(repeats.sum()))
            starts = np.repeat(np.array([s for _, s, _ in spans], dtype=np.int64), repeats)
            items = np.repeat(np.array([k for _, _, k in spans], dtype=np.int64), repeats)
            yield n, rows, starts, items


def _chunks(lengths: np.ndarray, limits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Binary splitting of bounded multiplicities: up to `limits[i]` copies of lengths[i] as
    chunks of 1, 2, 4, ..., and the rest, so any count 0..limit is a subset of its chunks.
    Returns (index into lengths, copies) per chunk, lengths in the given order."""
    limits = np.asarray(limits, dtype=np.int64)
    # limit = (2**k - 1) + rest with 0 <= rest <= 2**k: the powers 1..2**(k-1), then rest when > 0.
    k = np.floor(np.log2(limits + 1)).astype(np.int64)
    k -= (1 << k) - 1 > limits  # guard float rounding at exact powers of two
    k += (1 << (k + 1)) - 1 <= limits
    rest = limits - ((1 << k) - 1)
    per = k + (rest > 0)
    index = np.repeat(np.arange(len(limits), dtype=np.int64), per)
    # Position of each chunk within its length: 0..per-1; chunk j < k holds 2**j, chunk k the rest.
    within = np.arange(len(index), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
    copies = np.where(within < k[index], 1 << within, rest[index])
    return index, copies.astype(np.int64)


# What a fill costs besides its cells, in cells of the same CPU: each chunk's pass over the table
# (a few array calls), each length a fill looks at (its limit and chunks), and each fill's setup.
# Fitted by least squares to process time on 8 histograms (up to 20,000 distinct lengths at L
# 65536, where chunks and lengths, not cells, take two thirds of the time; docs/benchmarks.md).
CHUNK_CELLS = 4096
LENGTH_CELLS = 8
FILL_CELLS = 32768


class _Work:
    def __init__(self, budget: int):
        self.budget, self.spent = budget, 0

    def _add(self, cells: int) -> None:
        self.spent += cells
        if self.spent > self.budget:
            raise BudgetExhausted

    def fill(self, lengths: int) -> None:
        """One best_fill over `lengths` distinct lengths."""
        self._add(FILL_CELLS + LENGTH_CELLS * lengths)

    def chunk(self, cells: int) -> None:
        """One chunk's update of `cells` table cells."""
        self._add(CHUNK_CELLS + cells)


def best_fill(lengths: np.ndarray, counts: np.ndarray, room: int, max_items: int, work: _Work,
              order: str = "long", most_items: bool = False) -> tuple[np.ndarray, int]:
    """The multiset of lengths (at most counts[i] of lengths[i], lengths descending) with the
    largest sum <= room and at most `max_items` items: (copies of each length, its sum).

    A 0/1 subset-sum over binary chunks; each sum remembers the first chunk that reached it,
    so the fill prefers the chunks met first (`order`: "long", longest lengths first, keeping
    the short ones as filler; "plenty", the lengths with the most items left first),
    and the chain back from the best sum uses each chunk once. Under a binding item cap the
    table has one row per item count, and the fill takes the fewest items that reach the best
    sum, or the most with `most_items`."""
    take = np.zeros(len(lengths), dtype=np.int64)
    work.fill(len(lengths))
    if room <= 0 or max_items <= 0 or not len(lengths):
        return take, 0
    fits = (lengths <= room) & (counts > 0)
    if not fits.any():
        return take, 0
    limits = np.where(fits, np.minimum(counts, np.minimum(room // np.maximum(lengths, 1), max_items)), 0)
    # When the longest items that fit, up to max_items of them, fit together, nothing beats them
    # (any max_items items sum to no more): the common case under a binding cap, found without a table.
    longest = np.minimum(limits, np.maximum(0, max_items - (np.cumsum(limits) - limits)))
    if int((longest * lengths).sum()) <= room:
        return longest, int((longest * lengths).sum())
    index, copies = _chunks(lengths, limits)
    if order == "plenty":
        rank = np.argsort(-counts[index], kind="stable")
        index, copies = index[rank], copies[rank]
    weights = lengths[index] * copies
    capped = max_items < room // int(lengths[fits].min())
    depth = max_items + 1 if capped else 1
    reach = np.zeros((depth, room + 1), dtype=bool)
    reach[0, 0] = True
    first = np.full((depth, room + 1), -1, dtype=np.int32)
    for c, (w, t) in enumerate(zip(weights.tolist(), copies.tolist())):
        if w > room or (capped and t > max_items):
            continue
        dt = t if capped else 0
        src = reach[:depth - dt, :room + 1 - w]
        work.chunk(src.size)
        new = src & ~reach[dt:, w:]
        hit_c, hit_s = np.nonzero(new)
        if len(hit_s):
            reach[hit_c + dt, hit_s + w] = True
            first[hit_c + dt, hit_s + w] = c
            if reach[:, room].any():
                break
    reached = reach.any(axis=0)
    best = int(np.flatnonzero(reached)[-1])
    levels = np.flatnonzero(reach[:, best])
    level = int(levels[-1] if most_items else levels[0])  # the fewest (or most) items that reach the best sum
    s = best
    while s:
        c = int(first[level, s])
        take[index[c]] += copies[c]
        s -= int(weights[c])
        if capped:
            level -= int(copies[c])
    return take, best


# The fills tried, in order, each a (chunk order, prefer more items at the best sum) pair; the
# plan is the one with the fewest rows, the first on a tie. "plenty": the most plentiful
# lengths fill first, so no length runs out early and the last rows still find fillers (1M
# EN-FR pairs at L 512: +1 row over the bound against +3 for longest-first); under a cap, the
# most items at the best sum, since the cap then makes items, not tokens, the scarce room.
# "long": the longest lengths first, the short ones kept as filler.
FILL_ORDERS = (("plenty", True), ("long", False))


def plan_exact_fill(histogram: Mapping[int, int], max_length: int, max_segments: int | None = None,
                    budget: int = DEFAULT_BUDGET_CELLS) -> PatternPlan:
    """Rows by exact fills (module docstring), the fewest of the FILL_ORDERS fills, which share
    one budget. Deterministic: the same histogram, max length, cap and budget give the same
    patterns. Raises BudgetExhausted when the first fill runs past `budget` cells; a later one
    that does is left out."""
    if any(not 0 < int(n) <= max_length for n, c in histogram.items() if c > 0):
        raise ValueError(f"item lengths must be within 1..{max_length}")
    work = _Work(budget)
    best: PatternPlan | None = None
    for order, most_items in FILL_ORDERS:
        try:
            plan = _fill(histogram, max_length, max_segments, work, order, most_items and max_segments is not None)
        except BudgetExhausted:
            if best is None:
                raise
            break
        if best is None or plan.num_rows < best.num_rows:
            best = plan
    return dataclasses.replace(best, work=work.spent)


def _fill(histogram: Mapping[int, int], max_length: int, max_segments: int | None, work: _Work, order: str,
          most_items: bool) -> PatternPlan:
    cap = min(max_segments or max_length, max_length)
    items = sorted(((int(n), int(c)) for n, c in histogram.items() if c > 0), reverse=True)
    lengths = np.array([n for n, _ in items], dtype=np.int64)
    counts = np.array([c for _, c in items], dtype=np.int64)
    patterns: list[Pattern] = []
    head = 0  # counts[:head] are spent
    while True:
        while head < len(counts) and counts[head] == 0:
            head += 1
        if head == len(counts):
            break
        counts[head] -= 1  # the row's longest item
        rest = slice(head, len(counts))
        take, _ = best_fill(lengths[rest], counts[rest], max_length - int(lengths[head]), cap - 1, work, order, most_items)
        counts[head] += 1
        take[0] += 1
        used = np.flatnonzero(take)
        repeats = int((counts[rest][used] // take[used]).min())
        counts[rest] -= take * repeats
        patterns.append(Pattern(tuple(lengths[rest][used].tolist()), tuple(take[used].tolist()), repeats))
    return PatternPlan(max_length, tuple(patterns), work.spent)
