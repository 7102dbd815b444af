"""Fit stage: the overlong policy for every max length, and the (L, length, sub-bucket)
histogram the plan is made from; kept examples are keyed for the routing GroupByKey."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.metrics.metric import Metrics
from apache_beam.pvalue import TaggedOutput

from pipelines.columns import TokenizedBatch
from pipelines.planning import sub_buckets_of
from pipelines.records import dead_letter
from pipelines.stage import FLUSH_EXAMPLES, NAMESPACE, TAG_DEAD, TAG_HIST, TAG_TALLY, JobContext, StageClock, in_global_window
from prepack.packer import DropReason, OverlongPolicy


class FitAndKeyFn(beam.DoFn):
    """TokenizedBatches -> ((length_key, b), PayloadBatch wire) for the routing GroupByKey.

    Applies the overlong policy for every max length (counting drops by reason and
    writing their dead letters) and builds this bundle's share of the
    (L, length_key, b) histogram the plan is made from. The common case, an example with
    a target that fits every max length, is decided for the whole batch with array
    operations; the others go one by one.
    """

    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    def setup(self) -> None:
        self.m_dropped = {L: Metrics.counter(NAMESPACE, f"L{L}_dropped") for L in self.ctx.max_lengths}
        self.m_truncated = {L: Metrics.counter(NAMESPACE, f"L{L}_truncated") for L in self.ctx.max_lengths}
        self.clock = StageClock("fit")

    def start_bundle(self) -> None:
        # Kept examples wait here until a flush: (batch of kept examples, group code of each).
        self.pending: list[tuple[TokenizedBatch, np.ndarray]] = []
        self.buffered = 0
        self.hist: Counter = Counter()
        # (length_key, b) of examples that fit every max length: expanded into hist at the
        # end of the bundle (one Counter update per group instead of one per example and L).
        self.hist_fits_all: Counter = Counter()
        self.tally: Counter = Counter()

    def process(self, batch: TokenizedBatch) -> Iterator[Any]:
        started = StageClock.now()
        ctx = self.ctx
        buckets = ctx.sub_buckets
        lens = batch.examples.lens.astype(np.int64)
        has_targets = batch.targets_after_first() > 0
        fits_all = has_targets & (lens <= min(ctx.max_lengths))
        length_keys = lens if ctx.pack else np.zeros_like(lens)
        # One int per (length_key, b) group: code = length_key * B + b.
        codes = length_keys * buckets + sub_buckets_of(batch.hashes, buckets)
        groups, counts = np.unique(codes[fits_all], return_counts=True)
        for code, count in zip(groups.tolist(), counts.tolist()):
            self.hist_fits_all[divmod(code, buckets)] += count
        kept = fits_all.copy()
        others = np.flatnonzero(~fits_all).tolist()
        if others:
            yield from self._fit_one_by_one(batch, others, has_targets, codes, kept)
        index = np.flatnonzero(kept)
        if len(index):
            # Only kept examples wait for the flush, so FLUSH_EXAMPLES bounds what a bundle holds.
            if len(index) < len(batch):
                batch = batch.take(index)
            self.pending.append((batch, codes[index]))
            self.buffered += len(index)
        self.clock.add(StageClock.now() - started)
        if self.buffered >= FLUSH_EXAMPLES:
            yield from self._flush(windowed=False)

    def _fit_one_by_one(self, batch: TokenizedBatch, others: list[int], has_targets: np.ndarray,
                        codes: np.ndarray, kept: np.ndarray) -> Iterator[Any]:
        """Examples without a target, or longer than the shortest max length."""
        ctx = self.ctx
        truncate = ctx.overlong is OverlongPolicy.TRUNCATE
        hist, tally = self.hist, self.tally
        lens = batch.examples.lens
        targets_within: dict[int, np.ndarray] = {}  # L -> targets after the first within L tokens
        for i in others:
            n, eid, loc = int(lens[i]), batch.example_ids[i], batch.locs[i]
            if not has_targets[i]:
                tally[("no_targets",)] += 1
                entry = dead_letter(ctx.tasks, loc, "no_targets", "", "no target token after the first, so the example "
                                    "trains nothing", None, example_id=eid, tokens=n)
                for L in ctx.max_lengths:
                    yield TaggedOutput(TAG_DEAD, (L, entry))
                continue
            key, b = divmod(int(codes[i]), ctx.sub_buckets)
            for L in ctx.max_lengths:
                if n <= L:
                    hist[(L, key, b)] += 1
                    kept[i] = True
                    continue
                if truncate:
                    if L not in targets_within:
                        targets_within[L] = batch.targets_after_first(L)
                    if targets_within[L][i] > 0:
                        hist[(L, key, b)] += 1
                        tally[("L", L, "truncated")] += 1
                        self.m_truncated[L].inc()
                        kept[i] = True
                        continue
                reason = DropReason.NO_TARGETS_AFTER_TRUNCATION if truncate else DropReason.TOO_LONG
                tally[("L", L, "dropped", reason.value)] += 1
                self.m_dropped[L].inc()
                message = (f"no target token left after truncating {n} tokens to {L}" if truncate
                           else f"{n} tokens, more than max_length {L}")
                yield TaggedOutput(TAG_DEAD, (L, dead_letter(ctx.tasks, loc, reason.value, "", message, None,
                                                             example_id=eid, tokens=n)))

    def _flush(self, windowed: bool) -> Iterator[Any]:
        wrap = in_global_window if windowed else (lambda v: v)
        if self.pending:
            merged = TokenizedBatch.concat([batch for batch, _ in self.pending])
            codes = np.concatenate([c for _, c in self.pending])
            for code, payloads in merged.grouped_payloads(codes):
                yield wrap((divmod(code, self.ctx.sub_buckets), payloads.to_wire()))
        self.pending = []
        self.buffered = 0

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._flush(windowed=True)
        for (key, b), count in self.hist_fits_all.items():
            for L in self.ctx.max_lengths:
                self.hist[(L, key, b)] += count
        yield TaggedOutput(TAG_HIST, in_global_window(self.hist))
        yield TaggedOutput(TAG_TALLY, in_global_window(self.tally))
