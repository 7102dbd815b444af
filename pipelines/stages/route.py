"""Plan and route stages: one global BFD plan per L from the histogram (PlanFn), then each
(length, sub-bucket) group's examples to the rows and slots the plan reserved for them,
grouped by (shard index, write window) for the writers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.metrics.metric import Metrics
from apache_beam.pvalue import TaggedOutput

from pipelines.wire.columns import PayloadBatch, ShardWork, concat_wire
from pipelines.faults.failures import ShardCheckError
from pipelines.planning import LengthPlan
from pipelines.stage_shared import FLUSH_EXAMPLES, NAMESPACE, TAG_PLAN, JobContext, StageClock, in_global_window
from prepack.packing.packer import Planner


class PlanFn(beam.DoFn):
    """The global histogram -> one plan per L (--planner: BFD, or the best of BFD and exact fills;
    at most --max-segments-per-row segments per row).

    Main output: each (length_key, b) group's slice of the plan's slots,
    ((length_key, b), (L, rows, positions)), a multimap side input of RouteToRowsFn that a
    worker reads one group's key at a time (Beam's multimap side inputs are fetched per key
    through the state API), so no worker holds more of the plan than its groups' slots.
    Tagged `plan`: (L, the plan without slots), O(groups), the side input every worker gets.
    """

    def __init__(self, max_lengths: tuple[int, ...], pack: bool, num_shards: int | None, target_shard_mb: float,
                 planner: Planner = Planner.BEST, max_segments: int | None = None):
        self.max_lengths = max_lengths
        self.pack = pack
        self.num_shards = num_shards
        self.target_shard_mb = target_shard_mb
        self.planner = planner
        self.max_segments = max_segments

    def process(self, histogram: dict) -> Iterator[Any]:
        from pipelines.planning import LengthPlanner

        for L in self.max_lengths:
            # Streamed: each class's slices go out before the next class is placed, so the
            # planner holds ~8 bytes per row, not the slots of every example (LengthPlanner).
            planner = LengthPlanner(histogram, L, self.pack, self.num_shards, self.target_shard_mb, self.planner,
                                    self.max_segments)
            for key, rows, positions in planner.group_slices():
                yield (key, (L, rows.astype("<i4").tobytes(), positions.astype("<i4").tobytes()))
            yield TaggedOutput(TAG_PLAN, (L, planner.plan().without_slots()))


class RouteToRowsFn(beam.DoFn):
    """((length_key, b), example batches) -> ((shard index, window), ShardWork wire).

    Contract: ranks the group's examples by (hash, example_id), never by arrival order, so
    any number of workers and any bundling give the same rows; the k-th survivor at each max
    length (an example whose PayloadBatch.kept_at bit the fit stage set) gets the k-th slot of
    the group's slice of that L's plan (looked up by the group's key in the `slices` multimap
    side input). Slots in the same write window of shards with the same index share one
    writer, which gets each example's tokens once for all of them, cut to the longest max
    length it serves there.
    """

    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    def setup(self) -> None:
        self.m_routed = Metrics.counter(NAMESPACE, "examples_routed")
        # Examples sent to write windows, one per (example, window) pair: over examples_routed, how
        # often an example's tokens cross the window shuffle (1 to the number of max lengths).
        self.m_copies = Metrics.counter(NAMESPACE, "example_copies_to_windows")
        self.clock = StageClock("route")

    def start_bundle(self) -> None:
        self.buffers: dict[tuple[int, int], list[ShardWork]] = defaultdict(list)
        self.buffered = 0

    def process(self, element: tuple[tuple[int, int], Iterable[tuple]], plans: dict[int, LengthPlan],
                slices: Any = None) -> Iterator[Any]:
        started = StageClock.now()
        (key, b), wires = element
        mine = {}
        if slices is not None:
            for L, rows, positions in slices[(key, b)]:
                mine[L] = (np.frombuffer(rows, "<i4").astype(np.int64), np.frombuffer(positions, "<i4"))
        self._route(key, b, list(wires), mine, plans)
        self.clock.add(StageClock.now() - started)
        if self.buffered >= FLUSH_EXAMPLES:
            yield from self._flush(windowed=False)

    def _route(self, key: int, b: int, wires: list, slices: dict, plans: dict[int, LengthPlan]) -> None:
        """Buffers the group's examples as ShardWork per (shard, window) target."""
        batch = concat_wire(PayloadBatch, wires)
        order = batch.rank_order()
        examples = batch.examples
        sources = None
        if self.ctx.mixture.recorded:  # each segment's source goes into its row (row formats 2 and 4)
            from pipelines.mix_weights import sources_of

            sources = sources_of(batch.example_ids, self.ctx.source_of_input)
        # (shard, window) -> (L, rows, positions, examples, their example_targets at L or None) per part.
        slots: dict[tuple[int, int], list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]] = defaultdict(list)
        for bit, L in enumerate(self.ctx.rows.max_lengths):
            plan = plans[L]
            survivors = order[batch.kept_at_length(bit)[order]]  # the fit stage's decision
            if not len(survivors):
                continue
            if plan.pack:
                rows, positions = slices.get(L, (np.zeros(0, np.int64), np.zeros(0, np.int32)))
                if len(rows) != len(survivors):
                    raise ShardCheckError(f"L={L}: group {(key, b)} has {len(survivors)} examples, its plan slice "
                                          f"{len(rows)} slots")
            else:
                rows, positions = plan.route(key, b, len(survivors))
            # (shard, window) of each slot, as one sortable code; a group's slots are split by it.
            codes = plan.shards_of(rows) << 32 | plan.windows_of(rows)
            by_code = np.argsort(codes, kind="stable")
            unique, starts = np.unique(codes[by_code], return_index=True)
            for code, sel in zip(unique.tolist(), np.split(by_code, starts[1:])):
                totals = None if batch.example_targets is None else batch.example_targets[survivors[sel], bit]
                slots[(code >> 32, code & 0xFFFFFFFF)].append((L, rows[sel], positions[sel], survivors[sel], totals))
        for target, parts in slots.items():
            taken = np.concatenate([p[3] for p in parts])
            lengths = np.concatenate([np.full(len(p[1]), p[0], dtype=np.int32) for p in parts])
            unique, local = np.unique(taken, return_inverse=True)
            # Each example travels cut to the longest max length it serves in this window
            # (under --overlong truncate a long document would otherwise cross whole).
            longest = np.zeros(len(unique), dtype=np.int64)
            np.maximum.at(longest, local, lengths)
            self.buffers[target].append(ShardWork(
                lengths,
                np.concatenate([p[1] for p in parts]),
                np.concatenate([p[2] for p in parts]).astype(np.int32),
                local.astype(np.int32),
                # A pair travels whole: it is cut once, at its own max length (prepack/packing/pairs.py).
                examples.take(unique, cut_to=None if examples.pair_bounds is not None else longest),
                None if sources is None else sources[unique],
                None if batch.example_targets is None else np.concatenate([p[4] for p in parts]),
            ))
            self.buffered += len(taken)
            self.m_copies.inc(len(unique))
        self.m_routed.inc(len(order))

    def _flush(self, windowed: bool) -> Iterator[Any]:
        wrap = in_global_window if windowed else (lambda v: v)
        for target, parts in self.buffers.items():
            yield wrap((target, ShardWork.concat(parts).to_wire()))
        self.buffers = defaultdict(list)
        self.buffered = 0

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._flush(windowed=True)


