"""The tokenized set: the examples a `prepack pack` run tokenized, kept so that new max
lengths can be packed later without the inputs or the tokenizer (`--from-tokens`).

A tokenized set is a folder (OUTPUT/tokens/) with ArrayRecord files of one record per
kept example, `dropped-<sha>.jsonl` (the examples dropped before fitting, for the dead letters
of later runs) and `manifest.json`, written last. No Beam, no JAX: the job writes and
reads it through pipelines/stages/tokens_sink.py and tokens_source.py (the launcher's side: pipelines/launch/token_set.py), `prepack inspect` reads it.

Record (little-endian), docs/row_format.md "Tokenized set":

    u8 version | u32 tokens n | i32 task | i64 record | i64 line | i32 sub | u16 id bytes
    | example id (utf-8) | ids (prepack.format.tokenwire, 1 + 3n bytes) | mask (tokenwire, 9 + ceil(n/8))
    [version 2, a preference pair: | i32 prompt | i32 split (prepack/packing/pairs.py)]

(task, record, line, sub) is where the example came from, as the job numbers it
(pipelines/records.Loc); the manifest's `job.tasks` names the files.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from prepack.format import tokenwire
from prepack.format.layout import TOKENS_DIR  # noqa: F401  (defined once, in the layout; others import it from here)
from prepack.format.manifest import MANIFEST_NAME, ShardInfo
from prepack.hostile_input import untrusted

TOKENS_FORMAT_VERSION = 1
TOKENS_KIND = "tokens"
# Records are read in order, never one at a time: groups of 256 compress far better than one.
TOKENS_WRITER_OPTIONS = "group_size:256,zstd:3"

_RECORD_VERSION = 1
_PAIR_RECORD_VERSION = 2  # a preference pair's record: version 1's, then its bounds (prompt, split)
_HEAD = struct.Struct("<BIiqqiH")
_BOUNDS = struct.Struct("<ii")
# What decides the tokens: a run that changes any of these must tokenize again.
TOKEN_CHOICES = ("inputs", "format", "template_options", "chat_format", "tokenizer", "train_reasoning", "expand_turns")


# Choices recorded only when not the default, so sets made before them read as the default.
_CHOICE_DEFAULTS = {"train_reasoning": "yes", "expand_turns": False}


class TokenSetError(ValueError):
    """A tokenized set that is missing, of another version, damaged, or does not fit the run."""


def shard_name(digest: str) -> str:
    """Named by content: the files of a run's bundles need no coordination to be unique, and a
    new set never overwrites an old set's file of other content while it is published."""
    return f"tokens-{digest[:16]}.array_record"


def dropped_name(digest: str) -> str:
    return f"dropped-{digest[:16]}.jsonl"


def is_set_file(name: str) -> bool:
    return (name.startswith("tokens-") and name.endswith(".array_record")) or (name.startswith("dropped-") and name.endswith(".jsonl"))


# ----------------------------------------------------------------------------- records


def encode_example(example_id: str, loc: Sequence[int], ids: np.ndarray, mask: np.ndarray,
                   pair: Sequence[int] | None = None) -> bytes:
    """One example's record (the reference; encode_batch writes the same bytes faster); `pair`:
    a preference pair's (prompt, split)."""
    eid = example_id.encode("utf-8")
    task, record, line, sub = (int(v) for v in loc)
    version = _RECORD_VERSION if pair is None else _PAIR_RECORD_VERSION
    tail = b"" if pair is None else _BOUNDS.pack(int(pair[0]), int(pair[1]))
    return b"".join((_HEAD.pack(version, len(ids), task, record, line, sub, len(eid)), eid,
                     tokenwire.ids_to_wire(ids), tokenwire.mask_to_wire(mask), tail))


