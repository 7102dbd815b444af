"""Density and row-count figures, computed in one place for the job, preflight and reports.

Definitions (docs/row_format.md):
- packed_density = tokens / (rows * L): the share of row slots holding real tokens.
- unpacked_density = tokens / (examples * L): the same with one example per row.
- target_density = target_tokens / (rows * L): the share of slots that train something.
- lower_bound_rows = ceil(tokens / L): no packing can use fewer rows.
- row_reduction = examples / rows: how many times fewer rows than unpacked.
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
    max_segments_per_row: int = 0

    @property
    def lower_bound_rows(self) -> int:
        return math.ceil(self.tokens / self.max_length)

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


def stats_from_rows(rows: Sequence[Sequence[int]], max_length: int, target_tokens: int) -> PackingStats:
    """Stats for a plan given as rows of lengths."""
    counts = [len(r) for r in rows]
    return PackingStats(
        max_length=max_length,
        examples=sum(counts),
        tokens=sum(sum(r) for r in rows),
        target_tokens=target_tokens,
        rows=len(rows),
        min_segments_per_row=min(counts, default=0),
        max_segments_per_row=max(counts, default=0),
    )


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0
