"""Columnar batches of examples for the two shuffles that carry token payloads.

A batch of variable-length examples is a handful of flat numpy arrays (lengths,
concatenated ids, concatenated masks, plus one value per example) shipped as a
tuple of bytes. Beam's coders then copy a few buffers instead of encoding one
tuple per example, the local runner (which decodes everything it shuffles)
does almost no work, and routing and writing become array operations.

- TokenizedBatch: (hash, example_id, source, ids, mask) per example, from the tokenizer to
  FitAndKeyFn (same stage, never encoded).
- PayloadBatch: (hash, example_id, ids, mask) per example, and under --overlong split or window
  its example's target tokens at each max length; GroupByKey((length, sub-bucket)).
- ShardWork: each example's tokens once (cut to the longest L it serves there), plus
  (L, row, position) for every slot it takes in a shard with that index, for any L;
  GroupByKey(shard index). An example whose rows fall in shards of the same index at several
  max lengths crosses the shuffle once, not once per L (always, when every L has one shard),
  and never carries more tokens than the slots it serves. The price: one writer writes that
  shard of every L in turn, and holds its tokens while it does.
- FragmentBatch: (row, position, ids, mask) per slot of one L: what the writer builds rows from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from prepack.packing.packer import targets_after_first
from prepack.packing.pairs import cut_index as pair_cut_index
from prepack.packing.pairs import targets_after_first as pair_targets
from prepack.format.tokenwire import IDS, MASK, ids_from_wire, ids_to_wire, mask_from_wire, mask_to_wire

LENS = np.dtype("<i4")


def ragged_index(lens: np.ndarray, take: np.ndarray, new_lens: np.ndarray | None = None) -> np.ndarray:
    """Flat positions of the tokens of examples `take` (in that order), each cut to new_lens
    when given: one index serves every per-token array of the batch."""
    starts = np.cumsum(lens, dtype=np.int64) - lens
    out_lens = lens[take] if new_lens is None else new_lens
    if not len(take):
        return np.zeros(0, dtype=np.int64)
    out_starts = np.cumsum(out_lens, dtype=np.int64) - out_lens
    return np.repeat(starts[take] - out_starts, out_lens) + np.arange(int(out_lens.sum()), dtype=np.int64)


@dataclasses.dataclass
class Ragged:
    """Variable-length examples: lengths, concatenated ids and masks; in a preference set each
    example is a pair, its chosen side then its rejected side, and `pair_bounds` holds each one's
    (prompt, split) (prepack/packing/pairs.py: cuts and targets follow the pair rule there)."""

    lens: np.ndarray
    ids: np.ndarray
    mask: np.ndarray
    pair_bounds: np.ndarray | None = None  # int32 [examples, 2]: (prompt tokens, chosen side's tokens); None: not a preference set

    def targets_after_first(self, end: int | None = None) -> np.ndarray:
        """prepack.packing.packer.targets_after_first of these examples (of a pair: both sides', 0 unless both train)."""
        if self.pair_bounds is not None:
            return pair_targets(self.lens, self.mask, self.pair_bounds, end)
        return targets_after_first(self.lens, self.mask, end)

    def take(self, index: np.ndarray, cut_to: int | np.ndarray | None = None) -> "Ragged":
        """Examples `index`, each cut to `cut_to` (a prefix; a pair by the pair rule) when given."""
        index = np.asarray(index, dtype=np.int64)
        if self.pair_bounds is not None:
            flat, new_lens, bounds = pair_cut_index(self.lens, self.pair_bounds, index, cut_to)
            return Ragged(new_lens.astype(LENS), self.ids[flat], self.mask[flat], bounds.astype(np.int32))
        new_lens = None if cut_to is None else np.minimum(self.lens[index], cut_to).astype(LENS)
        flat = ragged_index(self.lens, index, new_lens)
        return Ragged(self.lens[index] if new_lens is None else new_lens, self.ids[flat], self.mask[flat])

    def slice(self, a: int, b: int) -> "Ragged":
        """Examples a..b-1, as views."""
        tokens = np.cumsum(self.lens, dtype=np.int64)
        t0, t1 = (int(tokens[a - 1]) if a else 0), (int(tokens[b - 1]) if b else 0)
        return Ragged(self.lens[a:b], self.ids[t0:t1], self.mask[t0:t1], None if self.pair_bounds is None else self.pair_bounds[a:b])

    @staticmethod
    def concat(parts: Sequence["Ragged"]) -> "Ragged":
        return Ragged(
            np.concatenate([p.lens for p in parts]) if parts else np.zeros(0, LENS),
            np.concatenate([p.ids for p in parts]) if parts else np.zeros(0, IDS),
            np.concatenate([p.mask for p in parts]) if parts else np.zeros(0, MASK),
            np.concatenate([p.pair_bounds for p in parts]) if parts and parts[0].pair_bounds is not None else None,
        )

    def pair_bounds_to_wire(self) -> tuple[bytes, ...]:
        """() outside a preference set, so the wire of every other set is what it was."""
        return () if self.pair_bounds is None else (self.pair_bounds.astype("<i4").tobytes(),)

    @staticmethod
    def pair_bounds_from_wire(data: bytes | None) -> np.ndarray | None:
        return None if data is None else np.frombuffer(data, "<i4").reshape(-1, 2)


# Token payloads on the wire: ids in 3 bytes, masks in bits (prepack.format.tokenwire); the local
# runner's data plane costs CPU per byte shuffled (~20 ms per MB), and ids + mask are most of the bytes.


def _strings_to_bytes(strings: Sequence[str]) -> tuple[bytes, bytes]:
    encoded = [s.encode("utf-8") for s in strings]
    return np.fromiter((len(e) for e in encoded), dtype=LENS, count=len(encoded)).tobytes(), b"".join(encoded)


def _bytes_to_strings(lens_bytes: bytes, data: bytes) -> list[str]:
    lens = np.frombuffer(lens_bytes, LENS)
    ends = np.cumsum(lens, dtype=np.int64).tolist()
    starts = [0] + ends[:-1]
    return [data[a:b].decode("utf-8") for a, b in zip(starts, ends)]


@dataclasses.dataclass
class TokenizedBatch:
    """Examples as the tokenizer made them, with where they came from: PrepareFn's output and
    FitAndKeyFn's input. The two are fused in one stage, so this batch is never encoded."""

    hashes: np.ndarray  # uint64, stable_hash(example_id)
    example_ids: list[str]
    locs: list[tuple[int, int, int, int]]
    examples: Ragged

    def __len__(self) -> int:
        return len(self.example_ids)

    def take(self, index: np.ndarray) -> "TokenizedBatch":
        index = np.asarray(index, dtype=np.int64)
        rows = index.tolist()
        return TokenizedBatch(self.hashes[index], [self.example_ids[i] for i in rows], [self.locs[i] for i in rows],
                              self.examples.take(index))

    @staticmethod
    def concat(parts: Sequence["TokenizedBatch"]) -> "TokenizedBatch":
        return TokenizedBatch(
            np.concatenate([p.hashes for p in parts]) if parts else np.zeros(0, np.uint64),
            [eid for p in parts for eid in p.example_ids],
            [loc for p in parts for loc in p.locs],
            Ragged.concat([p.examples for p in parts]),
        )

    def grouped_payloads(self, keys: np.ndarray, kept_at: np.ndarray, example_targets: np.ndarray | None = None,
                         leads_at: np.ndarray | None = None) -> Iterator[tuple[int, "PayloadBatch"]]:
        """(key, payloads of the examples with that key) for each distinct key, in key order;
        keys[i], kept_at[i], example_targets[i] and leads_at[i] (see PayloadBatch) are example
        i's. One gather for the whole batch, then slices."""
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        kept_at = np.asarray(kept_at, dtype=np.uint64)[order]
        totals = None if example_targets is None else example_targets[order]
        leads = None if leads_at is None else np.asarray(leads_at, dtype=np.uint64)[order]
        examples = self.examples.take(order)
        hashes = self.hashes[order]
        eids = self.example_ids
        example_ids = [eids[i] for i in order.tolist()]
        bounds = np.flatnonzero(np.diff(keys)) + 1
        starts = [0, *bounds.tolist()]
        ends = [*bounds.tolist(), len(keys)]
        for a, b in zip(starts, ends):
            if a == b:
                continue
            yield int(keys[a]), PayloadBatch(hashes[a:b], example_ids[a:b], examples.slice(a, b),
                                             kept_at[a:b], None if totals is None else totals[a:b],
                                             None if leads is None else leads[a:b])

    def targets_after_first(self, end: int | None = None) -> np.ndarray:
        return self.examples.targets_after_first(end)


@dataclasses.dataclass
class PayloadBatch:
    """Kept examples of one (length, sub-bucket) group on their way to the router, each with
    the fit stage's decision: bit i of kept_at[j] is set when example j is kept (whole or
    truncated) at the i-th max length, so the router never re-derives it."""

    hashes: np.ndarray  # uint64
    example_ids: list[str]
    examples: Ragged
    kept_at: np.ndarray  # uint64 bit set, one bit per max length in order (at most 64)
    # --overlong split or window: int32 [examples, max lengths], a piece's example's target tokens
    # summed over its pieces at each max length (row format 3's example_targets), 0 for a whole
    # example (the writer then writes its own count); None under the other policies.
    example_targets: np.ndarray | None = None
    # A mixture's sets with example_targets, from the fit stage to the mix stage only: uint64 bit
    # set like kept_at, bit i set on the one entry that stands for its example at the i-th max
    # length (a whole example: its kept_at; of an example's pieces there, the first), so the mix
    # stage counts an example cut into pieces once (pipelines/stages/mix.py).
    leads_at: np.ndarray | None = None

    def to_wire(self) -> tuple[Any, ...]:
        id_lens, id_data = _strings_to_bytes(self.example_ids)
        e = self.examples
        wire: tuple[Any, ...] = (self.hashes.astype("<u8").tobytes(), id_lens, id_data, e.lens.tobytes(), ids_to_wire(e.ids),
                                 mask_to_wire(e.mask), self.kept_at.astype("<u8").tobytes())
        if e.pair_bounds is not None:  # a preference set (no pieces: split and window cut no pairs)
            return wire + (None, None, None, *e.pair_bounds_to_wire())
        if self.example_targets is None:
            return wire
        wire += (self.example_targets.shape[1], self.example_targets.astype("<i4").tobytes())
        return wire if self.leads_at is None else wire + (self.leads_at.astype("<u8").tobytes(),)

    @staticmethod
    def from_wire(wire: tuple[Any, ...]) -> "PayloadBatch":
        hashes, id_lens, id_data, lens, ids, mask, kept_at = wire[:7]
        pair_bounds = Ragged.pair_bounds_from_wire(wire[10]) if len(wire) == 11 else None
        totals = None if len(wire) == 7 or wire[7] is None else np.frombuffer(wire[8], "<i4").reshape(-1, wire[7])
        leads = np.frombuffer(wire[9], "<u8") if len(wire) >= 10 and wire[9] is not None else None
        return PayloadBatch(np.frombuffer(hashes, "<u8"), _bytes_to_strings(id_lens, id_data),
                            Ragged(np.frombuffer(lens, LENS), ids_from_wire(ids), mask_from_wire(mask), pair_bounds),
                            np.frombuffer(kept_at, "<u8"), totals, leads)

    @staticmethod
    def concat(parts: Sequence["PayloadBatch"]) -> "PayloadBatch":
        return PayloadBatch(
            np.concatenate([p.hashes for p in parts]) if parts else np.zeros(0, np.uint64),
            [eid for p in parts for eid in p.example_ids],
            Ragged.concat([p.examples for p in parts]),
            np.concatenate([p.kept_at for p in parts]) if parts else np.zeros(0, np.uint64),
            np.concatenate([p.example_targets for p in parts]) if parts and parts[0].example_targets is not None else None,
            np.concatenate([p.leads_at for p in parts]) if parts and parts[0].leads_at is not None else None,
        )

    def take(self, index: np.ndarray, example_ids: list[str] | None = None, hashes: np.ndarray | None = None,
             kept_at: np.ndarray | None = None) -> "PayloadBatch":
        """Examples `index`, under other ids, hashes and kept_at when given (a mixture's copies),
        without leads_at: the mix stage's copies are past its use."""
        index = np.asarray(index, dtype=np.int64)
        return PayloadBatch(self.hashes[index] if hashes is None else hashes,
                            [self.example_ids[i] for i in index.tolist()] if example_ids is None else example_ids,
                            self.examples.take(index), self.kept_at[index] if kept_at is None else kept_at,
                            None if self.example_targets is None else self.example_targets[index])

    def kept_at_length(self, index: int) -> np.ndarray:
        """Per example: kept at the index-th max length."""
        return (self.kept_at >> np.uint64(index)) & np.uint64(1) == 1

    def rank_order(self) -> np.ndarray:
        """Indices in (hash, example_id) order: the order that decides who gets which slot."""
        order = np.argsort(self.hashes, kind="stable")
        h = self.hashes[order]
        if len(h) > 1 and (h[1:] == h[:-1]).any():  # equal 64-bit hashes: practically never
            return np.asarray(sorted(range(len(h)), key=lambda i: (int(self.hashes[i]), self.example_ids[i])), dtype=np.int64)
        return order


@dataclasses.dataclass
class FragmentBatch:
    """The slots of one max length in one shard: what the writer lays rows out from."""

    rows: np.ndarray  # int64
    positions: np.ndarray  # int32
    examples: Ragged
    sources: np.ndarray | None = None  # int32 per slot: a mixture's source (1..N); None without one
    example_targets: np.ndarray | None = None  # int32 per slot (PayloadBatch's at this L); None: not split/window


@dataclasses.dataclass
class ShardWork:
    lengths: np.ndarray  # int32: the max length of each slot
    rows: np.ndarray  # int64
    positions: np.ndarray  # int32
    example: np.ndarray  # int32: the slot's example, an index into `examples`
    examples: Ragged  # whole (not cut to any L)
    sources: np.ndarray | None = None  # int32 per example: a mixture's source (1..N); None without one
    example_targets: np.ndarray | None = None  # int32 per slot: its example's target tokens at the slot's L

    def to_wire(self) -> tuple[Any, ...]:
        e = self.examples
        wire = (self.lengths.astype("<i4").tobytes(), self.rows.astype("<i8").tobytes(),
                self.positions.astype("<i4").tobytes(), self.example.astype("<i4").tobytes(), e.lens.tobytes(),
                ids_to_wire(e.ids), mask_to_wire(e.mask))
        sources = None if self.sources is None else self.sources.astype("<i4").tobytes()
        if e.pair_bounds is not None:  # a preference set: no example_targets
            return wire + (sources, None, *e.pair_bounds_to_wire())
        if self.example_targets is None:  # the wire of every set without the field, as before
            return wire if sources is None else wire + (sources,)
        return wire + (sources, self.example_targets.astype("<i4").tobytes())

    @staticmethod
    def from_wire(wire: tuple[Any, ...]) -> "ShardWork":
        lengths, rows, positions, example, lens, ids, mask = wire[:7]
        sources = wire[7] if len(wire) > 7 else None
        totals = wire[8] if len(wire) > 8 else None
        pair_bounds = Ragged.pair_bounds_from_wire(wire[9]) if len(wire) > 9 else None
        return ShardWork(np.frombuffer(lengths, "<i4"), np.frombuffer(rows, "<i8"), np.frombuffer(positions, "<i4"),
                         np.frombuffer(example, "<i4"),
                         Ragged(np.frombuffer(lens, LENS), ids_from_wire(ids), mask_from_wire(mask), pair_bounds),
                         None if sources is None else np.frombuffer(sources, "<i4"),
                         None if totals is None else np.frombuffer(totals, "<i4"))

    @staticmethod
    def concat(parts: Sequence["ShardWork"]) -> "ShardWork":
        if not parts:
            empty = np.zeros(0, np.int32)
            return ShardWork(empty, np.zeros(0, np.int64), empty, empty, Ragged(np.zeros(0, LENS), np.zeros(0, IDS), np.zeros(0, MASK)))
        offsets = np.cumsum([0] + [len(p.examples.lens) for p in parts[:-1]])
        return ShardWork(
            np.concatenate([p.lengths for p in parts]),
            np.concatenate([p.rows for p in parts]),
            np.concatenate([p.positions for p in parts]),
            np.concatenate([p.example.astype(np.int64) + off for p, off in zip(parts, offsets.tolist())]).astype(np.int32),
            Ragged.concat([p.examples for p in parts]),
            np.concatenate([p.sources for p in parts]) if parts[0].sources is not None else None,
            np.concatenate([p.example_targets for p in parts]) if parts[0].example_targets is not None else None,
        )

    def max_lengths(self) -> list[int]:
        return sorted(set(self.lengths.tolist()))

    def fragments(self, max_length: int) -> FragmentBatch:
        """The slots of one max length, each example cut to it (under --overlong truncate)."""
        sel = self.lengths == max_length
        return FragmentBatch(self.rows[sel], self.positions[sel], self.examples.take(self.example[sel], cut_to=max_length),
                             None if self.sources is None else self.sources[self.example[sel]],
                             None if self.example_targets is None else self.example_targets[sel])


def concat_wire(kind: type, wires: Iterable[tuple[bytes, ...]]):
    return kind.concat([kind.from_wire(w) for w in wires])
