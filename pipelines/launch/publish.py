"""Launcher side of writing: checks before the run, the figures and the manifest.

Publishing itself (the lock, the order that lets readers see the old set or the new
one, never a mix, and staging clean-up) is the output layer, pipelines/output/.
"""

from __future__ import annotations

import math
from typing import Any

from pipelines.options import PackConfig
from pipelines.summary import LengthStats, PlanSummary, RunSummary, ShardSummary
from prepack import storage
from prepack.format.layout import summary_path
from prepack.packing.accounting import Tally
from prepack.packing.bad_records import too_many_bad_records
from prepack.format.manifest import DEAD_LETTER_NAME, Manifest, ShardInfo
from prepack.packing.stats import PackingStats


class JobError(RuntimeError):
    """The job cannot run or its result cannot be published; the message says why and what to do."""


def refuse_existing(config: PackConfig) -> None:
    """Fails when a set this run would write already exists and --overwrite was not given."""
    from prepack.overwrite import refuse_existing_sets

    message = None if config.overwrite else refuse_existing_sets(config.output, config.max_lengths, config.write_tokens)
    if message:
        raise JobError(message)


def read_summary(output: str, run_id: str) -> RunSummary:
    path = summary_path(output, run_id)
    data = storage.read_bytes(path)
    if data is None:
        raise FileNotFoundError(path)
    return RunSummary.from_json(data.decode("utf-8"))


# ----------------------------------------------------------------------------- figures


def length_stats(summary: RunSummary, max_length: int, pack: bool = True, windowed: bool = False) -> LengthStats:
    """The manifest's `stats` for one max length, from the run summary; `windowed`: the run is
    --overlong window (its three figures are then recorded, 0 where nothing was longer)."""
    tally = Tally.from_json(summary.tally)
    per = summary.lengths[max_length]
    shards = per.shards
    plan = per.plan
    written = sum(s.segments for s in shards)
    rows = sum(s.num_rows for s in shards)
    packing = PackingStats(
        max_length=max_length,
        examples=written,
        tokens=sum(s.tokens for s in shards),
        target_tokens=sum(s.target_tokens for s in shards),
        rows=rows,
        min_segments_per_row=min((s.min_segments for s in shards), default=0),
        max_segments_per_row=max((s.max_segments for s in shards), default=0),
    ).as_dict()
    packing.pop("max_length")
    packing.pop("examples")
    examples_read = tally.examples_read
    return LengthStats(
        records_read=tally.records_read,
        records_filtered=dict(sorted(tally.filtered.items())),
        examples_read=examples_read,
        examples_written=written,
        examples_dropped=tally.examples_dropped(max_length),
        examples_truncated=tally.truncated.get(max_length, 0),
        examples_split=tally.split.get(max_length, 0),
        split_pieces=tally.split_pieces.get(max_length, 0),
        bad_records=tally.bad,
        bad_fraction=tally.bad / examples_read if examples_read else 0.0,
        bfd_rows=plan.bfd_rows if pack else None,
        planned_examples=plan.num_examples,
        dead_letter_entries=per.dead_letter_entries,
        packing=packing,
        examples_repeated=tally.repeated.get(max_length, 0) if tally.sources else None,
        turns_without_trained_eot=tally.turns_without_trained_eot or None,
        trained_empty_think=tally.trained_empty_think or None,
        examples_windowed=tally.windowed.get(max_length, 0) if windowed else None,
        window_pieces=tally.window_pieces.get(max_length, 0) if windowed else None,
        context_tokens_replayed=tally.context_replayed.get(max_length, 0) if windowed else None,
        planner_fallback=plan.planner_fallback,
    )


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
    line = too_many_bad_records(stats.bad_records, stats.examples_read, stats.examples_dropped, config.max_bad_fraction)
    if line is None:
        return None
    where = f"; they are listed in {failed_paths[0]}" if failed_paths else ""
    return f"{line}. Nothing was published{where}. Fix the inputs, or raise --max-bad-fraction to skip them"


def untrained_eot_error(summary: RunSummary, config: PackConfig) -> str | None:
    """The stop-token check's verdict: one line when target turns do not train their end of turn."""
    tally = Tally.from_json(summary.tally)
    if not tally.turns_without_trained_eot or config.allow_untrained_eot:
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


# ----------------------------------------------------------------------------- publishing


def compose_manifest(
    config: PackConfig, max_length: int, stats: LengthStats, shards: tuple[ShardSummary, ...], job_info: dict[str, Any],
    method: str | None = None,
) -> Manifest:
    """`method`: what made the rows (the plan's: bfd, exact_fill or unpacked), the manifest's `packing`."""
    infos = [ShardInfo(path=s.path, num_rows=s.num_rows, num_bytes=s.num_bytes, sha256=s.sha256) for s in shards]
    return Manifest(
        max_length=max_length,
        num_rows=sum(s.num_rows for s in infos),
        shards=infos,
        tokenizer=job_info["tokenizer"],
        stats=stats.to_json(),
        packing=method or ("bfd" if config.pack else "unpacked"),
        template=job_info["template"],
        inputs=job_info["inputs"],
        options={**config.manifest_options(), "sub_buckets": job_info["sub_buckets"]},
        tool=job_info["tool"],
        dead_letter=DEAD_LETTER_NAME if stats.dead_letter_entries else None,
    )


def rows_over(value: int, bound: int) -> float:
    return value / bound if bound else math.nan
