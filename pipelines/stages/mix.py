"""Mix stage: each source's share of every max length, by the share rule of
prepack/packing/mixture.py, between the fit stage and the plan. Every run goes through it; a
plain run is one source that no set records (Mixture.recorded), written whole and passed through.

The rule needs each source's kept weight at each L before anything is chosen, and then a
rank threshold per (L, source) for the one partial copy, and the few examples past it that
still fit (the partial pick). Exactly, with bounded memory:

    fit stage (pipelines/mix_weights.weigh_into) --> (L, source, rank bucket) -> weight --CombineGlobally--> DecideFn
          (each (L, source)'s whole copies, and the rank bucket where its partial copy ends
           with the weight left for that bucket)
    keyed --CandidatesFn (side input: the decisions)--> (L, source) -> the examples in that
          boundary bucket, and those of later buckets light enough to be picked
          --CombinePerKey(FillCandidates)--> ThresholdFn: the (hash, id) of the first example
          the partial copy leaves out, and the (hash, id) of those it picks after it
    keyed --SampleFn (side inputs: decisions, thresholds)--> each example's copies at each L,
          re-keyed by (length, sub-bucket) for the router, with the (L, length, sub-bucket)
          histogram the plan is made from and the tallies (not_sampled drops, repeats)

Rank buckets are the top RANK_BITS bits of the example's stable hash, so bucket order is rank
order and a boundary bucket holds about 1/4096 of a source's examples: what one worker sorts.
Past the boundary, an example of weight w can be picked only if w <= the fill bound
(prepack.packing.mixture.fill_bound, < L) and only among the first bound // w of its weight
(what is left only shrinks), so FillCandidates keeps at most bound * (1 + ln bound) of them.
Copy k >= 1 of an example is a distinct example, id `<id>@<k>` with its own hash (and so its
own sub-bucket and rank among the examples of its length).

The unit sampled is the example: the pieces an example is cut into at L (--overlong split or
window) rank by their example's hash and id, weigh as their example does (its example_targets,
or 1), and are kept, repeated or left out together, so no example is trained in part
(pipelines/mix_weights.Units). Nothing here depends on bundling
or worker count, so the rows do not either.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.pvalue import TaggedOutput

from pipelines.mix_weights import Units, rank_buckets, sources_of
from pipelines.wire.columns import PayloadBatch
from pipelines.planning import stable_hash, sub_buckets_of
from pipelines.stage_shared import TAG_HIST, TAG_TALLY, JobContext, MergeCounters, StageClock, in_global_window
from prepack.packing.accounting import Tally
from prepack.packing.mixture import budgets, fill_bound, partial_pick
from prepack.packing.packer import DropReason

TAG_BOUNDARY = "boundary"
NO_BOUNDARY = -1


def copy_id(example_id: str, copy: int) -> str:
    """The id of an example's copy-th repeat (copy 0 is the example itself)."""
    return example_id if copy == 0 else f"{example_id}@{copy}"


def decide(hist: dict, max_lengths: tuple[int, ...], weights: list[Fraction], max_repeats: int) -> dict:
    """(L, source) -> (whole copies, boundary bucket or NO_BOUNDARY, the weight the partial copy
    may take from the boundary bucket), from the combined (L, source, bucket) -> weight."""
    by: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)
    for (L, s, b), w in hist.items():
        by[(L, s)][b] = w
    out = {}
    for L in max_lengths:
        kept = [sum(by.get((L, s), {}).values()) for s in range(1, len(weights) + 1)]
        for s, budget in enumerate(budgets(kept, weights, max_repeats), start=1):
            boundary, left = NO_BOUNDARY, Fraction(0)
            if budget.rest > 0:
                before = 0
                for b in sorted(by[(L, s)]):
                    if before + by[(L, s)][b] > budget.rest:
                        boundary, left = b, budget.rest - before
                        break
                    before += by[(L, s)][b]
            out[(L, s)] = (budget.copies, boundary, left)
    return out