def encode_batch(example_ids: Sequence[str], locs: Sequence[Sequence[int]], lens: np.ndarray,
                 ids: np.ndarray, mask: np.ndarray, pair_bounds: np.ndarray | None = None) -> list[bytes]:
    """The records of a batch of examples (flat ids/mask, lens per example), with one ids and
    one mask encoding for the whole batch: each record is encode_example's bytes when the
    batch's ids fit 24 bits and its mask is 0/1, and a valid record either way. `pair_bounds`: a
    preference set's [examples, 2] bounds (records of version 2)."""
    lens = np.asarray(lens, dtype=np.int64)
    if not len(lens):
        return []
    ids_wire = tokenwire.ids_to_wire(ids)
    ids_tag, id_width = ids_wire[:1], (3 if ids_wire[:1] == tokenwire.IDS_24 else 4)
    ends = np.cumsum(lens)
    starts = ends - lens
    mask = np.asarray(mask, dtype=tokenwire.MASK)
    if mask.size and int(mask.max()) > 1:
        mask_parts = [tokenwire.MASK_BYTES + mask[a:b].tobytes() for a, b in zip(starts.tolist(), ends.tolist())]
    else:
        # Each record's mask bits start on a byte: spread the mask over per-example byte-aligned
        # slots, pack once, and slice.
        padded = (lens + 7) // 8 * 8
        pad_starts = np.cumsum(padded) - padded
        spread = np.zeros(int(padded.sum()), dtype=tokenwire.MASK)
        spread[np.repeat(pad_starts - starts, lens) + np.arange(int(ends[-1]))] = mask
        bits = np.packbits(spread).tobytes()
        byte_starts, byte_ends = (pad_starts // 8).tolist(), ((pad_starts + padded) // 8).tolist()
        mask_parts = [tokenwire.MASK_BITS + n.to_bytes(tokenwire.MASK_COUNT_BYTES, "little") + bits[a:b]
                      for n, a, b in zip(lens.tolist(), byte_starts, byte_ends)]
    body = ids_wire[1:]
    pack = _HEAD.pack
    version = _RECORD_VERSION if pair_bounds is None else _PAIR_RECORD_VERSION
    tails = [b""] * len(lens) if pair_bounds is None else [_BOUNDS.pack(int(p), int(q)) for p, q in np.asarray(pair_bounds).tolist()]
    out = []
    for eid, loc, n, a, m, tail in zip(example_ids, locs, lens.tolist(), starts.tolist(), mask_parts, tails):
        e = eid.encode("utf-8")
        out.append(b"".join((pack(version, n, loc[0], loc[1], loc[2], loc[3], len(e)), e, ids_tag,
                             body[a * id_width : (a + n) * id_width], m, tail)))
    return out


@dataclasses.dataclass
class DecodedExamples:
    """A batch of examples as flat arrays: what the job's fit step takes."""

    example_ids: list[str]
    locs: list[tuple[int, int, int, int]]
    lens: np.ndarray  # int32
    ids: np.ndarray  # int32, all examples' ids back to back
    mask: np.ndarray  # uint8
    pair_bounds: np.ndarray | None = None  # int32 [examples, 2]: a preference set's (prompt, split); None: not a preference set


def decode_example(record: bytes) -> tuple[str, tuple[int, int, int, int], np.ndarray, np.ndarray, tuple[int, int] | None]:
    """(example id, loc, ids, mask, a pair's (prompt, split) or None) of one record; raises
    TokenSetError on a damaged record. Every length in the record is checked against its size
    before anything is decoded."""
    if len(record) < _HEAD.size or record[0] not in (_RECORD_VERSION, _PAIR_RECORD_VERSION):
        raise TokenSetError(f"not a tokenized-set record of version {_RECORD_VERSION} or {_PAIR_RECORD_VERSION}")
    pair = None
    if record[0] == _PAIR_RECORD_VERSION:
        if len(record) < _HEAD.size + _BOUNDS.size:
            raise TokenSetError("a pair's record is damaged: too short for its bounds")
        pair = _BOUNDS.unpack_from(record, len(record) - _BOUNDS.size)
        record = record[: len(record) - _BOUNDS.size]
    _, n, task, rec, line, sub, id_len = _HEAD.unpack_from(record)
    at = _HEAD.size + id_len
    try:
        eid = record[_HEAD.size : at].decode("utf-8")
    except UnicodeDecodeError:
        raise TokenSetError("record is damaged: its example id is not UTF-8") from None
    ids_tag = record[at : at + 1]
    ids_end = at + tokenwire.ids_wire_size(ids_tag, n)
    mask_tag = record[ids_end : ids_end + 1]
    mask_end = ids_end + tokenwire.mask_wire_size(mask_tag, n)
    counted = int.from_bytes(record[ids_end + 1 : ids_end + 1 + tokenwire.MASK_COUNT_BYTES], "little")
    if ids_tag not in (tokenwire.IDS_24, tokenwire.IDS_32) or mask_tag not in (tokenwire.MASK_BITS, tokenwire.MASK_BYTES) \
            or mask_end != len(record) or (mask_tag == tokenwire.MASK_BITS and counted != n):
        raise TokenSetError(f"record of {eid!r} is damaged: {n} tokens declared, but its {len(record)} bytes do not hold them")
    ids = tokenwire.ids_from_wire(record[at:ids_end])
    mask = tokenwire.mask_from_wire(record[ids_end:mask_end])
    return eid, (task, rec, line, sub), ids, mask, pair


def check_examples(decoded: "DecodedExamples", vocab_size: int, num_tasks: int, where: str) -> None:
    """Raises TokenSetError (naming `where` and the example) unless every example of a batch is
    one the job could have written: ids within the vocabulary, a 0/1 mask, a source task that
    exists. The records of a tokenized set are read from storage others can write."""
    bad = None
    if decoded.ids.size and (int(decoded.ids.min()) < 0 or int(decoded.ids.max()) >= vocab_size):
        flat = np.flatnonzero((decoded.ids < 0) | (decoded.ids >= vocab_size))[0]
        bad = (int(np.searchsorted(np.cumsum(decoded.lens), flat, side="right")),
               f"token id {int(decoded.ids[flat])} is outside the vocabulary (vocab_size {vocab_size:,})")
    elif decoded.mask.size and int(decoded.mask.max()) > 1:
        flat = int(np.flatnonzero(decoded.mask > 1)[0])
        bad = (int(np.searchsorted(np.cumsum(decoded.lens), flat, side="right")), "its loss mask is not 0/1")
    elif decoded.pair_bounds is not None and len(decoded.pair_bounds) and not (
            (decoded.pair_bounds[:, 0] >= 1) & (decoded.pair_bounds[:, 0] < decoded.pair_bounds[:, 1])
            & (2 * decoded.pair_bounds[:, 1] - decoded.pair_bounds[:, 0] <= decoded.lens)).all():
        k = int(np.flatnonzero(~((decoded.pair_bounds[:, 0] >= 1) & (decoded.pair_bounds[:, 0] < decoded.pair_bounds[:, 1])
                                 & (2 * decoded.pair_bounds[:, 1] - decoded.pair_bounds[:, 0] <= decoded.lens)))[0])
        bad = (k, f"its pair bounds {tuple(decoded.pair_bounds[k].tolist())} do not fit its {int(decoded.lens[k])} tokens")
    else:
        for k, loc in enumerate(decoded.locs):
            if not 0 <= loc[0] < num_tasks or min(loc[1:]) < 0:
                bad = (k, f"its source {tuple(loc)} names no task of the set's {num_tasks}")
                break
    if bad is not None:
        k, why = bad
        raise TokenSetError(f"{where}: example {decoded.example_ids[k]!r} is damaged: {why}")


def decode_batch(records: Sequence[bytes]) -> DecodedExamples:
    """Many records at once: headers one by one, ids and masks with a few array operations
    when every record has 24-bit ids and a bit mask (what encode_batch writes), else
    record by record. Raises TokenSetError for a damaged record, whatever its bytes."""
    try:
        return _decode_batch(records)
    except TokenSetError:
        raise
    except (struct.error, UnicodeDecodeError, ValueError, IndexError) as e:  # lengths that do not fit the bytes
        raise TokenSetError(f"a record is damaged ({type(e).__name__}: {e})") from None


def _decode_batch(records: Sequence[bytes]) -> DecodedExamples:
    if records and records[0][:1] == bytes([_PAIR_RECORD_VERSION]):  # a preference set: every record a pair
        decoded = [decode_example(r) for r in records]
        if any(d[4] is None for d in decoded):
            raise TokenSetError("a tokenized set mixes pair records with single examples")
        return DecodedExamples([d[0] for d in decoded], [d[1] for d in decoded],
                               np.asarray([len(d[2]) for d in decoded], dtype=np.int32), np.concatenate([d[2] for d in decoded]),
                               np.concatenate([d[3] for d in decoded]), np.asarray([d[4] for d in decoded], dtype=np.int32))
    heads = [_HEAD.unpack_from(r) for r in records]
    if any(h[0] != _RECORD_VERSION for h in heads):
        raise TokenSetError(f"not a tokenized-set record of version {_RECORD_VERSION}")
    lens = np.fromiter((h[1] for h in heads), dtype=np.int64, count=len(heads))
    id_lens = np.fromiter((h[6] for h in heads), dtype=np.int64, count=len(heads))
    ids_at = _HEAD.size + id_lens
    mask_at = ids_at + 1 + 3 * lens
    mask_bytes = (lens + 7) // 8
    sizes = np.fromiter(map(len, records), dtype=np.int64, count=len(records))
    common = bool(len(records)) and all(r[a] == 3 for r, a in zip(records, ids_at.tolist())) and \
        all(r[a] == 1 for r, a in zip(records, mask_at.tolist())) and bool((mask_at + 9 + mask_bytes == sizes).all())
    if not common:
        decoded = [decode_example(r) for r in records]
        return DecodedExamples([d[0] for d in decoded], [d[1] for d in decoded],
                               np.asarray([len(d[2]) for d in decoded], dtype=np.int32),
                               np.concatenate([d[2] for d in decoded]) if decoded else np.zeros(0, tokenwire.IDS),
                               np.concatenate([d[3] for d in decoded]) if decoded else np.zeros(0, tokenwire.MASK))
    eids = [r[_HEAD.size : a].decode("utf-8") for r, a in zip(records, ids_at.tolist())]
    locs = [(h[2], h[3], h[4], h[5]) for h in heads]
    joined = np.frombuffer(b"".join(records), dtype=np.uint8)
    record_starts = np.cumsum(sizes) - sizes
    total = int(lens.sum())
    # ids: the 3-byte bodies gathered back to back are one 24-bit ids buffer.
    body_lens = 3 * lens
    body_starts = np.cumsum(body_lens) - body_lens
    src = record_starts + ids_at + 1
    gather = np.repeat(src - body_starts, body_lens) + np.arange(int(body_lens.sum()), dtype=np.int64)
    ids = tokenwire.ids_from_wire(tokenwire.IDS_24 + joined[gather].tobytes())
    # masks: each record's bits start on a byte; unpack all, keep each record's first n.
    byte_starts = np.cumsum(mask_bytes) - mask_bytes
    src = record_starts + mask_at + 9
    gather = np.repeat(src - byte_starts, mask_bytes) + np.arange(int(mask_bytes.sum()), dtype=np.int64)
    bits = np.unpackbits(joined[gather])
    starts = np.cumsum(lens) - lens
    keep = np.repeat(byte_starts * 8 - starts, lens) + np.arange(total, dtype=np.int64)
    return DecodedExamples(eids, locs, lens.astype(np.int32), ids, bits[keep])


# ----------------------------------------------------------------------------- manifest


@dataclasses.dataclass
class TokenSetManifest:
    """What makes the tokens valid (choices, tokenizer identity, input fingerprints) and what
    a later run needs to reproduce a full run's shard sets (tasks, tallies, fingerprints)."""

    shards: list[ShardInfo]
    num_examples: int
    tokens: int
    target_tokens: int
    choices: dict[str, Any]  # TOKEN_CHOICES -> value, as the run was asked
    tokenizer: dict[str, Any]  # identity: name, vocab hash, special ids, ...
    template: dict[str, Any]
    inputs: list[dict[str, Any]]  # with content fingerprints
    stats: dict[str, Any]  # examples_read, examples_kept, examples_dropped, ...
    job: dict[str, Any]  # tasks, fingerprints, tally, est_records: to reproduce the full run's figures
    dropped: str | None = None
    tool: dict[str, Any] = dataclasses.field(default_factory=dict)
    created_at: str | None = None
    kind: str = TOKENS_KIND
    format_version: int = TOKENS_FORMAT_VERSION
    array_record_options: str = TOKENS_WRITER_OPTIONS

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.shards)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = MANIFEST_NAME) -> "TokenSetManifest":
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # and a 5,001-digit integer, or arrays nested 100,000 deep
            why = " ".join(str(e).split())[:200]
            raise TokenSetError(f"{source}: not valid JSON ({why}); run a full `prepack pack` again") from None
        if not isinstance(data, dict) or data.get("kind") != TOKENS_KIND:
            raise TokenSetError(f"{source}: not a tokenized set's manifest (a shard set's? pass the OUTPUT/{TOKENS_DIR} folder)")
        if type(data.get("format_version")) is not int or data["format_version"] != TOKENS_FORMAT_VERSION:
            raise TokenSetError(
                f"{source}: tokenized-set format_version {data.get('format_version')!r} is not supported "
                f"(this version reads {TOKENS_FORMAT_VERSION}); run a full `prepack pack` from the inputs again")
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in data]
        if missing:
            raise TokenSetError(f"{source}: missing keys {missing}")
        kwargs = _checked_fields(data, source)
        shards = [ShardInfo(**s) for s in untrusted.shard_entries(data["shards"], source, TokenSetError)]
        manifest = cls(shards=shards, **kwargs)
        if sum(s.num_rows for s in shards) != manifest.num_examples:
            raise TokenSetError(f"{source}: shard record counts add up to {sum(s.num_rows for s in shards)}, "
                                f"not num_examples {manifest.num_examples}")
        return manifest

    def mismatch(self, requested: dict[str, Any]) -> str | None:
        """The first choice the run asks for that differs from the tokens' (None if all agree);
        `requested` holds only what the user gave."""
        for key in TOKEN_CHOICES:
            if key not in requested:
                continue
            want, have = requested[key], self.choices.get(key, _CHOICE_DEFAULTS.get(key))
            if key == "inputs":
                want, have = list(want), list(have or [])
            if key == "template_options":
                want, have = dict(want), dict(have or {})
            if want != have:
                flag = {"inputs": "--input", "format": "--format", "template_options": "template options",
                        "chat_format": "--chat-format", "tokenizer": "--tokenizer",
                        "train_reasoning": "--train-reasoning", "expand_turns": "--expand-turns"}[key]
                return f"{flag} {_show(want)} differs from the tokenized set's {_show(have)}"
        return None


