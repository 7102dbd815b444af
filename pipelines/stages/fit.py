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

from pipelines.wire.columns import Ragged, TokenizedBatch
from pipelines.planning import stable_hash, sub_buckets_of
from pipelines.wire.records import dead_letter
from pipelines.stage_shared import (FLUSH_EXAMPLES, NAMESPACE, TAG_DEAD, TAG_HIST, TAG_TALLY, TAG_WEIGHTS, JobContext, StageClock,
                             in_global_window)
from prepack.packing.accounting import Tally
from prepack.packing.fitting import Cut, FitCounts, fit_length
from prepack.packing.packer import DropReason, OverlongPolicy, WindowPiece, piece_id


class FitAndKeyFn(beam.DoFn):
    """TokenizedBatches -> ((length_key, b), PayloadBatch wire) for the routing GroupByKey.

    Contract: applies the overlong rule (prepack.packing.fitting.fit_length, the one preflight runs too) at every max length;
    every example either travels on, carrying in PayloadBatch.kept_at the max lengths it is kept
    at, or is dropped at a max length with a dead letter and a tally entry of its reason (an
    example with no target at all is counted once in Tally.no_targets and dropped at every L). Builds this
    bundle's share of the (L, length_key, b) histogram the plan is made from, counting exactly
    the examples kept at each L. The common case, an example with a target that fits every max
    length, is decided for the whole batch at once; the others go through fit_length per L.
    """

    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    def setup(self) -> None:
        self.m_dropped = {L: Metrics.counter(NAMESPACE, f"L{L}_dropped") for L in self.ctx.rows.max_lengths}
        self.m_truncated = {L: Metrics.counter(NAMESPACE, f"L{L}_truncated") for L in self.ctx.rows.max_lengths}
        self.clock = StageClock("fit")
        self.kept_everywhere = np.uint64((1 << len(self.ctx.rows.max_lengths)) - 1)

    def start_bundle(self) -> None:
        # Kept examples wait here until a flush: (batch of kept examples, group code, kept_at of each,
        # and under --overlong split or window each one's example_targets at each max length).
        self.pending: list[tuple[TokenizedBatch, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]] = []
        self.buffered = 0
        self.hist: Counter = Counter()
        # (length_key, b) of examples that fit every max length: expanded into hist at the
        # end of the bundle (one Counter update per group instead of one per example and L).
        self.hist_fits_all: Counter = Counter()
        self.tally = Tally()
        self.weights: Counter = Counter()  # a mixture's (L, source, rank bucket) -> kept weight (pipelines/mix_weights.py)
        self.tallies: dict[int, Tally] = {}  # a mixture's: source -> what this bundle counted of it

    def _by_source(self, batch: TokenizedBatch) -> list[tuple[int, TokenizedBatch]]:
        """A mixture counts each source apart: the batch split by source (one part when it holds
        one read task's examples; a tokenized set's file mixes them)."""
        if not self.ctx.mixture.recorded or not len(batch):
            return [(0, batch)]
        from pipelines.mix_weights import sources_of

        source = sources_of(batch.example_ids, self.ctx.source_of_input)
        if (source == source[0]).all():
            return [(int(source[0]), batch)]
        return [(int(s), batch.take(np.flatnonzero(source == s))) for s in np.unique(source).tolist()]

    def process(self, batch: TokenizedBatch) -> Iterator[Any]:
        for source, part in self._by_source(batch):
            if source:
                self.tally = self.tallies.setdefault(source, Tally())
            yield from self._process(part)

    def _process(self, batch: TokenizedBatch) -> Iterator[Any]:
        started = StageClock.now()
        ctx = self.ctx
        buckets = ctx.sub_buckets
        lens = batch.examples.lens.astype(np.int64)
        has_targets = batch.targets_after_first() > 0
        fits_all = has_targets & (lens <= min(ctx.rows.max_lengths))
        length_keys = lens if ctx.rows.pack else np.zeros_like(lens)
        # One int per (length_key, b) group: code = length_key * B + b.
        codes = length_keys * buckets + sub_buckets_of(batch.hashes, buckets)
        groups, counts = np.unique(codes[fits_all], return_counts=True)
        for code, count in zip(groups.tolist(), counts.tolist()):
            self.hist_fits_all[divmod(code, buckets)] += count
        kept_at = np.where(fits_all, self.kept_everywhere, np.uint64(0)).astype(np.uint64)
        others = np.flatnonzero(~fits_all)
        if len(others):
            yield from self._fit_others(batch, others, has_targets, codes, kept_at)
        index = np.flatnonzero(kept_at)
        if len(index):
            # Only kept examples wait for the flush, so FLUSH_EXAMPLES bounds what a bundle holds.
            if len(index) < len(batch):
                batch = batch.take(index)
            # A whole example: 0, the writer writes its own target count (--overlong split or window only).
            totals = np.zeros((len(index), len(ctx.rows.max_lengths)), np.int32) if ctx.rows.cuts_pieces else None
            self.pending.append((batch, codes[index], kept_at[index], totals, kept_at[index]))  # a whole example leads itself
            self.buffered += len(index)
        self.clock.add(StageClock.now() - started)
        if self.buffered >= FLUSH_EXAMPLES:
            yield from self._flush(windowed=False)

    def _fit_others(self, batch: TokenizedBatch, others: np.ndarray, has_targets: np.ndarray,
                    codes: np.ndarray, kept_at: np.ndarray) -> Iterator[Any]:
        """Examples without a target, or longer than the shortest max length."""
        ctx = self.ctx
        hist, tally = self.hist, self.tally
        lens = batch.examples.lens.astype(np.int64)
        for i in others[~has_targets[others]].tolist():
            tally.no_targets += 1
            entry = dead_letter(ctx.tasks, batch.locs[i], "no_targets", "", "no target token after the first, so the "
                                "example trains nothing", None, example_id=batch.example_ids[i], tokens=int(lens[i]))
            for L in ctx.rows.max_lengths:
                yield TaggedOutput(TAG_DEAD, (L, entry))
        index = others[has_targets[others]]
        if not len(index):
            return
        n = lens[index]
        keys, bs = np.divmod(codes[index], ctx.sub_buckets)
        truncate = ctx.rows.overlong is OverlongPolicy.TRUNCATE
        starts = np.cumsum(batch.examples.lens, dtype=np.int64) - batch.examples.lens
        mask = batch.examples.mask

        def mask_of(j: int) -> np.ndarray:
            first = int(starts[index[j]])
            return mask[first:first + int(n[j])]

        cut_at: dict[int, list[tuple[int, Cut]]] = {}  # example -> (max length's bit, its pieces there)
        for bit, L in enumerate(ctx.rows.max_lengths):
            within = batch.targets_after_first(L)[index] if truncate and (n > L).any() else None
            result = fit_length(n, mask_of, L, ctx.rows.overlong, ctx.rows.window_context_tokens, within)
            for j, cut in result.cuts.items():
                cut_at.setdefault(int(index[j]), []).append((bit, cut))
            kept = result.kept
            kept_at[index[kept]] |= np.uint64(1 << bit)
            for key, b in zip(keys[kept].tolist(), bs[kept].tolist()):
                hist[(L, key, b)] += 1
            self._count(L, result.counts())
            for j, reason in result.dropped_whole():
                i = int(index[j])
                message = (f"no target token left after truncating {n[j]} tokens to {L}" if truncate
                           else f"{n[j]} tokens, more than max_length {L}")
                yield TaggedOutput(TAG_DEAD, (L, dead_letter(ctx.tasks, batch.locs[i], reason.value, "", message, None,
                                                             example_id=batch.example_ids[i], tokens=int(n[j]))))
        if cut_at:
            yield from self._split(batch, starts, cut_at)

    def _count(self, max_length: int, counts: FitCounts) -> None:
        """One max length's fit in the tally (and Beam metrics), as the manifest's stats read it."""
        tally = self.tally
        if counts.truncated:
            tally.truncated[max_length] += counts.truncated
            self.m_truncated[max_length].inc(counts.truncated)
        for reason, count in counts.dropped.items():
            tally.dropped[(max_length, DropReason(reason))] += count
            self.m_dropped[max_length].inc(count)
        if counts.split:
            tally.split[max_length] += counts.split
            tally.split_pieces[max_length] += counts.split_pieces
        if counts.windowed:
            tally.windowed[max_length] += counts.windowed
            tally.window_pieces[max_length] += counts.window_pieces
            tally.context_replayed[max_length] += counts.context_replayed

    @staticmethod
    def _drop_message(piece: WindowPiece, reason: DropReason, n: int, max_length: int) -> str:
        if reason is DropReason.NO_TARGETS_AFTER_SPLIT:
            return (f"no target token after the first in tokens {piece.start}..{piece.end - 1} of {n}, a piece of the "
                    f"example cut at max_length {max_length}")
        return (f"the reply's context, prompt tokens {piece.context_start}..{piece.context_end - 1} of {n} "
                f"({piece.context_tokens} tokens), leaves no room for a target at max_length {max_length}: reply tokens "
                f"{piece.start}..{piece.end - 1} are not trained; give --window-context-tokens below {max_length}")

    def _split(self, batch: TokenizedBatch, starts: np.ndarray, cut_at: dict[int, list[tuple[int, Cut]]]) -> Iterator[Any]:
        """Examples cut into pieces (--overlong split or window) at some max lengths: each piece
        travels on as an example of its own (id piece_id(...), its own hash and sub-bucket), kept
        at every max length that cuts the example there (the last pieces of two max lengths are
        often the same range); a piece the rule does not keep is dropped there with its reason
        (counted with the fit: FitCounts)."""
        ctx = self.ctx
        lengths = ctx.rows.max_lengths
        # (example, context start, context end, start, end) -> kept_at bits; split pieces have no context.
        pieces: dict[tuple[int, int, int, int, int], int] = {}
        for i, cuts in cut_at.items():
            n = int(batch.examples.lens[i])
            for bit, cut in cuts:
                L = lengths[bit]
                for piece, reason in cut:
                    if reason is None:
                        key = (i, piece.context_start, piece.context_end, piece.start, piece.end)
                        pieces[key] = pieces.get(key, 0) | 1 << bit
                        continue
                    key, entry = dead_letter(ctx.tasks, batch.locs[i], reason.value, "",
                                             self._drop_message(piece, reason, n, L), None,
                                             example_id=batch.example_ids[i], tokens=piece.length)
                    # The piece's start in the sort key: two pieces of one example sort the same way in every run.
                    yield TaggedOutput(TAG_DEAD, (L, (key + (piece.start,), entry)))
        if pieces:
            self._add_pieces(batch, starts, pieces)

    def _add_pieces(self, batch: TokenizedBatch, starts: np.ndarray,
                    pieces: dict[tuple[int, int, int, int, int], int]) -> None:
        """The one place pieces become examples: a TokenizedBatch of them, waiting for the flush
        like kept examples, counted into the histogram at each max length that keeps them."""
        ctx = self.ctx
        keys = sorted(pieces)
        cut = [WindowPiece(*k[1:]) for k in keys]
        ids = [piece_id(batch.example_ids[k[0]], p.start, p.end, (p.context_start, p.context_end))
               for k, p in zip(keys, cut)]
        hashes = np.array([stable_hash(e) for e in ids], dtype=np.uint64)
        flat = np.concatenate([starts[k[0]] + p.positions() for k, p in zip(keys, cut)])
        mask = np.concatenate([p.loss_mask(batch.examples.mask[starts[k[0]]:]) for k, p in zip(keys, cut)])
        piece_lens = np.array([p.length for p in cut], dtype=batch.examples.lens.dtype)
        made = TokenizedBatch(hashes, ids, [batch.locs[k[0]] for k in keys],
                              Ragged(piece_lens, batch.examples.ids[flat], mask))
        kept_at = np.array([pieces[k] for k in keys], dtype=np.uint64)
        totals = self._example_targets(np.array([k[0] for k in keys], np.int64), made.targets_after_first(), kept_at)
        leads_at = self._leads(keys, kept_at) if ctx.mixture.recorded else None  # only the mix stage's sampling reads them
        length_keys = piece_lens.astype(np.int64) if ctx.rows.pack else np.zeros(len(keys), np.int64)
        b = sub_buckets_of(hashes, ctx.sub_buckets)
        for bit, L in enumerate(ctx.rows.max_lengths):
            at = (kept_at >> np.uint64(bit)) & np.uint64(1) == 1
            for key, sub in zip(length_keys[at].tolist(), b[at].tolist()):
                self.hist[(L, key, sub)] += 1
        self.pending.append((made, length_keys * ctx.sub_buckets + b, kept_at, totals, leads_at))
        self.buffered += len(keys)

    @staticmethod
    def _leads(keys: list[tuple[int, int, int, int, int]], kept_at: np.ndarray) -> np.ndarray:
        """Per piece (keys sorted, so an example's pieces are adjacent): the max lengths at which
        it is the first of its example's pieces kept there (PayloadBatch.leads_at)."""
        leads = np.zeros(len(keys), np.uint64)
        example, led = -1, 0
        for j, (k, bits) in enumerate(zip(keys, kept_at.tolist())):
            if k[0] != example:
                example, led = k[0], 0
            leads[j] = bits & ~led
            led |= bits
        return leads

    def _example_targets(self, example: np.ndarray, targets: np.ndarray, kept_at: np.ndarray) -> np.ndarray:
        """[pieces, max lengths]: each piece's example's target tokens summed over the pieces kept
        at that max length (row format 3's example_targets), 0 where the piece is not kept. The
        row builder zeroes each piece's first target, as targets_after_first leaves it out, so a
        piece's share targets / example_targets adds up to 1 over its example's pieces."""
        bits = np.arange(len(self.ctx.rows.max_lengths), dtype=np.uint64)
        kept = ((kept_at[:, None] >> bits[None, :]) & np.uint64(1)) == 1  # [pieces, L]
        first, owner = np.unique(example, return_inverse=True)
        sums = np.zeros((len(first), len(bits)), np.int64)
        np.add.at(sums, owner, np.where(kept, targets[:, None], 0))
        return np.where(kept, sums[owner], 0).astype(np.int32)

    def _flush(self, windowed: bool) -> Iterator[Any]:
        wrap = in_global_window if windowed else (lambda v: v)
        if self.pending:
            merged = TokenizedBatch.concat([batch for batch, _, _, _, _ in self.pending])
            codes = np.concatenate([c for _, c, _, _, _ in self.pending])
            kept_at = np.concatenate([k for _, _, k, _, _ in self.pending])
            totals = np.concatenate([t for _, _, _, t, _ in self.pending]) if self.ctx.rows.cuts_pieces else None
            # Only a mixture's mix stage reads leads_at; without one the payloads stay as they were.
            leads = (np.concatenate([d for _, _, _, _, d in self.pending])
                     if totals is not None and self.ctx.mixture.recorded else None)
            for code, payloads in merged.grouped_payloads(codes, kept_at, totals, leads):
                if self.ctx.mixture.recorded:
                    from pipelines.mix_weights import weigh_into

                    weigh_into(self.weights, payloads, self.ctx)
                yield wrap((divmod(code, self.ctx.sub_buckets), payloads.to_wire()))
        self.pending = []
        self.buffered = 0

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._flush(windowed=True)
        for (key, b), count in self.hist_fits_all.items():
            for L in self.ctx.rows.max_lengths:
                self.hist[(L, key, b)] += count
        yield TaggedOutput(TAG_HIST, in_global_window(self.hist))
        if self.tallies:
            self.tally = Tally()
            for source, tally in self.tallies.items():
                self.tally.merge(tally.for_source(source))
        yield TaggedOutput(TAG_TALLY, in_global_window(self.tally))
        if self.ctx.mixture.recorded:
            yield TaggedOutput(TAG_WEIGHTS, in_global_window(self.weights))


class FitToLengths(beam.PTransform):
    """The fit stage as one transform: TokenizedBatches -> {"keyed": examples keyed by (length,
    sub-bucket), "hist": length histograms, "tally": Tallies, "dead": (L, dead letter)}."""

    def __init__(self, ctx: JobContext):
        super().__init__()
        self.ctx = ctx

    def expand(self, examples: Any) -> dict[str, Any]:
        fitted = examples | "FitAndKey" >> beam.ParDo(FitAndKeyFn(self.ctx)).with_outputs(
            TAG_HIST, TAG_TALLY, TAG_DEAD, TAG_WEIGHTS, main="keyed")
        return {"keyed": fitted.keyed, "hist": fitted[TAG_HIST], "tally": fitted[TAG_TALLY], "dead": fitted[TAG_DEAD],
                "weights": fitted[TAG_WEIGHTS]}