class DecideFn(beam.DoFn):
    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    def process(self, hist: dict) -> Iterator[dict]:
        mixture = self.ctx.mixture
        yield decide(hist, self.ctx.rows.max_lengths, mixture.weights, mixture.max_repeats)


BOUNDARY, LATER = 0, 1  # a candidate's kind: in its boundary bucket, or in a later one


class CandidatesFn(beam.DoFn):
    """((L, source), (kind, bound, hash, id, weight)): every example of its (L, source)'s
    boundary bucket, and each example of a later bucket whose weight is within the fill bound."""

    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    def process(self, element: tuple, decisions: dict) -> Iterator[Any]:
        batch = PayloadBatch.from_wire(element[1])
        mixture = self.ctx.mixture
        source = sources_of(batch.example_ids, self.ctx.source_of_input)
        units = Units.of(batch, mixture.weight_of)
        bucket = rank_buckets(units.hashes)
        for bit, L in enumerate(self.ctx.rows.max_lengths):
            table = [(NO_BOUNDARY, -1)] + [(decisions[(L, s)][1], fill_bound(decisions[(L, s)][2], mixture.weight_of, L))
                                           for s in range(1, len(mixture.sources) + 1)]
            boundary, bound = np.array([b for b, _ in table]), np.array([c for _, c in table])
            w = units.weights(bit, L)
            at_boundary = bucket == boundary[source]
            later = (boundary[source] != NO_BOUNDARY) & (bucket > boundary[source]) & (w <= bound[source])
            for i in np.flatnonzero(batch.kept_at_length(bit) & (at_boundary | later)).tolist():
                s = int(source[i])
                yield ((L, s), (BOUNDARY if at_boundary[i] else LATER, int(bound[s]), int(units.hashes[i]),
                                units.ids[i], int(w[i])))


