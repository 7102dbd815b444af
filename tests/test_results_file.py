"""benchmarks/results_file.py and the device benchmarks' one-line refusals of a results file that is not theirs."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_attention, bench_cookbook_device, bench_train_device, results_file

EMPTY = {"runs": {}, "commands": []}


def holds_runs(data: dict) -> bool:
    return isinstance(data.get("runs"), dict)


def test_no_file_is_a_fresh_copy_of_the_empty_results(tmp_path) -> None:
    data = results_file.load(str(tmp_path / "r.json"), EMPTY, holds_runs)
    data["runs"]["x"] = 1
    assert EMPTY == {"runs": {}, "commands": []}  # the caller's empty results are not shared


def test_a_file_gets_the_missing_keys_and_keeps_its_own(tmp_path) -> None:
    path = tmp_path / "r.json"
    results_file.save(str(path), {"runs": {"a": {"step": 1}}})
    assert results_file.load(str(path), EMPTY, holds_runs) == {"runs": {"a": {"step": 1}}, "commands": []}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left


@pytest.mark.parametrize("text,why", [("{not json", "Expecting property name"), ('{"runs": []}', "not this benchmark's results"),
                                      ("[1]", "not this benchmark's results")])
def test_a_file_that_is_not_the_results_is_refused(tmp_path, text, why) -> None:
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(results_file.UnreadableResults, match=why):
        results_file.load(str(path), EMPTY, holds_runs)


def test_each_benchmark_refuses_a_foreign_results_file_in_one_line(tmp_path) -> None:
    path = tmp_path / "r.json"
    path.write_text('{"runs": []}')
    with pytest.raises(SystemExit) as e:
        bench_train_device.load_results(str(path))
    assert str(e.value) == (f"bench_train_device: {path}: unreadable (not this benchmark's results); "
                            "move it away or give another --out")
    with pytest.raises(bench_cookbook_device.CookbookError) as c:
        bench_cookbook_device.load_results(str(path))
    assert str(c.value) == f"{path}: unreadable (not this benchmark's results); move it away"
    with pytest.raises(SystemExit) as a:
        bench_attention.load_results(str(path), "sha256:r")
    assert str(a.value) == f"bench_attention: {path}: unreadable (not this benchmark's results); move it away or give another --out"


def test_bench_attention_refuses_results_on_other_rows_and_one_without_rows(tmp_path) -> None:
    path = tmp_path / "r.json"
    fresh = bench_attention.load_results(str(path), "sha256:r")
    assert fresh["rows"] == "sha256:r"
    path.write_text(json.dumps({"attention": [], "steps": []}))  # no rows recorded: not taken as these rows
    with pytest.raises(SystemExit, match=r"holds results on other rows \(None, these are sha256:r\); give another --out"):
        bench_attention.load_results(str(path), "sha256:r")
