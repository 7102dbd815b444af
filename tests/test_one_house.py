"""Every run is a mixture, and the job's two configs: a plain run is one source no set records,
packed by the same code as a mixture file's; what a run records of its mixture follows one rule
(Mixture.recorded); RunOptions never change a byte of the rows."""

from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import pytest

from pipelines.launch.errors import JobError
from pipelines.launch.job import run
from pipelines.options import parse_args
from prepack.format.manifest import without_volatile
from prepack.packing.mixture import Mixture, budgets
from testkit.pipeline import IN_PROCESS, alpaca_records, read_shard_set, shard_bytes, write_jsonl

ONE_SOURCE = """\
weight_of: {weight_of}
sources:
  - name: alpaca
    input: data/alpaca.jsonl
    format: alpaca
    weight: 5
"""


def pack(args: list[str]):
    config, beam_args = parse_args(args + ["--no-progress"] + IN_PROCESS)
    return run(config, beam_args)


def data(tmp_path) -> str:
    os.makedirs(tmp_path / "data", exist_ok=True)
    return write_jsonl(str(tmp_path / "data" / "alpaca.jsonl"), alpaca_records(40))


def test_a_plain_run_is_one_source_that_no_set_records(tmp_path):
    config, _ = parse_args(["--input", "a.jsonl", "--input", "b.jsonl", "--format", "alpaca", "--output", "o"])
    (source,) = config.rows.mixture.sources
    assert (source.index, source.inputs, source.format, source.weight) == (1, ("a.jsonl", "b.jsonl"), "alpaca", Fraction(1))
    assert config.rows.mixture.max_repeats == 1 and not config.rows.mixture.recorded
    assert config.rows.mixture.source_of_input() == (1, 1)
    (tmp_path / "mix.yaml").write_text(ONE_SOURCE.format(weight_of="examples"))
    assert parse_args(["--mixture", str(tmp_path / "mix.yaml"), "--output", "o"])[0].rows.mixture.recorded


@pytest.mark.parametrize("kept", [1, 7, 1000, 123_457])
def test_the_share_rule_writes_a_single_source_whole_and_once(kept):
    single = Mixture.single(("x",), "alpaca")
    (budget,) = budgets([kept], single.weights, single.max_repeats)
    assert (budget.copies, budget.rest) == (1, 0) and budget.written(0) == kept


@pytest.mark.parametrize("weight_of", ["examples", "target_tokens"])
def test_a_plain_run_writes_the_rows_of_a_one_source_mixture_without_their_source_ids(tmp_path, weight_of):
    """The same examples in the same rows: the plain set keeps row format 1 and names no mixture;
    the mixture file's set adds only the sources it records (source_ids 1 on every token)."""
    spec = data(tmp_path)
    (tmp_path / "mix.yaml").write_text(ONE_SOURCE.format(weight_of=weight_of))
    pack(["--input", spec, "--format", "alpaca", "--max-length", "128", "--output", str(tmp_path / "plain")])
    pack(["--mixture", str(tmp_path / "mix.yaml"), "--max-length", "128", "--output", str(tmp_path / "mixed")])
    plain, plain_rows = read_shard_set(str(tmp_path / "plain" / "L128"))
    mixed, mixed_rows = read_shard_set(str(tmp_path / "mixed" / "L128"))
    assert plain.format_version == 1 and plain.mixture is None and "sources" not in plain.template
    assert mixed.format_version == 2 and [s["name"] for s in mixed.mixture["sources"]] == ["alpaca"]
    assert len(plain_rows) == len(mixed_rows) > 0
    for a, b in zip(plain_rows, mixed_rows):
        assert "source_ids" not in a and set(b) == set(a) | {"source_ids"}
        for field in a:
            np.testing.assert_array_equal(a[field], b[field])
        np.testing.assert_array_equal(b["source_ids"], (b["segment_ids"] > 0).astype(b["source_ids"].dtype))


def test_a_plain_inputs_failure_names_the_input_not_a_source(tmp_path):
    missing = str(tmp_path / "gone.jsonl")
    with pytest.raises(JobError) as e:
        pack(["--input", missing, "--format", "alpaca", "--output", str(tmp_path / "out")])
    assert str(e.value) == f"input {missing!r}: no such file"


