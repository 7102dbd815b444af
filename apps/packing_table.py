"""The packing table that preflight and report share: its columns, one row from
packing stats (densities only from prepack.packing.stats), and its text rendering. Both
applications import this module; neither imports the other for it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prepack.packing.stats import BatchFigures, PackingStats, StepSemantics, lower_bounds_line

THROUGHPUT_MODEL = (
    "Fixed [B, L] batches: a step costs the same packed or unpacked. Rows fill ceil(rows / B) steps, the last "
    "padded with empty rows. step densities = tokens (or target tokens) / (steps * B * L). "
    "throughput_gain = packed_step_target_density / unpacked_step_target_density = unpacked_steps / packed_steps. "
    "Target tokens count as they land in a row: the loss mask minus each example's first token. "
    "B pk = round(B / ex/row) to the nearest whole row, at least 1: the packed batch size that sees about as many examples per step as unpacked batch size B; "
    "its steps per epoch: steps B pk = ceil(rows / B pk), against steps unp = ceil(examples / B)."
)

# preflight.csv columns, in order; report.py fills the same keys from manifests.
CSV_COLUMNS = (
    "dataset", "input", "format", "tokenizer", "chat_format", "overlong", "planner", "max_segments_per_row",
    "max_length", "batch_size", "records_read", "bad_records", "examples", "examples_kept", "examples_dropped",
    "dropped_too_long", "dropped_no_targets_after_truncation", "examples_truncated",
    "examples_split", "split_pieces", "dropped_no_targets_after_split",
    "examples_windowed", "window_pieces", "context_tokens_replayed", "dropped_window_context_too_long", "bfd_rows",
    "mean_tokens", "median_tokens", "p95_tokens", "max_tokens", "tokens", "target_tokens",
    "unpacked_rows", "packed_rows", "lower_bound_rows", "capped_lower_bound_rows", "row_reduction",
    "unpacked_density", "packed_density", "unpacked_target_density", "packed_target_density",
    "unpacked_steps", "packed_steps", "unpacked_step_density", "packed_step_density",
    "unpacked_step_target_density", "packed_step_target_density", "throughput_gain",
    "examples_per_row", "target_tokens_per_row", "packed_batch_size", "unpacked_steps_per_epoch", "packed_steps_per_epoch",
)


def result_row(meta: dict[str, Any], stats: PackingStats, batch_size: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One table row (CSV_COLUMNS) from packing stats; densities come only from prepack.packing.stats."""
    batch = BatchFigures(stats, batch_size)
    row: dict[str, Any] = dict.fromkeys(CSV_COLUMNS)
    row.update(meta)
    row.update(extra or {})
    row.update(
        max_length=stats.max_length,
        batch_size=batch_size,
        examples_kept=stats.examples,
        tokens=stats.tokens,
        target_tokens=stats.target_tokens,
        unpacked_rows=stats.examples,
        packed_rows=stats.rows,
        lower_bound_rows=stats.lower_bound_rows,
        # Under --max-segments-per-row K no plan beats ceil(examples / K) rows either (= lower_bound_rows without K).
        capped_lower_bound_rows=stats.capped_lower_bound_rows,
        row_reduction=stats.row_reduction,
        unpacked_density=stats.unpacked_density,
        packed_density=stats.packed_density,
        unpacked_target_density=stats.unpacked_target_density,
        packed_target_density=stats.target_density,
    )
    row.update({k: v for k, v in batch.as_dict().items() if k != "batch_size"})
    row.update({k: v for k, v in StepSemantics(stats, batch_size).as_dict().items() if k != "unpacked_batch_size"})
    return row


# (header, row key, kind) for stdout and report tables; kinds pick the cell format.
TABLE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("L", "max_length", "int"),
    ("B", "batch_size", "int"),
    ("kept", "examples_kept", "int"),
    ("dropped", "examples_dropped", "int"),
    ("mean", "mean_tokens", "float1"),
    ("median", "median_tokens", "float1"),
    ("p95", "p95_tokens", "float1"),
    ("dens unp", "unpacked_density", "pct"),
    ("dens pk", "packed_density", "pct"),
    ("tgt unp", "unpacked_target_density", "pct"),
    ("tgt pk", "packed_target_density", "pct"),
    ("rows unp", "unpacked_rows", "int"),
    ("rows pk", "packed_rows", "int"),
    ("bound", "capped_lower_bound_rows", "int"),  # with --max-segments-per-row, both bounds are on a line below
    ("row reduction", "row_reduction", "times"),
    ("steps unp", "unpacked_steps", "int"),
    ("steps pk", "packed_steps", "int"),
    ("gain", "throughput_gain", "times"),
    ("ex/row", "examples_per_row", "float1"),
    ("tgt/row", "target_tokens_per_row", "float1"),
    ("B pk", "packed_batch_size", "int"),
    ("steps B pk", "packed_steps_per_epoch", "int"),  # beside "steps unp", the same as unpacked_steps_per_epoch
)


