"""One packed row: its fields, its on-disk record encoding, and its invariants.

A record is a fixed layout with no header: a C-order int32 little-endian
matrix [len(FIELDS), max_length], one row per field in `FIELD_NAMES` order,
which every manifest records as `field_order` (its `fields` object is
key-sorted JSON, so its order is not the record's). Readers decode by the
manifest's `field_order`. Decoding is one `np.frombuffer` and a reshape, with no copy.
Why int32 everywhere rather than narrow dtypes: under zstd the two are within
5% on disk, and the wide layout decodes 7x faster (docs/row_format.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Mapping

import numpy as np

FORMAT_VERSION = 1
# Mixture sets (prepack/packing/mixture.py) add a sixth field, `source_ids`: each token's mixture source,
# 1..N in the mixture file's order, 0 on padding. Only they are version 2; a set without a
# mixture keeps version 1's bytes and readers read both (docs/row_format.md).
MIXTURE_FORMAT_VERSION = 2
# Sets cut by --overlong split or window add `example_targets` to format 1 (3) or 2 (4): on every
# token of a segment, the target tokens of the example it belongs to, summed over all the
# example's pieces at this max length (a whole example's own count), 0 on padding; the example
# mean weighs each piece by it, so the pieces of one example count as one example wherever they
# land. Only such sets carry it: every other set keeps format 1's or 2's bytes.
SPLIT_FORMAT_VERSION = 3
SPLIT_MIXTURE_FORMAT_VERSION = 4
# Preference sets (format `preference`, prepack/packing/pairs.py) add `pair_side` to format 1 (5) or
# 2 (6): 1 on every token of a pair's chosen side, 2 on its rejected side, 0 on padding. A pair's
# two sides are adjacent segments of one row, chosen first: segments 2k-1 and 2k are pair k.
PAIR_FORMAT_VERSION = 5
PAIR_MIXTURE_FORMAT_VERSION = 6
SUPPORTED_VERSIONS = (FORMAT_VERSION, MIXTURE_FORMAT_VERSION, SPLIT_FORMAT_VERSION, SPLIT_MIXTURE_FORMAT_VERSION,
                      PAIR_FORMAT_VERSION, PAIR_MIXTURE_FORMAT_VERSION)

STORAGE_DTYPE = np.dtype("<i4")
FIELD_NAMES: tuple[str, ...] = ("input_ids", "loss_mask", "valid_mask", "positions", "segment_ids")
MIXTURE_FIELD_NAMES: tuple[str, ...] = FIELD_NAMES + ("source_ids",)
EXAMPLE_TARGETS = "example_targets"
PAIR_SIDE = "pair_side"
CHOSEN, REJECTED = 1, 2  # pair_side values
FIELDS: dict[str, np.dtype] = {name: STORAGE_DTYPE for name in FIELD_NAMES}
_BYTES_PER_TOKEN = STORAGE_DTYPE.itemsize * len(FIELD_NAMES)
# The largest max length a set may have: a row is then 20 MiB, and the packer, the writers and
# every reader hold whole rows (and batches of them) in memory. Beyond it `prepack pack` refuses
# --max-length and readers refuse a manifest (docs/row_format.md).
MAX_MAX_LENGTH = 1 << 20


def has_sources(version: int) -> bool:
    """Whether rows of this format carry `source_ids` (a mixture set's: formats 2, 4 and 6)."""
    return version in (MIXTURE_FORMAT_VERSION, SPLIT_MIXTURE_FORMAT_VERSION, PAIR_MIXTURE_FORMAT_VERSION)


def has_example_targets(version: int) -> bool:
    """Whether rows of this format carry `example_targets` (a split or windowed set's: 3 and 4)."""
    return version in (SPLIT_FORMAT_VERSION, SPLIT_MIXTURE_FORMAT_VERSION)


def has_pairs(version: int) -> bool:
    """Whether rows of this format hold preference pairs and carry `pair_side` (formats 5 and 6)."""
    return version in (PAIR_FORMAT_VERSION, PAIR_MIXTURE_FORMAT_VERSION)


def row_format_version(sources: bool, example_targets: bool, preference: bool = False) -> int:
    """The format of rows with (or without) `source_ids`, `example_targets` and `pair_side` (a
    preference set's rows: its pairs are never cut into pieces, so the two do not go together)."""
    if preference:
        if example_targets:
            raise RowFormatError("preference pairs are never cut into pieces: no format has both pair_side and example_targets")
        return PAIR_MIXTURE_FORMAT_VERSION if sources else PAIR_FORMAT_VERSION
    if example_targets:
        return SPLIT_MIXTURE_FORMAT_VERSION if sources else SPLIT_FORMAT_VERSION
    return MIXTURE_FORMAT_VERSION if sources else FORMAT_VERSION


def field_names(version: int = FORMAT_VERSION) -> tuple[str, ...]:
    """The record's fields, in order, of a row format version."""
    if version not in SUPPORTED_VERSIONS:
        raise RowFormatError(f"row format version {version!r} is not one of {list(SUPPORTED_VERSIONS)}")
    return ((MIXTURE_FIELD_NAMES if has_sources(version) else FIELD_NAMES) + ((EXAMPLE_TARGETS,) if has_example_targets(version) else ())
            + ((PAIR_SIDE,) if has_pairs(version) else ()))


class RowFormatError(ValueError):
    """A record or row that does not follow the row format."""


def record_size(max_length: int, version: int = FORMAT_VERSION) -> int:
    return STORAGE_DTYPE.itemsize * len(field_names(version)) * max_length


def field_spec(version: int = FORMAT_VERSION) -> dict[str, str]:
    """Field name -> dtype string, as written into the manifest."""
    return {name: STORAGE_DTYPE.str for name in field_names(version)}


def encode_row(row: Mapping[str, np.ndarray], max_length: int) -> bytes:
    matrix = np.empty((len(FIELD_NAMES), max_length), dtype=STORAGE_DTYPE)
    for i, name in enumerate(FIELD_NAMES):
        values = np.asarray(row[name])
        if values.shape != (max_length,):
            raise RowFormatError(f"field {name!r} has shape {values.shape}, expected ({max_length},)")
        matrix[i] = values
    return matrix.tobytes()


def _check_size(nbytes: int, max_length: int, fields: int = len(FIELD_NAMES)) -> None:
    expected = STORAGE_DTYPE.itemsize * fields * max_length
    if nbytes != expected:
        raise RowFormatError(f"record has {nbytes} bytes, expected {expected} for max_length {max_length}")


def check_field_order(field_order: Sequence[str], version: int = FORMAT_VERSION) -> None:
    """Raises RowFormatError unless field_order names each field of this format exactly once."""
    names = field_names(version)
    if (not isinstance(field_order, (list, tuple)) or not all(isinstance(name, str) for name in field_order)
            or sorted(field_order) != sorted(names)):
        raise RowFormatError(f"field_order {field_order!r} must list the fields {list(names)} once each, in record order")


def decode_row(record: bytes, max_length: int, field_order: Sequence[str] = FIELD_NAMES) -> dict[str, np.ndarray]:
    """Decodes one record into read-only int32 views of the record's buffer; field_order: the
    manifest's (the record's row order)."""
    _check_size(len(record), max_length, len(field_order))
    matrix = np.frombuffer(record, dtype=STORAGE_DTYPE).reshape(len(field_order), max_length)
    return dict(zip(field_order, matrix))


def decode_rows(records: Sequence[bytes], max_length: int, field_order: Sequence[str] = FIELD_NAMES) -> dict[str, np.ndarray]:
    """Decodes a batch of records into [B, L] int32 arrays (one join, one transpose copy)."""
    for record in records:
        _check_size(len(record), max_length, len(field_order))
    stacked = np.frombuffer(b"".join(records), dtype=STORAGE_DTYPE).reshape(len(records), len(field_order), max_length)
    return {name: np.ascontiguousarray(stacked[:, i]) for i, name in enumerate(field_order)}


@dataclasses.dataclass(frozen=True)
class Segment:
    """One example placed in a row: its tokens and which of them are targets."""

    input_ids: np.ndarray
    loss_mask: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


def build_row(segments: Sequence[Segment], max_length: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Lays segments out left to right and pads the rest.

    The first token of every segment gets loss 0: trainers shift targets over
    the whole row, so that token would otherwise be predicted from the previous
    example's last token.
    """
    total = sum(len(s) for s in segments)
    if total > max_length:
        raise RowFormatError(f"segments hold {total} tokens, more than max_length {max_length}")
    if not segments:
        raise RowFormatError("a row needs at least one segment")
    input_ids = np.full(max_length, pad_id, dtype=np.int32)
    loss_mask = np.zeros(max_length, dtype=np.int32)
    positions = np.zeros(max_length, dtype=np.int32)
    segment_ids = np.zeros(max_length, dtype=np.int32)
    start = 0
    for seg_index, seg in enumerate(segments, start=1):
        n = len(seg)
        if n == 0:
            raise RowFormatError(f"segment {seg_index} is empty")
        end = start + n
        input_ids[start:end] = seg.input_ids
        loss_mask[start:end] = seg.loss_mask
        loss_mask[start] = 0
        positions[start:end] = np.arange(n, dtype=np.int32)
        segment_ids[start:end] = seg_index
        start = end
    valid_mask = (segment_ids != 0).astype(np.int32)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "valid_mask": valid_mask,
        "positions": positions,
        "segment_ids": segment_ids,
    }


@dataclasses.dataclass(frozen=True)
class RowFault:
    """The first broken invariant of a batch of rows: where, and which rule."""

    row: int  # index in the batch
    token: int  # index in the row
    segment: int  # the segment it lies in, counted 1.. from the row's start; 0 on padding
    rule: str


@dataclasses.dataclass(frozen=True)
class RowFacts:
    """What the row rules need to know of a set beyond its rows, from its manifest (or, for the
    trainer, the manifest it checked): the rules are a function of the rows and these alone."""

    version: int  # the row format: which fields the rows carry (field_names)
    vocab_size: int | None = None  # every real token's id lies in 0..vocab_size-1; None: not judged
    pad_id: int | None = None  # every padding token's id; None: not judged
    num_sources: int | None = None  # a mixture set's sources: source ids 1..num_sources; None: any positive

    @classmethod
    def of_fields(cls, names: Sequence[str], **facts: int | None) -> "RowFacts":
        """The facts of rows that carry the fields `names` (their version told by them)."""
        return cls(row_format_version("source_ids" in names, EXAMPLE_TARGETS in names, PAIR_SIDE in names), **facts)


# The rules, in the order a row is judged (the first broken one is reported). One implementation
# of the row format's invariants, vectorised over a [B, L] batch: check_row (one row), `prepack
# verify` (every row of a set) and the trainer (every batch) call row_fault. A rule whose fact is
# not given (vocab_size, pad_id) or whose field the version lacks is not judged.
RULE_FLAGS = "loss_mask and valid_mask must be 0/1"
RULE_VALID = "valid_mask must be 1 exactly where segment_ids != 0"
RULE_PADDING_LAST = "padding must come after every real token"
RULE_EMPTY = "row holds no tokens"
RULE_SEGMENTS = "segment_ids must run 1..k in row order"
RULE_POSITIONS = "positions must count from 0 at every segment start, up by one"
RULE_PAD_POSITIONS = "positions must be 0 on padding"
RULE_PAD_LOSS = "loss_mask must be 0 on padding"
RULE_FIRST_TOKEN = "loss_mask must be 0 on the first token of every segment"
RULE_VOCAB = "input_ids must lie in the vocabulary (0 to vocab_size - 1) on every real token"
RULE_PAD_ID = "input_ids must be the pad id on padding"
RULE_SOURCE_RANGE = "source_ids must be 1..N on every real token and 0 on padding"
RULE_SOURCE_SEGMENT = "source_ids must be the same on every token of a segment"
RULE_TARGETS_SEGMENT = "example_targets must be the same on every token of a segment"
RULE_TARGETS_OWN = "example_targets must be at least the segment's own target tokens (and 1) on every real token, 0 on padding"
RULE_PAIR_SIDE = "pair_side must be 1 on odd segments (a pair's chosen side), 2 on even ones (its rejected side), 0 on padding"
RULE_PAIR_WHOLE = "a row must end with a rejected side: a pair's two sides lie in one row"
RULE_PAIR_PROMPT = "a pair's two sides must start with the same prompt tokens (those before each side's first target)"


# The fields each rule is about: the values a refusal shows at the broken token (fault_values).
RULE_FIELDS: dict[str, tuple[str, ...]] = {
    RULE_FLAGS: ("loss_mask", "valid_mask"), RULE_VALID: ("valid_mask", "segment_ids"),
    RULE_PADDING_LAST: ("valid_mask",), RULE_EMPTY: ("valid_mask",), RULE_SEGMENTS: ("segment_ids",),
    RULE_POSITIONS: ("positions",), RULE_PAD_POSITIONS: ("positions",), RULE_PAD_LOSS: ("loss_mask",),
    RULE_FIRST_TOKEN: ("loss_mask",), RULE_VOCAB: ("input_ids",), RULE_PAD_ID: ("input_ids",),
    RULE_SOURCE_RANGE: ("source_ids",), RULE_SOURCE_SEGMENT: ("source_ids",), RULE_TARGETS_SEGMENT: (EXAMPLE_TARGETS,),
    RULE_TARGETS_OWN: (EXAMPLE_TARGETS,), RULE_PAIR_SIDE: (PAIR_SIDE,), RULE_PAIR_WHOLE: ("segment_ids",),
    RULE_PAIR_PROMPT: ("input_ids",),
}


def fault_values(rows: Mapping[str, np.ndarray], fault: "RowFault") -> dict[str, int]:
    """The values, at the broken token, of the fields the fault's rule is about (a refusal names
    them: token id -5, loss_mask 7)."""
    return {name: int(rows[name][fault.row][fault.token]) for name in RULE_FIELDS.get(fault.rule, ()) if name in rows}


def _shifted(a: np.ndarray) -> np.ndarray:
    """a[:, t - 1] at t, 0 at t = 0."""
    out = np.zeros_like(a)
    out[:, 1:] = a[:, :-1]
    return out


def _rule_masks(rows: Mapping[str, np.ndarray], facts: RowFacts) -> list[tuple[str, np.ndarray]]:
    """(rule, [B, L] bool: True where a token breaks it), in the order rows are judged. int64, so
    that a hostile record's extreme values cannot wrap around in the differences."""
    seg = np.asarray(rows["segment_ids"], dtype=np.int64)
    pos = np.asarray(rows["positions"], dtype=np.int64)
    loss = np.asarray(rows["loss_mask"])
    valid = np.asarray(rows["valid_mask"])
    real = valid == 1
    step = seg - _shifted(seg)
    starts = real & (step == 1)
    prev_real = _shifted(real)
    no_tokens = np.zeros_like(real)
    no_tokens[:, 0] = ~real.any(axis=1)
    masks = [
        (RULE_FLAGS, ((loss != 0) & (loss != 1)) | ((valid != 0) & (valid != 1))),
        (RULE_VALID, real != (seg != 0)),
        (RULE_PADDING_LAST, real & ~prev_real & (np.arange(seg.shape[1]) > 0)),
        (RULE_EMPTY, no_tokens),
        (RULE_SEGMENTS, real & (step != 0) & (step != 1)),
        # A segment's first position must be 0 (a whole segment shifted by one breaks only this),
        # and each next one its predecessor + 1.
        (RULE_POSITIONS, (starts & (pos != 0)) | (real & ~starts & (pos != _shifted(pos) + 1))),
        (RULE_PAD_POSITIONS, ~real & (pos != 0)),
        (RULE_PAD_LOSS, ~real & (loss != 0)),
        (RULE_FIRST_TOKEN, starts & (loss != 0)),
    ]
    if facts.vocab_size is not None or facts.pad_id is not None:
        ids = np.asarray(rows["input_ids"])  # compared only, never subtracted: no int64 copy needed
        if facts.vocab_size is not None:
            masks.append((RULE_VOCAB, real & ((ids < 0) | (ids >= facts.vocab_size))))
        if facts.pad_id is not None:
            masks.append((RULE_PAD_ID, ~real & (ids != facts.pad_id)))
    if has_sources(facts.version):
        src = np.asarray(rows["source_ids"], dtype=np.int64)
        high = np.iinfo(np.int64).max if facts.num_sources is None else facts.num_sources
        masks.append((RULE_SOURCE_RANGE, np.where(real, (src < 1) | (src > high), src != 0)))
        masks.append((RULE_SOURCE_SEGMENT, real & ~starts & (src != _shifted(src))))
    if has_example_targets(facts.version):
        total = np.asarray(rows[EXAMPLE_TARGETS], dtype=np.int64)
        masks.append((RULE_TARGETS_SEGMENT, real & ~starts & (total != _shifted(total))))
        own = _segment_totals(seg, loss)
        masks.append((RULE_TARGETS_OWN, np.where(real, (total < own) | (total < 1), total != 0)))
    if has_pairs(facts.version):
        masks += _pair_masks(rows, seg, pos, loss, real, starts)
    return masks


def _pair_masks(rows: Mapping[str, np.ndarray], seg: np.ndarray, pos: np.ndarray, loss: np.ndarray, real: np.ndarray,
                starts: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The pair rules of formats 5 and 6: sides alternate chosen (odd segments) and rejected (even),
    a row ends with a rejected side, and a rejected side's tokens before its first target are its
    chosen side's, at the same positions, with the first target at the same place."""
    b, length = seg.shape
    side = np.asarray(rows[PAIR_SIDE], dtype=np.int64)
    next_real = np.zeros_like(real)
    next_real[:, :-1] = real[:, 1:]
    masks = [(RULE_PAIR_SIDE, side != np.where(real, 2 - seg % 2, 0)),
             (RULE_PAIR_WHOLE, real & ~next_real & (seg % 2 == 1))]
    column = np.arange(length)
    start_at = np.maximum.accumulate(np.where(starts, column, 0), axis=1)  # each token's segment start
    keys = (np.clip(seg, 0, length) + np.arange(b, dtype=np.int64)[:, None] * (length + 1)).ravel()
    first = np.full(b * (length + 1), length, np.int64)  # each segment's first target's position
    np.minimum.at(first, keys, np.where(real & (loss == 1), np.clip(pos, 0, length), length).ravel())
    first_at = first[keys].reshape(b, length)
    before = np.clip(start_at - 1, 0, length - 1)  # a rejected side's chosen side ends just before it
    chosen_start = np.take_along_axis(start_at, before, axis=1)
    chosen_first = np.take_along_axis(first_at, before, axis=1)
    offset = np.clip(pos, 0, length)
    prompt = real & (seg % 2 == 0) & (offset < np.maximum(first_at, chosen_first))
    partner = np.take_along_axis(np.asarray(rows["input_ids"]), np.clip(chosen_start + offset, 0, length - 1), axis=1)
    masks.append((RULE_PAIR_PROMPT, prompt & ((first_at != chosen_first) | (partner != rows["input_ids"])
                                              | (chosen_start + offset >= start_at))))
    return masks


def _segment_totals(seg: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """[B, L]: the loss_mask sum of the segment each token lies in (a row's ids clipped to
    0..L, so a hostile one cannot index out of range; the segment rules judge those)."""
    b, length = seg.shape
    keys = (np.clip(seg, 0, length) + np.arange(b, dtype=np.int64)[:, None] * (length + 1)).ravel()
    sums = np.bincount(keys, weights=np.asarray(loss, dtype=np.float64).ravel(), minlength=b * (length + 1))
    return sums[keys].reshape(b, length).astype(np.int64)


def row_fault(rows: Mapping[str, np.ndarray], facts: RowFacts) -> RowFault | None:
    """The first broken invariant of a batch of [B, L] rows (the first row with one, its first rule
    in order, that rule's first token), or None when every row holds. Vectorised over the batch;
    `facts`: what the manifest says the rows are (version, vocab_size, pad_id, sources). Raises
    RowFormatError when the rows lack a field of their version (a reader's error, not the data's)."""
    missing = [name for name in field_names(facts.version) if name not in rows]
    if missing:
        raise RowFormatError(f"rows of format {facts.version} lack the field {missing[0]!r}")
    masks = _rule_masks(rows, facts)
    broken = np.stack([m.any(axis=1) for _, m in masks])  # [rules, B]
    bad_rows = np.flatnonzero(broken.any(axis=0))
    if not bad_rows.size:
        return None
    row = int(bad_rows[0])
    rule, mask = masks[int(np.flatnonzero(broken[:, row])[0])]
    token = int(np.flatnonzero(mask[row])[0])
    seg = np.asarray(rows["segment_ids"][row], dtype=np.int64)
    real = np.asarray(rows["valid_mask"][row]) == 1
    starts = real & (np.diff(seg, prepend=0) != 0)
    segment = int(starts[: token + 1].sum()) if real[token] else 0
    return RowFault(row, token, segment, rule)


def row_counts(rows: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per row of a batch that passed row_fault: its segments (its examples: a preference pair's two
    sides count as one), tokens and target tokens."""
    segments = np.asarray(rows["segment_ids"]).max(axis=1)
    return {
        "segments": segments // 2 if PAIR_SIDE in rows else segments,
        "tokens": np.asarray(rows["valid_mask"]).sum(axis=1, dtype=np.int64),
        "target_tokens": np.asarray(rows["loss_mask"]).sum(axis=1, dtype=np.int64),
    }


def check_row(row: Mapping[str, np.ndarray], max_length: int, vocab_size: int | None = None, pad_id: int | None = None) -> None:
    """Raises RowFormatError naming the first broken invariant (row_fault's rules) of one row, of
    the format its fields tell; vocab_size and pad_id, when given, are judged too."""
    names = FIELD_NAMES + tuple(name for name in ("source_ids", EXAMPLE_TARGETS) if name in row)
    for name in names:
        if name not in row:
            raise RowFormatError(f"row lacks field {name!r}")
        if np.shape(row[name]) != (max_length,):
            raise RowFormatError(f"field {name!r} has shape {np.shape(row[name])}, expected ({max_length},)")
    facts = RowFacts.of_fields(names, vocab_size=vocab_size, pad_id=pad_id)
    fault = row_fault({name: np.asarray(row[name])[None] for name in names}, facts)
    if fault is not None:
        raise RowFormatError(f"{fault.rule} (token {fault.token}, segment {fault.segment})")


# ----------------------------------------------------------------------------- many rows at once
# The writer's fast path to the same bytes as build_row + encode_row. build_row lays out one
# row with a few numpy calls per segment; at ~20 segments per 2048-token row that is ~250 µs a
# row, the largest cost of writing a shard after compression. Here a chunk of rows is laid out
# with a handful of whole-array operations, byte-identical to encode_row(build_row(...)) for
# every row (tests/test_pipeline_units.py). One encoder for every version: format 1 for a set
# of one source, 2 (`source_ids`) when the segments carry their mixture source, 3 and 4 when
# they also carry their example's target tokens (`example_targets`, --overlong split or window).

CHUNK_BYTES = 64 << 20  # one chunk's [rows, fields, L] matrix


class RowLayoutError(ValueError):
    """Segments that do not make a valid row (too long, or an empty segment)."""


def encode_rows_flat(
    seg_counts: np.ndarray, lens: np.ndarray, ids: np.ndarray, mask: np.ndarray, max_length: int, pad_id: int = 0,
    sources: np.ndarray | None = None, example_targets: np.ndarray | None = None, pair_sides: np.ndarray | None = None,
) -> Iterator[tuple[bytes, int, int]]:
    """The same from flat arrays: segments per row, tokens per segment, and all segments'
    ids and masks concatenated in row order. `sources`: each segment's mixture source, for
    row format 2's `source_ids` (None: without the field). `example_targets`: each segment's
    example's target tokens over all its pieces, 0 for a whole example (its own count is
    written), for formats 3 and 4 (None: without the field). `pair_sides`: each segment's side
    of its preference pair (CHOSEN, REJECTED), for formats 5 and 6 (None: without the field)."""
    seg_counts = np.asarray(seg_counts, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.int64)
    if len(ids) != len(mask) or int(lens.sum()) != len(ids) or int(seg_counts.sum()) != len(lens):
        raise RowLayoutError("segment lengths, ids and loss mask do not add up")
    if len(seg_counts) and seg_counts.min() == 0:
        raise RowLayoutError("a row needs at least one segment")
    if len(lens) and lens.min() == 0:
        raise RowLayoutError("a segment is empty")
    version = row_format_version(sources is not None, example_targets is not None, pair_sides is not None)
    per_chunk = max(1, CHUNK_BYTES // record_size(max_length, version))
    seg_end = np.cumsum(seg_counts)
    tok_end = np.cumsum(lens)
    for lo in range(0, len(seg_counts), per_chunk):
        hi = min(len(seg_counts), lo + per_chunk)
        s0 = int(seg_end[lo - 1]) if lo else 0
        s1 = int(seg_end[hi - 1])
        t0 = int(tok_end[s0 - 1]) if s0 else 0
        t1 = int(tok_end[s1 - 1]) if s1 else 0
        yield from _encode_chunk(seg_counts[lo:hi], lens[s0:s1], ids[t0:t1], mask[t0:t1], max_length, pad_id,
                                 None if sources is None else sources[s0:s1],
                                 None if example_targets is None else example_targets[s0:s1],
                                 None if pair_sides is None else pair_sides[s0:s1])


def _encode_chunk(
    seg_counts: np.ndarray, lens: np.ndarray, ids: np.ndarray, mask: np.ndarray, max_length: int, pad_id: int,
    sources: np.ndarray | None = None, example_targets: np.ndarray | None = None, pair_sides: np.ndarray | None = None,
) -> Iterator[tuple[bytes, int, int]]:
    n_rows = len(seg_counts)
    first_seg = np.cumsum(seg_counts) - seg_counts  # each row's first segment
    seg_row = np.repeat(np.arange(n_rows), seg_counts)
    seg_pos = np.arange(len(lens)) - first_seg[seg_row]  # segment index within its row
    row_tokens = np.add.reduceat(lens, first_seg) if n_rows else np.zeros(0, np.int64)
    if n_rows and row_tokens.max() > max_length:
        bad = int(np.argmax(row_tokens))
        raise RowLayoutError(f"segments hold {int(row_tokens[bad])} tokens, more than max_length {max_length}")
    starts = np.cumsum(lens) - lens  # each segment's first token in the flat arrays
    seg_col = starts - starts[first_seg][seg_row]  # each segment's first column in its row

    # Real tokens fill a prefix of each row, in row-major order: a boolean mask over
    # [rows, L] places the flat token arrays with one sequential copy per field.
    valid = np.arange(max_length)[None, :] < row_tokens[:, None]
    names = field_names(row_format_version(sources is not None, example_targets is not None, pair_sides is not None))
    planes = {name: i for i, name in enumerate(names)}
    out = np.zeros((n_rows, len(names), max_length), dtype=STORAGE_DTYPE)
    plane = lambda name: out[:, planes[name], :]  # noqa: E731 - a view; assignments write through
    plane("input_ids")[:] = pad_id
    plane("input_ids")[valid] = ids
    plane("loss_mask")[valid] = mask
    out[seg_row, planes["loss_mask"], seg_col] = 0  # build_row's rule: no target on a segment's first token
    plane("valid_mask")[:] = valid
    plane("positions")[valid] = np.arange(len(ids)) - np.repeat(starts, lens)
    plane("segment_ids")[valid] = np.repeat(seg_pos + 1, lens)
    if sources is not None:
        plane("source_ids")[valid] = np.repeat(np.asarray(sources, dtype=np.int64), lens)
    if example_targets is not None:
        given = np.asarray(example_targets, dtype=np.int64)
        own = np.add.reduceat(plane("loss_mask")[valid], starts) if len(lens) else np.zeros(0, np.int64)  # as the row holds them
        plane(EXAMPLE_TARGETS)[valid] = np.repeat(np.where(given > 0, given, own), lens)
    if pair_sides is not None:
        plane(PAIR_SIDE)[valid] = np.repeat(np.asarray(pair_sides, dtype=np.int64), lens)
    targets = plane("loss_mask").sum(axis=1)
    for r in range(n_rows):
        yield out[r].tobytes(), int(row_tokens[r]), int(targets[r])