class PlanAndRoute(beam.PTransform):
    """The route stage as one transform: {"keyed", "hist"} (FitToLengths' outputs) -> {"rows":
    rows keyed by (shard, window), "plans": (L, plan without its slots)}.

    Every worker holds the plans without their slots (O(groups)); each (length, sub-bucket)
    group reads its own slice of the slots from a multimap side input, fetched per key."""

    def __init__(self, ctx: JobContext):
        super().__init__()
        self.ctx = ctx

    def expand(self, fitted: dict[str, Any]) -> dict[str, Any]:
        from apache_beam.pvalue import AsDict, AsMultiMap

        from pipelines.stage_shared import MergeCounters

        config = self.ctx.config
        planned = (
            fitted["hist"]
            | "Histogram" >> beam.CombineGlobally(MergeCounters())
            | "Plan" >> beam.ParDo(PlanFn(config.rows.max_lengths, config.rows.pack, config.rows.num_shards, config.rows.target_shard_mb,
                                          config.rows.planner, config.rows.max_segments_per_row))
            .with_outputs(TAG_PLAN, main="slices")
        )
        rows = (
            fitted["keyed"]
            | "GroupByLength" >> beam.GroupByKey()
            | "RouteToRows" >> beam.ParDo(RouteToRowsFn(self.ctx), plans=AsDict(planned[TAG_PLAN]),
                                          slices=AsMultiMap(planned.slices))
        )
        return {"rows": rows, "plans": planned[TAG_PLAN]}
