"""Whole plans in memory, for tests and benchmarks; not shipped: item-by-item best-fit-decreasing,
a histogram's BFD plan as rows (and in run-length form), the job's plan of every max length at
once, and the online first-fit baseline the benchmarks compare packing against. The job itself
streams its plans (prepack.packing.packer.HistogramPlan, pipelines.planning.LengthPlanner)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from pipelines.planning import Histogram, LengthPlan, LengthPlanner
# The packer's own state, placed item by item: the reference the histogram's runs must equal.
from prepack.packing.packer import Planner, _BestFit


def _decreasing_order(lengths: Sequence[int]) -> np.ndarray:
    # Stable on ties, so equal inputs always give equal plans.
    return np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")


def pack_best_fit_decreasing(lengths: Sequence[int], max_length: int,
                             max_segments: int | None = None) -> list[list[int]]:
    """Packs items (by index into `lengths`) into rows, at most `max_segments` per row when
    given; each row lists item indices in placement order."""
    packer = _BestFit(max_length, max_segments)
    rows: list[list[int]] = []
    for index in _decreasing_order(lengths).tolist():
        row = packer.place(int(lengths[index]))
        if row == len(rows):
            rows.append([])
        rows[row].append(index)
    return rows


@dataclasses.dataclass(frozen=True, eq=False)  # numpy fields: compare the arrays, not the plans
class RunPlan:
    """A histogram BFD plan in run-length form: placement i puts `count[i]` items of
    `length[i]` at positions start[i], start[i] + 1, ... of row `row[i]` (int64 arrays,
    in placement order). A row holds at most one placement per length."""

    num_rows: int
    segments: np.ndarray  # items per row
    row: np.ndarray
    length: np.ndarray
    count: np.ndarray
    start: np.ndarray

    def rows(self) -> list[list[int]]:
        """Rows as lists of lengths, as plan_from_histogram returns them."""
        order = np.lexsort((self.start, self.row))
        flat = np.repeat(self.length[order], self.count[order]).tolist()
        ends = np.cumsum(self.segments).tolist()
        return [flat[a:b] for a, b in zip([0, *ends], ends)]


def plan_runs_from_histogram(histogram: Mapping[int, int], max_length: int,
                             max_segments: int | None = None) -> RunPlan:
    """BFD over a length histogram, one place_run per length: the plan_from_histogram plan,
    computed in time that grows with rows and distinct lengths rather than items."""
    packer = _BestFit(max_length, max_segments)
    runs = [np.zeros((0, 3), dtype=np.intc)]
    lengths = [np.zeros(0, dtype=np.int64)]
    for length in sorted(histogram, reverse=True):
        runs.append(packer.place_run(length, histogram[length]))
        lengths.append(np.full(len(runs[-1]), length, dtype=np.int64))
    row, start, count = np.concatenate(runs).astype(np.int64).T
    return RunPlan(len(packer.segments), np.asarray(packer.segments, dtype=np.int64), row,
                   np.concatenate(lengths), count, start)


def plan_from_histogram(histogram: dict[int, int], max_length: int, max_segments: int | None = None) -> list[list[int]]:
    """BFD over a length histogram: rows as lists of lengths."""
    return plan_runs_from_histogram(histogram, max_length, max_segments).rows()


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


def build_plan(
    histogram: Histogram, max_length: int, pack: bool, num_shards: int | None = None, target_shard_mb: float = 256.0,
    planner: Planner = Planner.BEST, max_segments: int | None = None,
) -> LengthPlan:
    """The whole plan for one L in memory, slots of every class included (8 bytes per example).
    The job streams it instead (LengthPlanner)."""
    planner = LengthPlanner(histogram, max_length, pack, num_shards, target_shard_mb, planner, max_segments)
    by_class = {runs.length: runs.slots(0, runs.num_slots) for runs in planner.classes()}
    # Insertion order as a row-by-row scan of the plan meets the classes.
    slots = dict(sorted(by_class.items(), key=lambda item: (int(item[1][0][0]), int(item[1][1][0]))))
    return planner.plan(slots)


def build_plans(
    histogram: Histogram, max_lengths: tuple[int, ...], pack: bool, num_shards: int | None, target_shard_mb: float,
    planner: Planner = Planner.BEST, max_segments: int | None = None,
) -> dict[int, LengthPlan]:
    return {L: build_plan(histogram, L, pack, num_shards, target_shard_mb, planner, max_segments) for L in max_lengths}
