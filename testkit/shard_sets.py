"""Builds small published shard sets for tests and benchmarks, without the Beam job.

A shard set built here is what the job publishes: rows-XXXXX-of-XXXXX.array_record
files, a manifest.json written last, and optionally a dead_letter.jsonl.

Rows are synthetic but valid (prepack.format.rowformat.check_row passes) and
identifiable: the first token of global row r is `r` (see `row_ids`), so tests
can tell which rows a batch holds without decoding anything else.

    from testkit.shard_sets import build_shard_set, row_ids
    manifest = build_shard_set(tmp_path, num_rows=100, num_shards=3, max_length=64)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from prepack.format import rowformat, shardfile
from prepack.format.manifest import DEAD_LETTER_NAME, MANIFEST_NAME, Manifest

# The tokenizer identity written into synthetic manifests (the shape of Tokenizer.identity()).
TEST_TOKENIZER: dict[str, Any] = {
    "name": "test-vocab",
    "vocab_size": 50_000,
    "bos_id": 2,
    "eos_id": 1,
    "pad_id": 0,
    "special_ids": {"<pad>": 0, "<eos>": 1, "<bos>": 2},
    "vocab_hash": "0" * 64,
}


def synthetic_row(row_id: int, max_length: int, rng: np.random.Generator, vocab_size: int = 50_000) -> dict[str, np.ndarray]:
    """A valid packed row of 1..4 segments whose first token is `row_id`."""
    if row_id >= vocab_size:
        raise ValueError(f"row_id {row_id} does not fit a vocabulary of {vocab_size}")
    n_segments = min(int(rng.integers(1, 5)), max_length)
    # Fill 50-100% of the row, split at random cut points into n_segments non-empty parts.
    used = int(rng.integers(max(n_segments, max_length // 2), max_length + 1))
    cuts = np.sort(rng.choice(np.arange(1, used), size=n_segments - 1, replace=False)) if n_segments > 1 else []
    lengths = np.diff(np.concatenate([[0], cuts, [used]])).astype(int)
    segments = []
    for n in lengths:
        ids = rng.integers(3, vocab_size, size=n, dtype=np.int32)
        mask = np.zeros(n, dtype=np.int32)
        mask[n // 2 :] = 1  # second half of each example is the response
        segments.append(rowformat.Segment(ids, mask))
    first = segments[0].input_ids.copy()
    first[0] = row_id
    segments[0] = rowformat.Segment(first, segments[0].loss_mask)
    return rowformat.build_row(segments, max_length, pad_id=TEST_TOKENIZER["pad_id"])


def row_ids(batch: Mapping[str, np.ndarray]) -> np.ndarray:
    """Global row ids of the rows in a decoded row or batch (the first token of each row)."""
    return np.asarray(batch["input_ids"])[..., 0]


def split_evenly(num_rows: int, num_shards: int) -> list[int]:
    base, extra = divmod(num_rows, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def build_shard_set(
    directory: str | os.PathLike,
    *,
    num_rows: int = 64,
    num_shards: int = 2,
    max_length: int = 32,
    seed: int = 0,
    rows: Sequence[Mapping[str, np.ndarray]] | None = None,
    rows_per_shard: Sequence[int] | None = None,
    tokenizer: Mapping[str, Any] | None = None,
    dead_letter: Sequence[Mapping[str, Any]] = (),
    template: Mapping[str, Any] | None = None,
) -> Manifest:
    """Writes a complete shard set into `directory` (created if needed) and returns its manifest.

    rows: explicit rows to write (each [L] fields); by default `num_rows` synthetic rows, ids in the
      tokenizer's vocabulary. Rows with `pair_side` make a preference set (testkit/tunix_dpo.pair_rows).
    rows_per_shard: how many rows go into each shard (may contain 0); default: as even as possible.
    """
    os.makedirs(directory, exist_ok=True)
    if rows is None:
        rng = np.random.default_rng(seed)
        vocab = int((tokenizer or TEST_TOKENIZER)["vocab_size"])
        rows = [synthetic_row(r, max_length, rng, vocab_size=vocab) for r in range(num_rows)]
    num_rows = len(rows)
    counts = list(rows_per_shard) if rows_per_shard is not None else split_evenly(num_rows, num_shards)
    if sum(counts) != num_rows:
        raise ValueError(f"rows_per_shard adds up to {sum(counts)}, not {num_rows}")
    num_shards = len(counts)

    pairs = bool(rows) and rowformat.PAIR_SIDE in rows[0]
    names = rowformat.field_names(rowformat.PAIR_FORMAT_VERSION)

    def encode(row: Mapping[str, np.ndarray]) -> bytes:
        if not pairs:
            return rowformat.encode_row(row, max_length)
        return np.stack([np.asarray(row[name]) for name in names]).astype(rowformat.STORAGE_DTYPE).tobytes()

    shards, start = [], 0
    for index, count in enumerate(counts):
        records = [encode(row) for row in rows[start : start + count]]
        start += count
        path = os.path.join(directory, shardfile.shard_name(index, num_shards))
        shards.append(shardfile.write_shard(path, records))

    tokens = int(sum(int(np.asarray(r["valid_mask"]).sum()) for r in rows))
    targets = int(sum(int(np.asarray(r["loss_mask"]).sum()) for r in rows))
    examples = int(sum(int(np.asarray(r["segment_ids"]).max(initial=0)) // (2 if pairs else 1) for r in rows))
    dropped = {"too_long": len(dead_letter)} if dead_letter else {}
    stats = {
        "examples_read": examples + len(dead_letter),
        "examples_written": examples,
        "examples_dropped": dropped,
        "examples_truncated": 0,
        "tokens": tokens,
        "target_tokens": targets,
        "lower_bound_rows": -(-tokens // max_length),
        "packed_density": tokens / (num_rows * max_length) if num_rows else 0.0,
        "unpacked_density": tokens / (examples * max_length) if examples else 0.0,
    }
    if dead_letter:
        with open(os.path.join(directory, DEAD_LETTER_NAME), "w") as f:
            for entry in dead_letter:
                f.write(json.dumps(dict(entry)) + "\n")
    manifest = Manifest(
        max_length=max_length,
        num_rows=num_rows,
        shards=shards,
        tokenizer=dict(tokenizer if tokenizer is not None else TEST_TOKENIZER),
        stats=stats,
        template=dict(template or {"name": "test"}),
        dead_letter=DEAD_LETTER_NAME if dead_letter else None,
    )
    if pairs:
        manifest.use_row_format(False, False, preference=True)
        manifest.stats.update({"pairs_read": examples + len(dead_letter), "pairs_written": examples, "pairs_dropped": dropped})
    # Written last, as the job does: a folder without it is not a shard set.
    with open(os.path.join(directory, MANIFEST_NAME), "w") as f:
        f.write(manifest.to_json())
    return manifest
