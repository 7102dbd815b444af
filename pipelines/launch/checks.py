"""The launcher's verdicts: the overwrite rule before the run, and after it the accounting,
bad-record and stop-token checks that decide whether anything is published."""

from __future__ import annotations

from pipelines.launch.errors import JobError
from pipelines.configs import PackConfig
from pipelines.summary import LengthStats, PlanSummary, RunSummary
from prepack import overwrite
from prepack.packing.accounting import Tally
from prepack.packing.bad_records import too_many_bad_records


def existing_sets_refusal(config: PackConfig) -> str | None:
    """The overwrite rule (prepack/overwrite.py) for this run's config: the one-line refusal when
    a set it would write already exists and --overwrite was not given, else None. `prepack pack`
    asks it before Beam is imported; the job asks only when no caller has."""
    return None if config.run.overwrite else overwrite.refuse_existing_sets(config.run.output, config.rows.max_lengths,
                                                                        config.run.write_tokens)


def refuse_existing(config: PackConfig) -> None:
    """Fails with JobError when existing_sets_refusal refuses."""
    message = existing_sets_refusal(config)
    if message:
        raise JobError(message)


def check_stats(stats: LengthStats, max_length: int, plan: PlanSummary, cap: int | None = None) -> list[str]:
    """Accounting problems (empty when all is well): every example read is written or dropped
    (under --overlong split or window, each of its pieces), and no row holds more than `cap` segments."""
    problems = []
    dropped = sum(stats.examples_dropped.values())
    repeated = stats.examples_repeated or 0  # a mixture's extra copies
    windowed, window_pieces = stats.examples_windowed or 0, stats.window_pieces or 0
    arrived = stats.examples_read - stats.examples_split + stats.split_pieces - windowed + window_pieces + repeated
    if arrived != stats.examples_written + dropped:
        problems.append(
            f"L={max_length}: examples read {stats.examples_read} (- split {stats.examples_split} + pieces "
            f"{stats.split_pieces}{f' - windowed {windowed} + window pieces {window_pieces}' if windowed else ''}"
            f"{f' + repeats {repeated}' if repeated else ''}) != written {stats.examples_written} "
            f"+ dropped {dropped}"
        )
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
