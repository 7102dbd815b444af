"""The density table's lower bound under --max-segments-per-row K: max(ceil(tokens / L), ceil(examples / K))."""

from __future__ import annotations

import re

from apps import cli
from pipelines.launch.report import density_table
from prepack.packing.stats import PackingStats


def test_the_cap_raises_the_bound_only_where_it_binds():
    # 10 examples of 8 tokens at L 64: tokens alone allow 2 rows; at most 3 a row needs 4.
    figures = PackingStats(max_length=64, examples=10, tokens=80, target_tokens=40, rows=4, segment_cap=3)
    assert (figures.lower_bound_rows, figures.capped_lower_bound_rows) == (2, 4)
    assert figures.rows_over_capped_lower_bound == 1.0
    assert PackingStats(max_length=64, examples=10, tokens=80, target_tokens=40, rows=4, segment_cap=8).capped_lower_bound_rows == 2
    assert PackingStats(max_length=64, examples=10, tokens=80, target_tokens=40, rows=4).capped_lower_bound_rows == 2


def test_density_table_labels_both_bounds():
    stats = {"examples_read": 10, "examples_written": 10, "examples_dropped": {}, "examples_truncated": 0,
             "rows": 4, "tokens": 80, "target_tokens": 40, "lower_bound_rows": 2, "rows_over_lower_bound": 2.0,
             "packed_density": 0.3, "unpacked_density": 0.1, "target_density": 0.2, "row_reduction": 2.5}
    header, _, values, *rest = density_table({64: stats}, segment_cap=3).splitlines()
    cells = dict(zip(re.split(r"\s{2,}", header.strip()), values.split()))
    assert (cells["lower bound"], cells["rows/bound"]) == ("4", "1.0000")
    assert ("L64 lower bound: 4 rows at most 3 examples a row (--max-segments-per-row 3), 2 from tokens alone "
            "(the manifest's stats.lower_bound_rows)") in rest
    uncapped = density_table({64: stats}).splitlines()
    assert dict(zip(re.split(r"\s{2,}", uncapped[0].strip()), uncapped[2].split()))["rows/bound"] == "2.0000"
    assert not any("lower bound:" in line for line in uncapped)


def test_the_sample_under_a_binding_cap_is_near_its_bound(tmp_path, capsys):
    # L1024, at most 4 a row: tokens alone give 36 rows, the cap 99; the plan's 99 rows read 2.75 before.
    assert cli.main(["pack", "--sample", "--max-length", "1024", "--max-segments-per-row", "4",
                     "--output", str(tmp_path / "out"), "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("L ") and "rows/bound" in line)
    cells = dict(zip(re.split(r"\s{2,}", lines[at].strip()), lines[at + 2].split()))
    assert float(cells["rows/bound"]) <= 1.05
    assert any(line.startswith("L1024 lower bound: ") and "(--max-segments-per-row 4)" in line for line in lines)


def test_preflight_gives_the_bounds_pack_gives_under_a_cap(tmp_path, capsys):
    # One implementation (PackingStats.capped_lower_bound_rows, lower_bounds_line) behind both commands:
    # preflight's forecast of a capped run states the bounds the run's density table states.
    import json

    from apps import preflight
    from pipelines.options import sample_path

    cap = ["--max-length", "512", "1024", "--max-segments-per-row", "4"]
    assert cli.main(["pack", "--sample", *cap, "--output", str(tmp_path / "out"), "--no-progress"]) == 0
    packed = capsys.readouterr().out.splitlines()
    assert preflight.main(["--input", sample_path(), "--format", "alpaca", *cap, "--batch-size", "8", "--no-plots",
                           "--output", str(tmp_path / "pre")]) == 0
    forecast = capsys.readouterr().out.splitlines()
    pack_lines = [line for line in packed if " lower bound: " in line]
    assert len(pack_lines) == 2 and pack_lines == [line for line in forecast if " lower bound: " in line]
    at = next(i for i, line in enumerate(packed) if line.lstrip().startswith("L ") and "rows/bound" in line)
    pack_bound = {int(cells["L"].replace(",", "")): int(cells["lower bound"].replace(",", "")) for cells in
                  (dict(zip(re.split(r"\s{2,}", packed[at].strip()), line.split())) for line in packed[at + 2:at + 4])}
    rows = json.loads((tmp_path / "pre" / "preflight.json").read_text())["rows"]
    assert {r["max_length"]: r["capped_lower_bound_rows"] for r in rows} == pack_bound
    for r in rows:
        manifest = json.loads((tmp_path / "out" / f"L{r['max_length']}" / "manifest.json").read_text())
        assert r["lower_bound_rows"] == manifest["stats"]["lower_bound_rows"] < r["capped_lower_bound_rows"]
