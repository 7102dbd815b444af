"""Best-fit-decreasing packing of sequence lengths into rows of a fixed length.

Global BFD over a whole dataset lands within a fraction of a percent of the
lower bound ceil(tokens / L) on SFT length distributions; what loses density
in online packers is the small window, not the heuristic
(docs/benchmarks.md, ../shared/research/packing_anchors.md).

Open rows live in capacity buckets: `rows_by_free[c]` holds the rows with
exactly c free slots, and bit c of an integer bitset says that bucket is
non-empty. The best fit for an item of length n is the lowest set bit at or
above n, one shift and one lowest-bit extraction on an L-bit integer, so the
work per item does not grow with the number of open rows.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence

import numpy as np


class OverlongPolicy(str, enum.Enum):
    DROP = "drop"
    TRUNCATE = "truncate"


class DropReason(str, enum.Enum):
    """Why an example that was read did not reach a row. Values are manifest keys."""

    TOO_LONG = "too_long"
    NO_TARGETS_AFTER_TRUNCATION = "no_targets_after_truncation"


class _BestFit:
    """Incremental best-fit state: place items one at a time."""

    def __init__(self, max_length: int):
        if max_length <= 0:
            raise ValueError(f"max_length must be positive, got {max_length}")
        self.max_length = max_length
        self.rows: list[list[int]] = []
        self._rows_by_free: list[list[int]] = [[] for _ in range(max_length + 1)]
        self._nonempty = 0

    def place(self, length: int) -> int:
        """Puts an item of `length` into the fullest row it fits; returns the row index."""
        if not 0 < length <= self.max_length:
            raise ValueError(f"item length {length} is outside 1..{self.max_length}")
        fits = self._nonempty >> length
        if fits:
            free = length + (fits & -fits).bit_length() - 1
            bucket = self._rows_by_free[free]
            row = bucket.pop()
            if not bucket:
                self._nonempty &= ~(1 << free)
        else:
            free = self.max_length
            row = len(self.rows)
            self.rows.append([])
        left = free - length
        if left:
            self._rows_by_free[left].append(row)
            self._nonempty |= 1 << left
        return row


def _decreasing_order(lengths: Sequence[int]) -> np.ndarray:
    # Stable on ties, so equal inputs always give equal plans.
    return np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")


def pack_best_fit_decreasing(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Packs items (by index into `lengths`) into rows; each row lists item indices in placement order."""
    packer = _BestFit(max_length)
    rows: list[list[int]] = packer.rows
    for index in _decreasing_order(lengths).tolist():
        rows[packer.place(int(lengths[index]))].append(index)
    return rows


def plan_from_histogram(histogram: dict[int, int], max_length: int) -> list[list[int]]:
    """BFD over a length histogram: rows as lists of lengths.

    This is what lets a distributed job plan globally from lengths alone and
    then route each example to its row by (length, rank within that length).
    """
    packer = _BestFit(max_length)
    rows: list[list[int]] = packer.rows
    for length in sorted(histogram, reverse=True):
        for _ in range(histogram[length]):
            rows[packer.place(length)].append(length)
    return rows


@dataclasses.dataclass(frozen=True)
class Slot:
    row: int
    position: int  # the segment's index within the row


def slots_by_length(plan: Sequence[Sequence[int]]) -> dict[int, list[Slot]]:
    """For each length, its slots in row order: the k-th example of that length goes to the k-th slot."""
    out: dict[int, list[Slot]] = {}
    for row_index, row in enumerate(plan):
        for position, length in enumerate(row):
            out.setdefault(length, []).append(Slot(row_index, position))
    return out


def pack_unpacked(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """One item per row, in input order: the baseline every packed run is compared to."""
    for i, n in enumerate(lengths):
        if not 0 < n <= max_length:
            raise ValueError(f"item {i} has length {n}, outside 1..{max_length}")
    return [[i] for i in range(len(lengths))]


def first_fit_in_pools(lengths: Iterable[int], max_length: int, pool_rows: int) -> int:
    """Rows used by an online first-fit packer that keeps `pool_rows` open rows
    and emits the fullest when full (how Grain's FirstFitPackIterDataset and
    MaxText pack). Only for comparison in benchmarks."""
    pool: list[int] = []
    emitted = 0
    for n in lengths:
        for i, used in enumerate(pool):
            if used + n <= max_length:
                pool[i] = used + n
                break
        else:
            if len(pool) == pool_rows:
                pool.pop(max(range(len(pool)), key=pool.__getitem__))
                emitted += 1
            pool.append(n)
    return emitted + len(pool)


def fit_to_length(
    input_ids: np.ndarray, loss_mask: np.ndarray, max_length: int, policy: OverlongPolicy
) -> tuple[np.ndarray, np.ndarray] | DropReason:
    """Applies the overlong policy to one example; returns the tokens to pack or why it is dropped."""
    if len(input_ids) <= max_length:
        return input_ids, loss_mask
    if policy is OverlongPolicy.DROP:
        return DropReason.TOO_LONG
    ids, mask = input_ids[:max_length], loss_mask[:max_length]
    # The row builder zeroes the first token's loss, so a target must survive past it.
    if not np.asarray(mask[1:]).any():
        return DropReason.NO_TARGETS_AFTER_TRUNCATION
    return ids, mask

