"""The run's figures: the run summary the pipeline wrote, and the manifest's `stats` per max length."""

from __future__ import annotations

from pipelines.summary import LengthStats, RunSummary
from prepack import storage
from prepack.format.layout import summary_path
from prepack.packing.accounting import Tally
from prepack.packing.stats import PackingStats


def read_summary(output: str, run_id: str) -> RunSummary:
    path = summary_path(output, run_id)
    data = storage.read_bytes(path)
    if data is None:
        raise FileNotFoundError(path)
    return RunSummary.from_json(data.decode("utf-8"))


def length_stats(summary: RunSummary, max_length: int, pack: bool = True, windowed: bool = False,
                 preference: bool = False) -> LengthStats:
    """The manifest's `stats` for one max length, from the run summary; `windowed`: the run is
    --overlong window (its three figures are then recorded, 0 where nothing was longer); `preference`:
    a preference set (a pair is one example; its sides' figures are recorded too)."""
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
        preference_figures=_pair_figures(tally, max_length, shards) if preference else None,
    )


def _pair_figures(tally: Tally, max_length: int, shards: tuple) -> dict[str, object]:
    """A preference set's own names for its figures: a pair is one example, so pairs_read =
    pairs_written + sum(pairs_dropped) is the accounting identity; and each side's tokens."""
    tokens, targets = sum(s.tokens for s in shards), sum(s.target_tokens for s in shards)
    rejected, rejected_targets = sum(s.rejected_tokens for s in shards), sum(s.rejected_target_tokens for s in shards)
    return {"pairs_read": tally.examples_read, "pairs_written": sum(s.segments for s in shards),
            "pairs_dropped": tally.examples_dropped(max_length),
            "chosen_tokens": tokens - rejected, "rejected_tokens": rejected,
            "chosen_target_tokens": targets - rejected_targets, "rejected_target_tokens": rejected_targets}