# A max length that drops more than this share of a dataset's examples is flagged, in tables and plots.
DROP_FLAG_FRACTION = 0.05


def drops_too_many(dropped: int, total: int) -> bool:
    return bool(total) and dropped / total > DROP_FLAG_FRACTION


def bound_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Under --max-segments-per-row, each max length's two lower bounds, worded as `prepack pack` words them."""
    lines: list[str] = []
    for r in rows:
        stats = PackingStats(max_length=int(r["max_length"]), examples=int(r.get("examples_kept") or 0),
                             tokens=int(r.get("tokens") or 0), target_tokens=int(r.get("target_tokens") or 0),
                             rows=int(r.get("packed_rows") or 0), segment_cap=r.get("max_segments_per_row"))
        line = lower_bounds_line(stats)
        if line and line not in lines:  # one per max length, not per batch size
            lines.append(line)
    return lines


def drop_flags(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per max length of a dataset that drops more than DROP_FLAG_FRACTION of its examples."""
    lines, seen = [], set()
    for r in rows:
        dropped, kept = int(r.get("examples_dropped") or 0), int(r.get("examples_kept") or 0)
        if (r["max_length"], r["dataset"]) in seen or not drops_too_many(dropped, dropped + kept):
            continue
        seen.add((r["max_length"], r["dataset"]))
        lines.append(f"! L={r['max_length']} drops {dropped:,} of {dropped + kept:,} examples "
                     f"({dropped / (dropped + kept):.1%}, more than {DROP_FLAG_FRACTION:.0%}): "
                     f"a longer max length keeps them{_truncate_note(r.get('truncate_would_keep'))}")
    return lines


def _truncate_note(keeps: Any) -> str:
    """What --overlong truncate would keep of them, when the estimate worked it out (preflight does)."""
    if not isinstance(keeps, int):
        return ""
    if keeps == 0:
        return "; --overlong truncate would keep none (no target within the first L tokens)"
    return f"; --overlong truncate would keep {keeps:,} of them"


def format_cell(value: Any, kind: str) -> str:
    if value is None or value == "":
        return "-"
    if kind == "int":
        return f"{int(value):,}"
    if kind == "float1":
        return f"{float(value):.1f}"
    if kind == "pct":
        return f"{100 * float(value):.1f}%"
    if kind == "times":
        return f"{float(value):.2f}x"
    return str(value)


def dataset_heading(row: dict[str, Any]) -> str:
    parts = [f"{row['dataset']}:"]
    # A dataset named after its path (`--shards OUT`) would read "OUT: OUT".
    if row.get("input") and str(row["input"]).rstrip("/") != str(row["dataset"]):
        parts.append(str(row["input"]))
    details = [f"{k} {row[k]}" for k in ("format", "tokenizer", "chat_format", "overlong") if row.get(k)]
    if row.get("records_read") not in (None, ""):
        details.append(f"records {int(row['records_read']):,}, bad {int(row.get('bad_records') or 0):,}, examples {int(row.get('examples') or 0):,}")
    if details:
        parts.append(f"({'; '.join(details)})")
    return " ".join(parts)


def render_text_table(rows: Sequence[dict[str, Any]]) -> str:
    """Fixed-width table, one block per dataset."""
    out: list[str] = []
    for name, group in _by_dataset(rows).items():
        cells = [[format_cell(r.get(key), kind) for _, key, kind in TABLE_COLUMNS] for r in group]
        dropped_at = [key for _, key, _ in TABLE_COLUMNS].index("examples_dropped")
        for r, line in zip(group, cells):  # the flag sits on the dropped count, explained under the table
            kept, dropped = int(r.get("examples_kept") or 0), int(r.get("examples_dropped") or 0)
            if drops_too_many(dropped, kept + dropped):
                line[dropped_at] += " !"
        headers = [h for h, _, _ in TABLE_COLUMNS]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
        out.append(dataset_heading(group[0]))
        out.append("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        out.extend("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)
        out.extend(drop_flags(group))
        out.extend(bound_lines(group))
        out.append("")
    return "\n".join(out)


def _by_dataset(rows: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(str(row["dataset"]), []).append(row)
    return groups