def test_run_options_do_not_change_a_byte_of_the_rows(tmp_path):
    spec = data(tmp_path)
    common = ["--input", spec, "--format", "alpaca", "--max-length", "96", "256"]
    other = ["--tokenize-batch-size", "3", "--lock-expiry-s", "30", "--no-tokens", "--verbose", "--overwrite"]
    first, _ = parse_args(common + ["--output", str(tmp_path / "a")])
    second, _ = parse_args(common + other + ["--output", str(tmp_path / "b")])
    assert first.rows == second.rows and first.run != second.run
    pack(common + ["--output", str(tmp_path / "a")])
    pack(common + other + ["--output", str(tmp_path / "b")])
    for L in (96, 256):
        a, b = tmp_path / "a" / f"L{L}", tmp_path / "b" / f"L{L}"
        assert shard_bytes(str(a)) == shard_bytes(str(b))
        assert without_volatile((a / "manifest.json").read_text()) == without_volatile((b / "manifest.json").read_text())


# The job's steps and stages in the order the data flows: what the config's walk must enter, each
# from one place (testkit/config_walk.py says how a walk is traced).
LAUNCH_STEPS = ("pipelines/launch/job.py", "pipelines/launch/prepare_job.py", "pipelines/launch/graph.py",
                "pipelines/launch/verify.py", "pipelines/launch/manifest_compose.py")
STAGES = ("pipelines/stages/prepare.py", "pipelines/stages/fit.py", "pipelines/stages/mix.py",
          "pipelines/stages/route.py", "pipelines/stages/write.py")


def _assert_walked_once_in_order(walk) -> None:
    assert walk.entered_more_than_once == {}
    order = walk.order
    assert [m for m in order if m in LAUNCH_STEPS] == list(LAUNCH_STEPS)
    assert [m for m in order if m in STAGES] == [s for s in STAGES if s in order]
    # The stages are entered from the graph step alone, between the checks and the verdicts.
    assert {walk.entrants(s) for s in STAGES if s in order} == {("pipelines/launch/graph.py",)}
    assert order.index("pipelines/launch/graph.py") < min(order.index(s) for s in STAGES if s in order)
    assert max(order.index(s) for s in STAGES if s in order) < order.index("pipelines/launch/verify.py")


@pytest.mark.slow
def test_the_config_walk_enters_each_module_once_in_the_order_the_data_flows():
    from testkit.config_walk import walk_pack

    walk = walk_pack(["--sample", "--max-length", "512"])
    _assert_walked_once_in_order(walk)
    assert set(STAGES) <= set(walk.order)


@pytest.mark.slow
def test_a_cut_mixture_walks_each_module_once_too(tmp_path):
    """A mixture file under --overlong split reaches the modules a plain run does not (the fit
    stage's per-source weights, the pieces' units) and still enters each from one place."""
    from testkit.config_walk import walk_pack

    os.makedirs(tmp_path / "data", exist_ok=True)
    write_jsonl(str(tmp_path / "data" / "a.jsonl"), alpaca_records(30))
    write_jsonl(str(tmp_path / "data" / "b.jsonl"), alpaca_records(30, seed=1))
    (tmp_path / "mix.yaml").write_text(
        "sources:\n  - name: a\n    input: data/a.jsonl\n    format: alpaca\n    weight: 2\n"
        "  - name: b\n    input: data/b.jsonl\n    format: alpaca\n    weight: 1\n")
    walk = walk_pack(["--mixture", str(tmp_path / "mix.yaml"), "--max-length", "64", "--overlong", "split"])
    _assert_walked_once_in_order(walk)
    assert "pipelines/mix_weights.py" in walk.order


@pytest.mark.slow
def test_a_from_tokens_run_walks_each_module_once_too(tmp_path):
    """--from-tokens: the launcher opens and reconciles the set (launch/token_set.py) from its
    first step, and no stage module is entered before the graph."""
    from testkit.config_walk import walk_pack

    pack(["--sample", "--max-length", "256", "--output", str(tmp_path / "first")])
    walk = walk_pack(["--from-tokens", str(tmp_path / "first" / "tokens"), "--max-length", "512"])
    _assert_walked_once_in_order(walk)
    assert walk.entrants("pipelines/launch/token_set.py") == ("pipelines/launch/prepare_job.py",)
    assert "pipelines/stages/prepare.py" not in walk.order
