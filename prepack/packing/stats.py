"""Density and row-count figures, computed in one place for the job, preflight and reports.

Definitions (docs/row_format.md):
- packed_density = tokens / (rows * L): the share of row slots holding real tokens.
- unpacked_density = tokens / (examples * L): the same with one example per row.
- target_density = target_tokens / (rows * L): the share of slots that train something.
- lower_bound_rows = ceil(tokens / L): no packing can use fewer rows (the manifest's stats key).
- capped_lower_bound_rows = max(ceil(tokens / L), ceil(examples / K)) under a cap of K segments
  a row (--max-segments-per-row K): no packing under that cap can use fewer rows.
- row_reduction = examples / rows: how many times fewer rows than unpacked.
- per-step figures over fixed [B, L] batches: see BatchFigures.
- what a step means packed, for a recipe written for unpacked rows: see StepSemantics.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class PackingStats:
    max_length: int
    examples: int
    tokens: int
    target_tokens: int
    rows: int
    min_segments_per_row: int = 0
    max_segments_per_row: int = 0  # the most segments a row of the plan holds (not the cap)
    segment_cap: int | None = None  # --max-segments-per-row; None without a cap

    @property
    def lower_bound_rows(self) -> int:
        return math.ceil(self.tokens / self.max_length)

    @property
    def capped_lower_bound_rows(self) -> int:
        """The bound on rows under the segment cap: rows hold at most segment_cap examples each."""
        if not self.segment_cap:
            return self.lower_bound_rows
        return max(self.lower_bound_rows, math.ceil(self.examples / self.segment_cap))

    @property
    def packed_density(self) -> float:
        return _ratio(self.tokens, self.rows * self.max_length)

    @property
    def unpacked_density(self) -> float:
        return _ratio(self.tokens, self.examples * self.max_length)

    @property
    def target_density(self) -> float:
        return _ratio(self.target_tokens, self.rows * self.max_length)

    @property
    def unpacked_target_density(self) -> float:
        return _ratio(self.target_tokens, self.examples * self.max_length)

    @property
    def row_reduction(self) -> float:
        return _ratio(self.examples, self.rows)

    @property
    def rows_over_lower_bound(self) -> float:
        return _ratio(self.rows, self.lower_bound_rows)

    @property
    def rows_over_capped_lower_bound(self) -> float:
        return _ratio(self.rows, self.capped_lower_bound_rows)

    @property
    def mean_segments_per_row(self) -> float:
        return _ratio(self.examples, self.rows)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "max_length": self.max_length,
            "examples": self.examples,
            "tokens": self.tokens,
            "target_tokens": self.target_tokens,
            "rows": self.rows,
            "lower_bound_rows": self.lower_bound_rows,
            "packed_density": self.packed_density,
            "unpacked_density": self.unpacked_density,
            "target_density": self.target_density,
            "unpacked_target_density": self.unpacked_target_density,
            "row_reduction": self.row_reduction,
            "rows_over_lower_bound": self.rows_over_lower_bound,
            "segments_per_row": {
                "min": self.min_segments_per_row,
                "mean": self.mean_segments_per_row,
                "max": self.max_segments_per_row,
            },
        }


@dataclasses.dataclass(frozen=True)
class BatchFigures:
    """Per-step figures when rows are fed as fixed [batch_size, L] batches.

    Model (stated, because the gain depends on it): every step has the same
    shape, so the same cost, whether its rows are packed or not; rows are
    grouped into ceil(rows / B) steps, the last one padded with empty rows so
    no example is lost. A per-step density counts real tokens over all
    B * L slots of all steps, empty padding rows included. The throughput gain
    is then the ratio of target tokens per step, packed over unpacked, which
    comes down to unpacked_steps / packed_steps.
    """

    stats: PackingStats
    batch_size: int

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")

    @property
    def packed_steps(self) -> int:
        return math.ceil(self.stats.rows / self.batch_size)

    @property
    def unpacked_steps(self) -> int:
        return math.ceil(self.stats.examples / self.batch_size)

    def _slots(self, steps: int) -> int:
        return steps * self.batch_size * self.stats.max_length

    @property
    def packed_step_density(self) -> float:
        return _ratio(self.stats.tokens, self._slots(self.packed_steps))

    @property
    def unpacked_step_density(self) -> float:
        return _ratio(self.stats.tokens, self._slots(self.unpacked_steps))

    @property
    def packed_step_target_density(self) -> float:
        return _ratio(self.stats.target_tokens, self._slots(self.packed_steps))

    @property
    def unpacked_step_target_density(self) -> float:
        return _ratio(self.stats.target_tokens, self._slots(self.unpacked_steps))

    @property
    def throughput_gain(self) -> float:
        """Expected gain in target tokens per second at equal step time."""
        return _ratio(self.packed_step_target_density, self.unpacked_step_target_density)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "batch_size": self.batch_size,
            "packed_steps": self.packed_steps,
            "unpacked_steps": self.unpacked_steps,
            "packed_step_density": self.packed_step_density,
            "unpacked_step_density": self.unpacked_step_density,
            "packed_step_target_density": self.packed_step_target_density,
            "unpacked_step_target_density": self.unpacked_step_target_density,
            "throughput_gain": self.throughput_gain,
        }


# The unpacked batch size `prepack pack`'s summary plans for (preflight takes --batch-size).
REFERENCE_BATCH_SIZE = 16


@dataclasses.dataclass(frozen=True)
class StepSemantics:
    """A step packed against a step of an unpacked recipe of batch size B (one example per row).

    A packed row holds examples_per_row examples on average, so B packed rows see that many
    times more examples per step than B unpacked rows. The packed batch size that sees the same
    examples per step is round(B / examples_per_row), at least 1; steps per epoch are
    ceil(examples / B) unpacked and ceil(rows / that batch size) packed.
    """

    stats: PackingStats
    unpacked_batch_size: int

    def __post_init__(self) -> None:
        if self.unpacked_batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.unpacked_batch_size}")

    @property
    def examples_per_row(self) -> float:
        return _ratio(self.stats.examples, self.stats.rows)

    @property
    def target_tokens_per_row(self) -> float:
        return _ratio(self.stats.target_tokens, self.stats.rows)

    @property
    def packed_batch_size(self) -> int:
        """The packed rows per step that hold about unpacked_batch_size examples."""
        if not self.stats.rows:
            return self.unpacked_batch_size
        # Rounded half up in integers: the same answer on every platform.
        return max(1, (2 * self.unpacked_batch_size * self.stats.rows + self.stats.examples) // (2 * self.stats.examples))

    @property
    def unpacked_steps_per_epoch(self) -> int:
        return math.ceil(self.stats.examples / self.unpacked_batch_size)

    @property
    def packed_steps_per_epoch(self) -> int:
        return math.ceil(self.stats.rows / self.packed_batch_size)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "examples_per_row": self.examples_per_row,
            "target_tokens_per_row": self.target_tokens_per_row,
            "unpacked_batch_size": self.unpacked_batch_size,
            "packed_batch_size": self.packed_batch_size,
            "unpacked_steps_per_epoch": self.unpacked_steps_per_epoch,
            "packed_steps_per_epoch": self.packed_steps_per_epoch,
        }


def lower_bounds_line(stats: PackingStats) -> str | None:
    """Both lower bounds under --max-segments-per-row, labelled, in the one wording `prepack pack`'s
    density table and preflight's table print; None without a cap (then there is one bound)."""
    if not stats.segment_cap:
        return None
    return (f"L{stats.max_length} lower bound: {stats.capped_lower_bound_rows:,} rows at most {stats.segment_cap} "
            f"examples a row (--max-segments-per-row {stats.segment_cap}), {stats.lower_bound_rows:,} from tokens alone "
            "(the manifest's stats.lower_bound_rows)")


def stats_from_rows(rows: Sequence[Sequence[int]], max_length: int, target_tokens: int,
                    segment_cap: int | None = None) -> PackingStats:
    """Stats for a plan given as rows of lengths (segment_cap: the --max-segments-per-row it was planned under)."""
    counts = [len(r) for r in rows]
    return PackingStats(
        max_length=max_length,
        examples=sum(counts),
        tokens=sum(sum(r) for r in rows),
        target_tokens=target_tokens,
        rows=len(rows),
        min_segments_per_row=min(counts, default=0),
        max_segments_per_row=max(counts, default=0),
        segment_cap=segment_cap,
    )


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0
