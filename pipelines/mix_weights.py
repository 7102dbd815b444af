"""What the fit, mix and route stages share of a mixture (pipelines/stages/mix.py): each example's
source, the unit the share rule samples (Units: an example, or the pieces of one), its rank bucket,
and the kept-weight histogram the fit stage adds to for the mix stage."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator

import numpy as np

from pipelines.planning import stable_hash
from pipelines.stage_shared import JobContext
from pipelines.wire.columns import PayloadBatch
from prepack.packing.mixture import RANK_BITS
from prepack.packing.packer import piece_example_id


def sources_of(example_ids: list[str], source_of_input: tuple[int, ...]) -> np.ndarray:
    """Each example's mixture source (1..N): ids start with `<input index>/` (records.example_id)."""
    return np.fromiter((source_of_input[int(e[:e.index("/")])] for e in example_ids), dtype=np.int32,
                       count=len(example_ids))


@dataclasses.dataclass
class Units:
    """What the share rule samples, per entry of a PayloadBatch: a whole example is its own
    unit; the pieces of an example (--overlong split or window) share their example's.
    `hashes`, `ids`: the unit's rank (its example's stable hash, ties by its id), the same at
    every max length. `weights(bit, L)`: the unit's weight there; `shares(bit, L)`: this entry's
    part of it, summing to it over the unit's entries (a piece's own target tokens, or 1 on the
    unit's lead piece), so sums over entries in any bundling count each unit once."""

    batch: PayloadBatch
    weight_of: str
    hashes: np.ndarray
    ids: list[str]
    pieces: np.ndarray  # bool per entry; a whole example's example_targets are 0 at every L

    @staticmethod
    def of(batch: PayloadBatch, weight_of: str) -> "Units":
        if batch.example_targets is None:
            return Units(batch, weight_of, batch.hashes, batch.example_ids, np.zeros(len(batch.example_ids), bool))
        pieces = (batch.example_targets > 0).any(axis=1)
        hashes, ids = batch.hashes.copy(), list(batch.example_ids)
        for i in np.flatnonzero(pieces).tolist():
            ids[i] = piece_example_id(ids[i])
            hashes[i] = stable_hash(ids[i])
        return Units(batch, weight_of, hashes, ids, pieces)

    def _own(self, max_length: int) -> np.ndarray:
        if self.weight_of == "examples":
            return np.ones(len(self.ids), dtype=np.int64)
        return self.batch.examples.targets_after_first(max_length).astype(np.int64)

    def weights(self, bit: int, max_length: int) -> np.ndarray:
        own = self._own(max_length)
        if self.weight_of == "examples" or not self.pieces.any():
            return own
        return np.where(self.pieces, self.batch.example_targets[:, bit], own)

    def shares(self, bit: int, max_length: int) -> np.ndarray:
        own = self._own(max_length)
        if self.weight_of != "examples" or not self.pieces.any():
            return own
        leads = ((self.batch.leads_at >> np.uint64(bit)) & np.uint64(1)).astype(np.int64)
        return np.where(self.pieces, leads, own)


def rank_buckets(hashes: np.ndarray) -> np.ndarray:
    """The top RANK_BITS bits of each stable hash: bucket order is rank order."""
    return (np.asarray(hashes, np.uint64) >> np.uint64(64 - RANK_BITS)).astype(np.int64)


def weigh_into(hist: Counter, batch: PayloadBatch, ctx: JobContext) -> None:
    """Adds a batch's kept weight to the (L, source, rank bucket) histogram the mix stage decides
    from. Called by the fit stage on the examples it keys (so the payloads are not decoded once
    more for it)."""
    source = sources_of(batch.example_ids, ctx.source_of_input)
    units = Units.of(batch, ctx.mixture.weight_of)
    bucket = rank_buckets(units.hashes)
    for bit, L in enumerate(ctx.rows.max_lengths):
        kept = batch.kept_at_length(bit)
        for s, b, weight in _group_sums(source[kept], bucket[kept], units.shares(bit, L)[kept]):
            hist[(L, s, b)] += weight


def _group_sums(source: np.ndarray, bucket: np.ndarray, weight: np.ndarray) -> Iterator[tuple[int, int, int]]:
    code = source.astype(np.int64) << 32 | bucket
    unique, inverse = np.unique(code, return_inverse=True)
    sums = np.bincount(inverse, weights=weight, minlength=len(unique)) if len(unique) else np.zeros(0)
    for c, total in zip(unique.tolist(), sums.tolist()):
        yield c >> 32, c & 0xFFFFFFFF, int(round(total))
