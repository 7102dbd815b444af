"""The accounting checks that decide whether anything is published, each fed wrong counts: the
job's identity per max length (pipelines/launch/verify.py, through its one statement in
prepack.packing.accounting) and each mixture source's (prepack.packing.mixture). Each of these
checks could be disabled with every test still green: here a count off by one fails each, and
the job run whose pipeline miscounted publishes nothing."""

from __future__ import annotations

import dataclasses

import pytest

from pipelines.launch import graph, verify
from pipelines.launch.errors import JobError
from pipelines.launch.job import run
from pipelines.options import parse_args
from pipelines.summary import LengthStats, PlanSummary
from prepack.packing.accounting import Tally, arrival_problem
from prepack.packing.mixture import Mixture, MixtureSource, check_sources
from testkit.pipeline import IN_PROCESS, alpaca_records, write_jsonl

# 10 read: 7 written, 2 too long, 1 bad record; under split 1 example became 3 pieces.
GOOD = LengthStats(records_read=10, records_filtered={}, examples_read=10, examples_written=7,
                   examples_dropped={"too_long": 2, "malformed_json": 1}, examples_truncated=0, examples_split=0,
                   split_pieces=0, bad_records=1, bad_fraction=0.1, bfd_rows=3, planned_examples=7, dead_letter_entries=3,
                   packing={"rows": 3, "segments_per_row": {"min": 2, "mean": 7 / 3, "max": 3}})
PLAN = PlanSummary(num_rows=3, num_shards=1, num_examples=7, tokens=100, min_segments=2, max_segments=3, bfd_rows=3,
                   method="bfd")


@pytest.mark.parametrize("change, words", [
    ({"examples_read": 11}, "examples read 11 (- split 0 + pieces 0) != written 7 + dropped 3"),
    ({"examples_written": 6, "planned_examples": 6}, "examples read 10 (- split 0 + pieces 0) != written 6 + dropped 3"),
    ({"examples_dropped": {"too_long": 3, "malformed_json": 1}}, "!= written 7 + dropped 4"),
    ({"examples_split": 1, "split_pieces": 2}, "examples read 10 (- split 1 + pieces 2) != written 7 + dropped 3"),
    ({"examples_windowed": 1, "window_pieces": 3}, "- windowed 1 + window pieces 3) != written 7 + dropped 3"),
    ({"examples_repeated": 2}, " + repeats 2) != written 7 + dropped 3"),
])
def test_the_jobs_accounting_check_fails_on_counts_that_do_not_add_up(change, words):
    assert verify.check_stats(GOOD, 64, dataclasses.replace(PLAN)) == []
    stats = dataclasses.replace(GOOD, **change)
    plan = dataclasses.replace(PLAN, num_examples=stats.examples_written)
    problems = verify.check_stats(stats, 64, plan)
    assert len(problems) == 1 and problems[0].startswith("L=64: examples read ") and words in problems[0], problems


def test_pieces_and_repeats_that_do_add_up_pass():
    stats = dataclasses.replace(GOOD, examples_split=1, split_pieces=3, examples_written=9, planned_examples=9,
                                examples_repeated=0)
    assert verify.check_stats(stats, 64, dataclasses.replace(PLAN, num_examples=9)) == []
    assert arrival_problem(10, 9, 3, split=1, pieces=3) is None
    assert arrival_problem(10, 10, 3, windowed=1, window_pieces=3, repeated=1) is None


def test_a_pipeline_that_miscounts_publishes_nothing(tmp_path, monkeypatch):
    """The whole step: an example lost between read and write (the tally says one more was read
    than the rows and drops account for) fails the run in one line, and nothing is published."""
    src = write_jsonl(str(tmp_path / "in.jsonl"), alpaca_records(8, seed=2))
    config, beam_args = parse_args(["--input", src, "--format", "alpaca", "--max-length", "128", "--output",
                                    str(tmp_path / "out"), "--no-progress", *IN_PROCESS])
    real = graph.run_pipeline

    def one_lost(job, args):
        summary, metrics = real(job, args)
        tally = Tally.from_json(summary.tally)
        tally.examples += 1  # one more read than arrived anywhere
        return dataclasses.replace(summary, tally=tally.to_json()), metrics

    monkeypatch.setattr(graph, "run_pipeline", one_lost)
    with pytest.raises(JobError) as e:
        run(config, beam_args)
    assert str(e.value) == ("accounting check failed, nothing was published: L=128: examples read 9 (- split 0 + pieces 0) "
                            "!= written 8 + dropped 0")
    assert not (tmp_path / "out" / "L128").exists() and not (tmp_path / "out" / "published.json").exists()


MIX = Mixture("mix.yaml", "0" * 64, "examples", 1, (MixtureSource(1, "a", ("a.jsonl",), "alpaca", 1),
                                                   MixtureSource(2, "b", ("b.jsonl",), "chat", 1)))


def _figures(**changes) -> list[dict]:
    base = [{"name": "a", "format": "alpaca", "requested_share": 0.5, "realized_share": 0.5, "examples_read": 10,
             "examples_written": 6, "examples_unique": 6, "examples_dropped": {"too_long": 1, "not_sampled": 3},
             "examples_split": 0, "split_pieces": 0, "kept_weight": 9, "written_weight": 6, "repeats": 0.666667},
            {"name": "b", "format": "chat", "requested_share": 0.5, "realized_share": 0.5, "examples_read": 6,
             "examples_written": 6, "examples_unique": 6, "examples_dropped": {}, "examples_split": 0, "split_pieces": 0,
             "kept_weight": 6, "written_weight": 6, "repeats": 1.0}]
    base[0].update(changes)
    return base


@pytest.mark.parametrize("change, words", [
    ({"examples_read": 11}, "mixture source 'a': examples read 11 (- split 0 + pieces 0) != unique written 6 + dropped 4"),
    ({"examples_unique": 5}, "mixture source 'a': examples read 10 (- split 0 + pieces 0) != unique written 5 + dropped 4"),
    ({"examples_dropped": {"too_long": 1}}, "mixture source 'a': examples read 10 (- split 0 + pieces 0) != unique written 6 + dropped 1"),
    ({"examples_split": 1, "split_pieces": 3}, "mixture source 'a': examples read 10 (- split 1 + pieces 3) != unique written 6 + dropped 4"),
])
def test_the_per_source_accounting_check_fails_on_counts_that_do_not_add_up(change, words):
    assert check_sources(MIX, _figures(), 64, allow_short=False, max_bad_fraction=0.0) == ([], [])
    problems, _ = check_sources(MIX, _figures(**change), 64, allow_short=False, max_bad_fraction=0.0)
    assert problems[0] == f"L=64: {words}", problems
