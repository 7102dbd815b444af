"""The density table `prepack pack` prints after a run, one line per max length."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prepack.packing.stats import REFERENCE_BATCH_SIZE, BatchFigures, PackingStats, StepSemantics, lower_bounds_line
from prepack.wording import counted, rate

# What every set reports: examples in and out, and the rows they fill.
_COUNT_COLUMNS = (
    ("L", "max_length"),
    ("read", "examples_read"),
    ("written", "examples_written"),
    ("dropped", "dropped"),
    ("truncated", "examples_truncated"),
    ("rows", "rows"),
)
COLUMNS = _COUNT_COLUMNS + (
    ("lower bound", "lower_bound_rows"),
    ("rows/bound", "rows_over_lower_bound"),
    ("packed dens.", "packed_density"),
    ("unpacked dens.", "unpacked_density"),
    ("target dens.", "target_density"),
    ("row reduction", "row_reduction"),
    ("ex/row", "examples_per_row"),
    ("tgt/row", "target_tokens_per_row"),
)
# `--no-pack` sets hold one example per row: rows equal examples, and the packed-only
# figures (lower bound, rows/bound, packed density, row reduction) say nothing about them.
UNPACKED_COLUMNS = _COUNT_COLUMNS + (
    ("density", "unpacked_density"),
    ("target dens.", "target_density"),
)


def _cell(key: str, value: Any) -> str:
    if key in ("packed_density", "unpacked_density", "target_density"):
        return f"{value:.1%}"
    if key in ("examples_per_row", "target_tokens_per_row"):
        return f"{value:,.1f}"
    if key in ("row_reduction",):
        return f"{value:.2f}x"
    if key == "rows_over_lower_bound":
        return f"{value:.4f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def density_table(stats_by_length: Mapping[int, Mapping[str, Any]], packed: bool = True,
                  segment_cap: int | None = None) -> str:
    """A plain-text table (packed: COLUMNS, else UNPACKED_COLUMNS); dropped examples are listed by reason under it.

    segment_cap: --max-segments-per-row. The lower bound and rows/bound are then the ones under
    the cap (prepack.packing.stats: capped_lower_bound_rows), and a line under the table gives
    both bounds, labelled: the manifest's stats.lower_bound_rows stays the tokens-only one."""
    columns = COLUMNS if packed else UNPACKED_COLUMNS
    rows, steps = [], {L: step_semantics(L, stats) for L, stats in stats_by_length.items()}
    bounds = {L: _figures(L, stats, segment_cap) for L, stats in stats_by_length.items()}
    for L, stats in sorted(stats_by_length.items()):
        values = dict(stats, max_length=L, dropped=sum(stats["examples_dropped"].values()), **steps[L].as_dict())
        if segment_cap:
            values.update(lower_bound_rows=bounds[L].capped_lower_bound_rows,
                          rows_over_lower_bound=bounds[L].rows_over_capped_lower_bound)
        rows.append([_cell(key, values[key]) for _, key in columns])
    headers = [h for h, _ in columns]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    for L, stats in sorted(stats_by_length.items()):
        if stats["examples_dropped"]:
            reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(stats["examples_dropped"].items()))
            lines.append(f"L{L} dropped: {reasons}")
        if stats.get("examples_split"):  # --overlong split: how many were cut, into how many pieces
            lines.append(f"L{L} split: {stats['examples_split']:,} examples longer than {L:,} tokens into "
                         f"{stats.get('split_pieces', 0):,} pieces (--overlong split)")
        if stats.get("examples_windowed"):  # --overlong window: the same, and the context the pieces replay
            lines.append(f"L{L} window: {stats['examples_windowed']:,} examples longer than {L:,} tokens into "
                         f"{stats.get('window_pieces', 0):,} pieces, {stats.get('context_tokens_replayed', 0):,} prompt "
                         "tokens replayed as context (--overlong window)")
    if packed and segment_cap:
        lines += [lower_bounds_line(b) or "" for _, b in sorted(bounds.items())]
    if packed:
        lines += steps_lines(steps)
    first = next(iter(stats_by_length.values()), None)
    if first is not None and first.get("records_filtered"):
        filtered = ", ".join(f"{k} {v:,}" for k, v in first["records_filtered"].items())
        lines.append(f"records filtered by the template (not examples): {filtered}")
    return "\n".join(lines)


def _figures(max_length: int, stats: Mapping[str, Any], segment_cap: int | None = None) -> PackingStats:
    """This length's packing figures (prepack.packing.stats) from the manifest's stats."""
    return PackingStats(max_length=max_length, examples=stats["examples_written"], tokens=stats.get("tokens", 0),
                        target_tokens=stats.get("target_tokens", 0), rows=stats["rows"], segment_cap=segment_cap)


def run_line(examples: int, seconds: float) -> str:
    """The last line of `prepack pack`: the examples read, the time, the rate."""
    return f"{counted(examples, 'example')} in {seconds:,.1f} s ({rate(examples, seconds, 'examples')})"


def steps_lines(steps: Mapping[int, StepSemantics]) -> list[str]:
    """Steps per epoch at one batch size B, stated as an assumption (pack does not choose B: `prepack
    train --batch-size` does), packed against unpacked: fewer, by the row reduction. Then, per length,
    the packed batch size that sees as many examples per step as B unpacked rows, unrounded (a
    rounded one, 1 row for 1.47, read as if packing cost more steps)."""
    if not steps:
        return []
    batch = next(iter(steps.values())).unpacked_batch_size
    lines = [f"steps per epoch at batch size B = {batch} rows per step (an example: B is `prepack train --batch-size`; "
             "each step costs the same packed or not):"]
    for L, s in sorted(steps.items()):
        at_b = BatchFigures(s.stats, batch)
        exact = batch / s.examples_per_row if s.examples_per_row else float(batch)
        lines.append(f"  L{L}: {at_b.unpacked_steps:,} unpacked, {at_b.packed_steps:,} packed ({s.stats.row_reduction:,.2f}x "
                     f"fewer rows); as many examples per step as {batch} unpacked rows: {batch} / {s.examples_per_row:,.2f} "
                     f"examples per row = {exact:,.2f} packed rows")
    return lines


def step_semantics(max_length: int, stats: Mapping[str, Any]) -> StepSemantics:
    """What a step means at this length (prepack.packing.stats), from the manifest's stats."""
    return StepSemantics(_figures(max_length, stats), REFERENCE_BATCH_SIZE)
