"""benchmarks/bench_cache_load.py: each case cold in one process, then a true cache hit in another."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_cache_load as bench


def test_each_case_compiles_cold_then_loads_from_the_cache(tmp_path, capsys):
    assert bench.main(["--out", str(tmp_path), "--cases", "flash:1,dense:2,args:3", "--length", "128"]) == 0
    results = json.loads((tmp_path / bench.RESULTS_NAME).read_text())
    assert [r["case"] for r in results["runs"]] == ["flash:1", "dense:2", "args:3"]
    for run in results["runs"]:
        assert "error" not in run, run
        assert run["cold"]["cache_hit"] is False and run["hit"]["cache_hit"] is True
        assert run["largest_entry_bytes"] > 0 and run["hit"]["compile_or_load_s"] >= 0
    assert results["machine"]["backend"] == "cpu" and "jax" in results["machine"]
    assert "--cases flash:1,dense:2,args:3" in results["command"]
    assert "flash:1: cold" in capsys.readouterr().out


def test_a_second_process_that_misses_the_cache_reports_no_load_time(tmp_path, monkeypatch):
    # the hit's process given a fresh folder of its own: its "load" would be a compile
    calls = iter([str(tmp_path / "a"), str(tmp_path / "b")])
    real = bench._run_child
    monkeypatch.setattr(bench, "_run_child", lambda kind, n, length, cache_dir: real(kind, n, length, next(calls)))
    run = bench.measure("args", 2, 128)
    assert run["error"] == "the second process missed the cache: no load time to report"


def test_a_hit_is_the_measured_program_s_own_not_its_eager_set_up_s(tmp_path):
    # args:4 after args:3 in one folder: their eager set-up ops hit the cache, the program misses
    folder = str(tmp_path)
    assert bench._run_child("args", 3, 128, folder)["cache_hit"] is False
    assert bench._run_child("args", 4, 128, folder)["cache_hit"] is False
    assert bench._run_child("args", 4, 128, folder)["cache_hit"] is True


@pytest.mark.parametrize("case", ["flash", "flash:0", "mosaic:3", "args:x"])
def test_a_bad_case_is_one_line_naming_it(case, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--out", str(tmp_path), "--cases", case])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"case {case!r}: write KIND:N, KIND one of flash, dense, args, N >= 1" in err