class FillCandidates(beam.CombineFn):
    """Keeps every boundary-bucket example, and of the later ones only the first bound // w of
    each weight w by rank (the only ones the partial pick could take): a set function, so the
    result depends on no bundling or worker count. The pieces of one example come in as the same
    candidate, once each: sets, so it counts once."""

    def create_accumulator(self) -> tuple[set, dict, int]:
        return set(), {}, 0

    def add_input(self, acc: tuple[set, dict, int], element: tuple) -> tuple[set, dict, int]:
        kind, bound, h, example_id, w = element
        boundary, later, _ = acc
        if kind == BOUNDARY:
            boundary.add((h, example_id, w))
        else:
            later.setdefault(w, set()).add((h, example_id))
            if len(later[w]) > 2 * max(1, bound // max(w, 1)):
                later[w] = set(sorted(later[w])[:bound // max(w, 1) if w else None])
        return boundary, later, max(acc[2], bound)

    def merge_accumulators(self, accs: Iterator[tuple[set, dict, int]]) -> tuple[set, dict, int]:
        boundary, later, bound = set(), {}, 0
        for b, l, c in accs:
            boundary |= b
            bound = max(bound, c)
            for w, items in l.items():
                later.setdefault(w, set()).update(items)
        return boundary, {w: set(sorted(items)[:bound // w if w else None]) for w, items in later.items()}, bound

    def extract_output(self, acc: tuple[set, dict, int]) -> list[tuple[int, str, int]]:
        boundary, later, bound = self.merge_accumulators([acc])
        return sorted(boundary | {(h, i, w) for w, items in later.items() for h, i in items})


class ThresholdFn(beam.DoFn):
    """((L, source), its candidates) -> ((L, source), ((hash, id) of the first example the
    partial copy leaves out, sorted (hash, id) of the examples it picks after that one))."""

    def process(self, element: tuple, decisions: dict) -> Iterator[Any]:
        key, candidates = element
        ranked = sorted(candidates)
        taken, _ = partial_pick((w for _, _, w in ranked), decisions[key][2])
        cut = next((at for at, want in enumerate(taken) if at != want), len(taken))
        if cut < len(ranked):
            yield key, (ranked[cut][:2], frozenset(ranked[at][:2] for at in taken[cut:]))


class SampleFn(beam.DoFn):
    """((length, b), PayloadBatch wire) -> the examples' copies at every L, keyed ((length, b'),
    wire); tagged: the (L, length, b') histogram and the tallies, per bundle."""

    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    def setup(self) -> None:
        self.clock = StageClock("mix")

    def start_bundle(self) -> None:
        self.hist: Counter = Counter()
        self.tallies: dict[int, Tally] = {}

    def process(self, element: tuple, decisions: dict, thresholds: dict) -> Iterator[Any]:
        started = StageClock.now()
        (key, _), wire = element
        batch = PayloadBatch.from_wire(wire)
        ctx = self.ctx
        lengths = ctx.rows.max_lengths
        n_sources = len(ctx.mixture.sources)
        source = sources_of(batch.example_ids, ctx.source_of_input)
        copies = np.zeros((len(lengths), len(batch.example_ids)), dtype=np.int64)
        units = Units.of(batch, ctx.mixture.weight_of)
        bucket = rank_buckets(units.hashes)
        for bit, L in enumerate(lengths):
            table = np.array([(0, NO_BOUNDARY)] + [decisions[(L, s)][:2] for s in range(1, n_sources + 1)], dtype=np.int64)
            whole, boundary = table[source, 0], table[source, 1]
            partial = (bucket < boundary).astype(np.int64)
            for i in np.flatnonzero(bucket == boundary).tolist():
                cut, picks = thresholds.get((L, int(source[i])), (None, frozenset()))
                here = (int(units.hashes[i]), units.ids[i])
                partial[i] = cut is None or here < tuple(cut) or here in picks
            self._picked_later(units, source, bucket, boundary, thresholds, L, partial)
            copies[bit] = np.where(batch.kept_at_length(bit), whole + partial, 0)
            self._count(batch, units, source, copies[bit], bit, L)
        yield from self._copies(key, batch, copies)
        self.clock.add(StageClock.now() - started)

    @staticmethod
    def _picked_later(units: Units, source: np.ndarray, bucket: np.ndarray, boundary: np.ndarray,
                      thresholds: dict, L: int, partial: np.ndarray) -> None:
        """Marks the examples past their boundary bucket that the partial pick took (few: their
        hashes are looked up at once, then their ids)."""
        later = (boundary != NO_BOUNDARY) & (bucket > boundary)
        for s in np.unique(source[later]).tolist():
            picks = thresholds.get((L, s), (None, frozenset()))[1]
            if not picks:
                continue
            at = np.flatnonzero(later & (source == s))
            hit = at[np.isin(units.hashes[at], np.array([h for h, _ in picks], dtype=np.uint64))]
            for i in hit.tolist():
                partial[i] = (int(units.hashes[i]), units.ids[i]) in picks

    def _count(self, batch: PayloadBatch, units: Units, source: np.ndarray, copies: np.ndarray, bit: int, L: int) -> None:
        kept = batch.kept_at_length(bit)
        w = units.shares(bit, L)
        tokens = np.minimum(batch.examples.lens.astype(np.int64), L)
        targets = batch.examples.targets_after_first(L).astype(np.int64)
        for s in np.unique(source[kept]).tolist():
            sel = kept & (source == s)
            c = copies[sel]
            tally = self.tallies.setdefault(s, Tally())
            not_sampled = int(np.count_nonzero(c == 0))
            if not_sampled:
                tally.dropped[(L, DropReason.NOT_SAMPLED)] += not_sampled
            tally.repeated[L] += int(np.maximum(c - 1, 0).sum())
            for figure, value in (("kept_weight", int(w[sel].sum())), ("written_weight", int((c * w[sel]).sum())),
                                  ("unique", int(np.count_nonzero(c))), ("written", int(c.sum())),
                                  ("tokens", int((c * tokens[sel]).sum())), ("target_tokens", int((c * targets[sel]).sum()))):
                tally.mix[(L, figure)] += value

    def _copies(self, key: int, batch: PayloadBatch, copies: np.ndarray) -> Iterator[Any]:
        lengths = self.ctx.rows.max_lengths
        bits = (np.uint64(1) << np.arange(len(lengths), dtype=np.uint64))[:, None]
        for k in range(int(copies.max(initial=0))):
            kept_at = np.bitwise_or.reduce(np.where(copies > k, bits, np.uint64(0)), axis=0).astype(np.uint64)
            members = np.flatnonzero(kept_at)
            if not len(members):
                continue
            ids = [copy_id(batch.example_ids[i], k) for i in members.tolist()]
            hashes = (batch.hashes[members] if k == 0
                      else np.fromiter((stable_hash(e) for e in ids), dtype=np.uint64, count=len(ids)))
            subs = sub_buckets_of(hashes, self.ctx.sub_buckets)
            for bit, L in enumerate(lengths):
                at = (kept_at[members] >> np.uint64(bit)) & np.uint64(1) == 1
                for b, count in zip(*np.unique(subs[at], return_counts=True)):
                    self.hist[(L, key, int(b))] += int(count)
            for b in np.unique(subs).tolist():
                sel = np.flatnonzero(subs == b)
                part = batch.take(members[sel], [ids[i] for i in sel.tolist()], hashes[sel], kept_at[members][sel])
                yield ((key, b), part.to_wire())

    def finish_bundle(self) -> Iterator[Any]:
        yield TaggedOutput(TAG_HIST, in_global_window(self.hist))
        tally = Tally()
        for source, part in self.tallies.items():
            tally.merge(part.for_source(source))
        yield TaggedOutput(TAG_TALLY, in_global_window(tally))


class SampleMixture(beam.PTransform):
    """FitToLengths' outputs -> {"keyed": the sampled copies, "hist": their histogram, "tally":
    the fit's tallies and the sampling's}. A plain run's one source is written whole, once: its
    examples, histogram and tallies pass through as they are (no sampling work, the same rows)."""

    def __init__(self, ctx: JobContext):
        super().__init__()
        self.ctx = ctx

    def expand(self, fitted: dict[str, Any]) -> dict[str, Any]:
        if not self.ctx.mixture.recorded:
            return {name: (fitted[name],) | f"Pass{name.title()}" >> beam.Flatten() for name in ("keyed", "hist", "tally")}
        sampled = self._sample(fitted)
        return {"keyed": sampled["keyed"], "hist": sampled["hist"],
                "tally": (fitted["tally"], sampled["tally"]) | "FlattenTally" >> beam.Flatten()}

    def _sample(self, fitted: dict[str, Any]) -> dict[str, Any]:
        from apache_beam.pvalue import AsDict, AsSingleton

        keyed = fitted["keyed"]
        decisions = AsSingleton(
            fitted["weights"]
            | "Weights" >> beam.CombineGlobally(MergeCounters())
            | "Decide" >> beam.ParDo(DecideFn(self.ctx))
        )
        thresholds = AsDict(
            keyed
            | "Candidates" >> beam.ParDo(CandidatesFn(self.ctx), decisions=decisions)
            | "FillCandidates" >> beam.CombinePerKey(FillCandidates())
            | "Threshold" >> beam.ParDo(ThresholdFn(), decisions=decisions)
        )
        sampled = keyed | "Sample" >> beam.ParDo(SampleFn(self.ctx), decisions=decisions, thresholds=thresholds
                                                 ).with_outputs(TAG_HIST, TAG_TALLY, main="keyed")
        return {"keyed": sampled.keyed, "hist": sampled[TAG_HIST], "tally": sampled[TAG_TALLY]}
