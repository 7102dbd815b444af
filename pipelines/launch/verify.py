"""The job's third step, after the pipeline: the accounting, bad-record, mixture and stop-token
checks that decide whether anything is published."""

from __future__ import annotations

import logging

from pipelines import output
from pipelines.configs import PackConfig
from pipelines.launch import job_stats
from pipelines.launch.errors import JobError
from pipelines.summary import LengthStats, PlanSummary, RunSummary
from prepack.packing.accounting import Tally, arrival_problem
from prepack.packing.bad_records import advice, too_many_bad_records
from prepack.packing.packer import OverlongPolicy

log = logging.getLogger("prepack.pack")


def check_stats(stats: LengthStats, max_length: int, plan: PlanSummary, cap: int | None = None) -> list[str]:
    """Accounting problems (empty when all is well): every example read is written or dropped
    (under --overlong split or window, each of its pieces), and no row holds more than `cap` segments."""
    problems = []
    problem = arrival_problem(stats.examples_read, stats.examples_written, sum(stats.examples_dropped.values()),
                              stats.examples_split, stats.split_pieces, stats.examples_windowed or 0, stats.window_pieces or 0,
                              stats.examples_repeated or 0)  # a mixture's extra copies
    if problem:
        problems.append(f"L={max_length}: {problem}")
    if stats.examples_written != plan.num_examples:
        problems.append(f"L={max_length}: {stats.examples_written} examples in rows, but the plan placed {plan.num_examples}")
    if stats.rows != plan.num_rows:
        problems.append(f"L={max_length}: {stats.rows} rows written, but the plan has {plan.num_rows}")
    if cap is not None and stats.packing["segments_per_row"]["max"] > cap:
        problems.append(f"L={max_length}: a row holds {stats.packing['segments_per_row']['max']} segments, more than "
                        f"--max-segments-per-row {cap}")
    return problems


def bad_fraction_error(stats: LengthStats, config: PackConfig, failed_paths: list[str]) -> str | None:
    line = too_many_bad_records(stats.bad_records, stats.examples_read, stats.examples_dropped, config.rows.max_bad_fraction)
    if line is None:
        return None
    where = f"; they are listed in {failed_paths[0]}" if failed_paths else ""
    return f"{line}. Nothing was published{where}. Fix the inputs, or raise --max-bad-fraction to skip them"


def untrained_eot_error(summary: RunSummary, config: PackConfig) -> str | None:
    """The stop-token check's verdict: one line when target turns do not train their end of turn."""
    tally = Tally.from_json(summary.tally)
    if not tally.turns_without_trained_eot or config.run.allow_untrained_eot:
        return None
    return (f"{tally.turns_without_trained_eot} target assistant turn(s) do not train their end-of-turn token "
            f"(e.g. example {tally.untrained_eot_example}), so the model would not learn to stop: the chat template "
            f"must end each assistant turn with its end-of-turn token inside the reply (use chat format gemma, chatml "
            f"or qwen3, or fix the template); nothing was published. Pass --allow-untrained-eot to publish anyway")


def empty_think_note(summary: RunSummary) -> str | None:
    tally = Tally.from_json(summary.tally)
    if not tally.trained_empty_think:
        return None
    return (f"{tally.trained_empty_think} trained empty think block(s) (e.g. example {tally.empty_think_example}): "
            f"the model learns to skip its reasoning; counted as stats.trained_empty_think")


