"""Step semantics for users moving an unpacked recipe to packed rows: one function
(prepack.packing.stats.StepSemantics), shown by the pack summary and by preflight."""

from __future__ import annotations

import pytest

from apps.packing_table import render_text_table, result_row
from pipelines.launch.report import density_table
from prepack.packing.stats import REFERENCE_BATCH_SIZE, PackingStats, StepSemantics

# 326 examples in 157 rows: 2.08 examples per row.
STATS = PackingStats(max_length=128, examples=326, tokens=18_904, target_tokens=10_855, rows=157)


def test_figures():
    s = StepSemantics(STATS, 16)
    assert s.examples_per_row == pytest.approx(326 / 157)
    assert s.target_tokens_per_row == pytest.approx(10_855 / 157)
    assert s.packed_batch_size == 8  # 16 / 2.08 = 7.7: 8 rows hold about 16.6 examples
    assert (s.unpacked_steps_per_epoch, s.packed_steps_per_epoch) == (21, 20)  # ceil(326 / 16), ceil(157 / 8)


def test_packed_batch_size_rounds_half_up_and_is_at_least_one():
    assert StepSemantics(PackingStats(128, examples=4, tokens=8, target_tokens=4, rows=1), 2).packed_batch_size == 1  # 0.5
    assert StepSemantics(PackingStats(128, examples=4, tokens=8, target_tokens=4, rows=3), 2).packed_batch_size == 2  # 1.5
    assert StepSemantics(PackingStats(128, examples=100, tokens=8, target_tokens=4, rows=1), 4).packed_batch_size == 1
    unpacked = StepSemantics(PackingStats(128, examples=10, tokens=80, target_tokens=40, rows=10), 4)
    assert (unpacked.packed_batch_size, unpacked.unpacked_steps_per_epoch, unpacked.packed_steps_per_epoch) == (4, 3, 3)
    with pytest.raises(ValueError, match="batch_size must be positive"):
        StepSemantics(STATS, 0)


def test_pack_summary_shows_them():
    stats = {"examples_read": 400, "examples_written": 326, "examples_dropped": {"too_long": 74}, "examples_truncated": 0,
             "tokens": 18_904, "target_tokens": 10_855, "rows": 157, "lower_bound_rows": 148, "rows_over_lower_bound": 1.06,
             "packed_density": 0.941, "unpacked_density": 0.453, "target_density": 0.54, "row_reduction": 326 / 157}
    header, _, values, *rest = density_table({128: stats}).splitlines()
    assert header.split()[-2:] == ["ex/row", "tgt/row"] and values.split()[-2:] == ["2.1", "69.1"]
    assert rest[-2:] == [
        f"steps per epoch at batch size B = {REFERENCE_BATCH_SIZE} rows per step (an example: B is `prepack train "
        "--batch-size`; each step costs the same packed or not):",
        "  L128: 21 unpacked, 10 packed (2.08x fewer rows); as many examples per step as 16 unpacked rows: 16 / 2.08 "
        "examples per row = 7.71 packed rows"]
    # Rows of 40 examples: packed, the same B takes fewer steps, never more (a packed batch size of 16 / 40
    # rounded up to 1 row made it 10 packed steps against 25, under a table of 40x fewer rows).
    few = dict(stats, examples_written=400, examples_read=474, rows=10)
    assert density_table({128: few}).splitlines()[-1] == (
        "  L128: 25 unpacked, 1 packed (40.00x fewer rows); as many examples per step as 16 unpacked rows: 16 / 40.00 "
        "examples per row = 0.40 packed rows")


def test_preflight_table_shows_them():
    row = result_row({"dataset": "d"}, STATS, 16)
    assert {k: row[k] for k in ("packed_batch_size", "unpacked_steps_per_epoch", "packed_steps_per_epoch")} == {
        "packed_batch_size": 8, "unpacked_steps_per_epoch": 21, "packed_steps_per_epoch": 20}
    assert row["unpacked_steps"] == row["unpacked_steps_per_epoch"]
    lines = render_text_table([row]).splitlines()
    assert lines[1].split()[-7:] == ["ex/row", "tgt/row", "B", "pk", "steps", "B", "pk"]
    assert lines[2].split()[-4:] == ["2.1", "69.1", "8", "20"]
