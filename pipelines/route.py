"""Route stage: each (length, sub-bucket) group's examples to the rows and slots the global
plan reserved for them, grouped by shard index for the writers."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.metrics.metric import Metrics

from pipelines.columns import PayloadBatch, ShardWork, concat_wire
from pipelines.planning import LengthPlan
from pipelines.stage import FLUSH_EXAMPLES, NAMESPACE, JobContext, StageClock, in_global_window


class RouteToRowsFn(beam.DoFn):
    """((length_key, b), payload batches) -> (shard index, ShardWork wire).

    Contract: ranks the group's examples by (hash, example_id), never by arrival order, so
    any number of workers and any bundling give the same rows; the k-th survivor at each max
    length (an example whose PayloadBatch.kept_at bit the fit stage set) gets the k-th slot the
    global plan reserved for this (length_key, b) group. Slots in shards with the same index
    share one writer, which gets each example's tokens once for all of them, cut to the
    longest max length it serves there.
    """

    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    def setup(self) -> None:
        self.m_routed = Metrics.counter(NAMESPACE, "examples_routed")
        self.clock = StageClock("route")

    def start_bundle(self) -> None:
        self.buffers: dict[int, list[ShardWork]] = defaultdict(list)
        self.buffered = 0

    def process(self, element: tuple[tuple[int, int], Iterable[tuple]], plans: dict[int, LengthPlan]) -> Iterator[Any]:
        started = StageClock.now()
        (key, b), wires = element
        batch = concat_wire(PayloadBatch, wires)
        order = batch.rank_order()
        examples = batch.examples
        slots: dict[int, list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = defaultdict(list)
        for bit, L in enumerate(self.ctx.config.max_lengths):
            plan = plans[L]
            survivors = order[batch.kept_at_length(bit)[order]]  # the fit stage's decision
            if not len(survivors):
                continue
            rows, positions = plan.route(key, b, len(survivors))
            if plan.num_shards == 1:
                slots[0].append((L, rows, positions, survivors))
                continue
            shards = rows % plan.num_shards
            for shard in np.unique(shards).tolist():
                sel = shards == shard
                slots[shard].append((L, rows[sel], positions[sel], survivors[sel]))
        for shard, parts in slots.items():
            taken = np.concatenate([p[3] for p in parts])
            lengths = np.concatenate([np.full(len(p[1]), p[0], dtype=np.int32) for p in parts])
            unique, local = np.unique(taken, return_inverse=True)
            # Each example travels cut to the longest max length it serves in this shard
            # (under --overlong truncate a long document would otherwise cross whole).
            longest = np.zeros(len(unique), dtype=np.int64)
            np.maximum.at(longest, local, lengths)
            self.buffers[shard].append(ShardWork(
                lengths,
                np.concatenate([p[1] for p in parts]),
                np.concatenate([p[2] for p in parts]).astype(np.int32),
                local.astype(np.int32),
                examples.take(unique, cut_to=longest),
            ))
            self.buffered += len(taken)
        self.m_routed.inc(len(order))
        self.clock.add(StageClock.now() - started)
        if self.buffered >= FLUSH_EXAMPLES:
            yield from self._flush(windowed=False)

    def _flush(self, windowed: bool) -> Iterator[Any]:
        wrap = in_global_window if windowed else (lambda v: v)
        for shard, parts in self.buffers.items():
            yield wrap((shard, ShardWork.concat(parts).to_wire()))
        self.buffers = defaultdict(list)
        self.buffered = 0

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._flush(windowed=True)