def _checked_fields(data: dict[str, Any], source: str) -> dict[str, Any]:
    """The fields other than `shards`, each of the type the job relies on (prepack.hostile_input.untrusted);
    TokenSetError names the field."""
    E = TokenSetError
    u = untrusted

    def job(v: Any, f: str) -> dict[str, Any]:
        u.mapping(v, source, f, E)
        for k, task in enumerate(u.sequence(v.get("tasks"), source, f"{f}.tasks", E)):
            u.mapping(task, source, f"{f}.tasks[{k}]", E)
            u.count(task.get("input_index"), source, f"{f}.tasks[{k}].input_index", E)
            for key in ("input_spec", "path", "name"):
                u.text(task.get(key), source, f"{f}.tasks[{k}].{key}", E)
            if task.get("byte_start") is not None:
                u.count(task["byte_start"], source, f"{f}.tasks[{k}].byte_start", E)
            if set(task) - {"input_index", "input_spec", "path", "name", "byte_start"}:
                raise E(f"{source}: {f}.tasks[{k}] has unknown keys {sorted(set(task))}; the manifest was edited or is damaged")
        u.sequence(v.get("fingerprints"), source, f"{f}.fingerprints", E)
        u.count(v.get("est_records"), source, f"{f}.est_records", E)
        try:
            from prepack.packing.accounting import Tally

            Tally.from_json(u.mapping(v.get("tally"), source, f"{f}.tally", E))
        except E:
            raise
        except Exception as e:  # a missing count, a string for a number, an unknown drop reason
            raise E(f"{source}: {f}.tally is damaged ({type(e).__name__}: {e}); run a full `prepack pack` again") from None
        return v

    def tokenizer(v: Any, f: str) -> dict[str, Any]:
        u.mapping(v, source, f, E)
        u.count(v.get("pad_id"), source, f"{f}.pad_id", E)
        return v

    def choices(v: Any, f: str) -> dict[str, Any]:
        u.mapping(v, source, f, E)
        for k, spec in enumerate(u.sequence(v.get("inputs"), source, f"{f}.inputs", E)):
            u.text(spec, source, f"{f}.inputs[{k}]", E)
        for key in ("format", "chat_format", "tokenizer"):
            u.text(v.get(key), source, f"{f}.{key}", E)
        u.mapping(v.get("template_options"), source, f"{f}.template_options", E)
        u.text(v.get("tfds_data_dir"), source, f"{f}.tfds_data_dir", E, optional=True)
        if v.get("train_reasoning", "yes") not in ("yes", "no"):
            raise E(f"{source}: {f}.train_reasoning must be 'yes' or 'no', got {str(v.get('train_reasoning'))[:40]!r}; "
                    f"the manifest was edited or is damaged")
        if not isinstance(v.get("expand_turns", False), bool):
            raise E(f"{source}: {f}.expand_turns must be true or false; the manifest was edited or is damaged")
        return v

    checks = {
        "num_examples": lambda v, f: u.count(v, source, f, E),
        "tokens": lambda v, f: u.count(v, source, f, E),
        "target_tokens": lambda v, f: u.count(v, source, f, E),
        "choices": choices,
        "tokenizer": tokenizer,
        "template": lambda v, f: u.mapping(v, source, f, E),
        "inputs": lambda v, f: u.sequence(v, source, f, E),
        "stats": lambda v, f: u.mapping(v, source, f, E),
        "job": job,
        "dropped": lambda v, f: None if v is None else u.file_name(v, source, f, E),
        "tool": lambda v, f: u.mapping(v, source, f, E),
        "created_at": lambda v, f: u.text(v, source, f, E, optional=True),
        "kind": lambda v, f: v,
        "format_version": lambda v, f: v,
        "array_record_options": lambda v, f: u.text(v, source, f, E),
    }
    return {k: checks[k](v, k) for k, v in data.items() if k in checks}


def _show(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value)) or "(none)"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)