def verify(config: PackConfig, run_id: str, summary: RunSummary, held: output.OutputLock) -> dict[int, LengthStats]:
    """Each length's figures, once they add up and pass every check; raises JobError (nothing
    published, dead letters of a failed run kept under the lock `held`) when not."""
    stats: dict[int, LengthStats] = {}
    problems: list[str] = []
    for L in config.rows.max_lengths:
        stats[L] = job_stats.length_stats(summary, L, config.rows.pack, config.rows.overlong is OverlongPolicy.WINDOW,
                                          config.rows.preference)
        problems += check_stats(stats[L], L, summary.lengths[L].plan, config.rows.max_segments_per_row)
    if problems:
        raise JobError("accounting check failed, nothing was published: " + "; ".join(problems))
    first = stats[config.rows.max_lengths[0]]
    if _empty_or_all_bad(first, config, []) is not None:
        kept = output.keep_failed_dead_letters(config.run.output, config.rows.max_lengths, run_id, held) if first.bad_records else []
        raise JobError(_empty_or_all_bad(first, config, kept))
    if _source_bad_records(config, summary) is not None:  # named per source, before the mix's
        kept = output.keep_failed_dead_letters(config.run.output, config.rows.max_lengths, run_id, held)
        where = f"; they are listed in {kept[0]}" if kept else ""
        raise JobError(f"{_source_bad_records(config, summary)}; nothing was published{where}")
    if bad_fraction_error(first, config, []) is not None:
        kept = output.keep_failed_dead_letters(config.run.output, config.rows.max_lengths, run_id, held)
        raise JobError(bad_fraction_error(first, config, kept))
    _check_mixture(config, summary)
    if untrained_eot_error(summary, config) is not None:
        raise JobError(untrained_eot_error(summary, config))
    if empty_think_note(summary) is not None:
        log.warning(empty_think_note(summary))
    no_rows = [L for L in config.rows.max_lengths if stats[L].rows == 0]
    if no_rows:
        raise JobError(
            f"no example fits max length {', '.join(map(str, no_rows))} (examples dropped: "
            f"{stats[no_rows[0]].examples_dropped}); nothing was published"
        )
    for note in shard_notes(config, summary):
        log.warning(note)
    return stats


def _empty_or_all_bad(stats: LengthStats, config: PackConfig, kept: list[str]) -> str | None:
    if stats.records_read == 0:
        return (f"the inputs hold no records ({', '.join(config.rows.inputs)} {'is' if len(config.rows.inputs) == 1 else 'are'} "
                "empty); nothing was published. Check --input")
    if stats.examples_read and stats.bad_records == stats.examples_read:
        where = f"; they are listed in {kept[0]}" if kept else ""
        return (f"all {stats.examples_read} examples read are bad records ({', '.join(f'{k} {v}' for k, v in sorted(stats.examples_dropped.items()))})"
                f"{advice(stats.examples_dropped)}; nothing was published{where}. Check --format and the inputs")
    if stats.examples_read == 0:
        return (f"no examples in the inputs ({stats.records_read} records read, "
                f"{sum(stats.records_filtered.values())} left out by design); nothing was published")
    return None


def shard_notes(config: PackConfig, summary: RunSummary) -> list[str]:
    notes = []
    for L in config.rows.max_lengths:
        written = summary.lengths[L].plan.num_shards
        if config.rows.num_shards is not None and written < config.rows.num_shards:
            rows = summary.lengths[L].plan.num_rows
            notes.append(f"L{L}: --num-shards {config.rows.num_shards} asked, {written} written ({rows} rows; a shard holds at least one row)")
    return notes


def _source_bad_records(config: PackConfig, summary: RunSummary) -> str | None:
    """The first source whose own bad-record fraction is over --max-bad-fraction, in one line
    (prepack.packing.mixture.first_bad_source); bad records do not depend on L."""
    from prepack.packing.accounting import Tally
    from prepack.packing.mixture import first_bad_source

    return first_bad_source(config.rows.mixture, Tally.from_json(summary.tally), config.rows.max_lengths[0], config.rows.max_bad_fraction)


def _check_mixture(config: PackConfig, summary: RunSummary) -> None:
    """Per source and length: the accounting identity, the bad fraction, usable examples, and
    the realized shares (prepack.packing.mixture.check_sources); raises JobError with one line."""
    from prepack.packing.accounting import Tally
    from prepack.packing.mixture import source_problems

    tally = Tally.from_json(summary.tally)
    for L in config.rows.max_lengths:
        problems, notes = source_problems(config.rows.mixture, tally, L, config.run.allow_short_mix, config.rows.max_bad_fraction)
        if problems:
            raise JobError(f"{problems[0]}; nothing was published")
        for note in notes:
            log.warning(note)
