"""Global packing plans from lengths alone, and the routing of examples to rows.

Why this shape: best-fit-decreasing needs to see every length, but not every
payload. So the job first combines a length histogram (a few thousand numbers),
plans once, and then each example finds its row from (its length, its rank
among examples of that length), which needs only the examples of one length
(and one hash sub-bucket) on one worker. The rows are exactly the global BFD
rows, whatever the scale or the number of workers.

Keys and order, per max length L:
- `length_key` is an example's tokenized length n (packed) or 0 (unpacked).
- `b = sub_buckets_of(hashes, B)` splits big lengths over B groups; the job groups
  examples by (length_key, b).
- the example's *class* is the row-slot length it needs: min(n, L) (truncation
  makes all n > L land in class L), or 0 when unpacked.
- within a class, examples are ranked by (b, length_key, hash, example_id);
  the k-th one takes the class's k-th slot. `offsets[(length_key, b)]` is the
  rank of a group's first survivor, so a group ranks its own examples locally.
Unpacked, class 0 has one slot per row in that order: rows come in stable-hash
order, because b is a monotone function of the hash.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import defaultdict
from collections.abc import Mapping

import numpy as np

from prepack.packer import RunPlan, plan_runs_from_histogram

# Compressed bytes per token of a row under zstd:3, measured in docs/row_format.md
# (2.4); used only to turn --target-shard-mb into a shard count.
EST_COMPRESSED_BYTES_PER_TOKEN = 2.5
# Examples per (length, sub-bucket) group that one worker sorts in memory.
PACKED_EXAMPLES_PER_SUB_BUCKET = 2_000_000
UNPACKED_EXAMPLES_PER_SUB_BUCKET = 100_000
MAX_SUB_BUCKETS = 4096

Histogram = Mapping[tuple[int, int, int], int]  # (L, length_key, b) -> surviving examples


def stable_hash(example_id: str) -> int:
    """64-bit hash of an example id; the same in every process (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(example_id.encode("utf-8"), digest_size=8).digest(), "big")


def sub_buckets_of(hashes: np.ndarray, num_sub_buckets: int) -> np.ndarray:
    """sub_bucket for an array of uint64 hashes, exactly: (h * B) >> 64 split at 32 bits so
    that nothing overflows 64 bits (B <= MAX_SUB_BUCKETS < 2**32)."""
    if not 1 <= num_sub_buckets <= MAX_SUB_BUCKETS:
        raise ValueError(f"num_sub_buckets must be between 1 and {MAX_SUB_BUCKETS}, got {num_sub_buckets}")
    h = np.asarray(hashes, dtype=np.uint64)
    b = np.uint64(num_sub_buckets)
    high = (h >> np.uint64(32)) * b + (((h & np.uint64(0xFFFFFFFF)) * b) >> np.uint64(32))
    return (high >> np.uint64(32)).astype(np.int64)


def choose_sub_buckets(est_records: int, pack: bool) -> int:
    """Enough sub-buckets that one group stays small, derived from the input alone so
    two runs over the same inputs always agree."""
    per = PACKED_EXAMPLES_PER_SUB_BUCKET if pack else UNPACKED_EXAMPLES_PER_SUB_BUCKET
    return int(min(MAX_SUB_BUCKETS, max(1, math.ceil(est_records / per))))


def example_class(length_key: int, max_length: int, pack: bool) -> int:
    return min(length_key, max_length) if pack else 0


def choose_num_shards(num_rows: int, max_length: int, num_shards: int | None, target_shard_mb: float) -> int:
    if num_rows <= 0:
        return 0
    if num_shards is None:
        est_bytes = num_rows * max_length * EST_COMPRESSED_BYTES_PER_TOKEN
        num_shards = math.ceil(est_bytes / (target_shard_mb * 1024 * 1024))
    # No empty shard files (each would still be 128 KiB): at most one shard per row.
    return int(max(1, min(num_shards, num_rows)))


@dataclasses.dataclass
class LengthPlan:
    """Everything a worker needs to route the examples of one max length."""

    max_length: int
    pack: bool
    num_rows: int
    num_shards: int
    num_examples: int
    tokens: int  # sum of slot lengths (packed); filled from the writers when unpacked
    min_segments: int
    max_segments: int
    offsets: dict[tuple[int, int], int]
    # class -> (row of the k-th slot, position of that slot in its row); packed only
    slots: dict[int, tuple[np.ndarray, np.ndarray]]

    def route(self, length_key: int, b: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows and positions (int64 arrays) of a group's `count` survivors, in rank order."""
        start = self.offsets[(length_key, b)]
        if not self.pack:
            return np.arange(start, start + count, dtype=np.int64), np.zeros(count, dtype=np.int32)
        rows, positions = self.slots[example_class(length_key, self.max_length, True)]
        end = start + count
        if end > len(rows):
            raise AssertionError(f"L={self.max_length}: group {(length_key, b)} needs slots up to {end}, plan has {len(rows)}")
        return rows[start:end].astype(np.int64), positions[start:end]

    def rows_in_shard(self, shard: int) -> range:
        return range(shard, self.num_rows, self.num_shards)


def slots_from_runs(runs: RunPlan) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """class -> (row, position) int32 arrays of its slots, in row order then position order.

    Runs are expanded with numpy, so the cost per slot is a few array elements rather
    than Python objects. A row holds at most one run per class, so sorting the runs by
    (class, row) and expanding each into consecutive positions gives that order."""
    order = np.lexsort((runs.row, runs.length))
    length, row, count, start = runs.length[order], runs.row[order], runs.count[order], runs.start[order]
    first_flat = np.cumsum(count) - count  # flat index of each run's first slot
    rows = np.repeat(row, count).astype(np.int32)
    positions = (np.arange(int(count.sum())) - np.repeat(first_flat - start, count)).astype(np.int32)
    classes, first_run = np.unique(length, return_index=True)
    bounds = [*first_flat[first_run].tolist(), len(rows)]
    by_class = {
        int(cls): (rows[a:b], positions[a:b]) for cls, a, b in zip(classes.tolist(), bounds, bounds[1:])
    }
    # Insertion order as a row-by-row scan of the plan meets the classes.
    return dict(sorted(by_class.items(), key=lambda item: (int(item[1][0][0]), int(item[1][1][0]))))


def build_plan(
    histogram: Histogram, max_length: int, pack: bool, num_shards: int | None = None, target_shard_mb: float = 256.0
) -> LengthPlan:
    """The plan for one L from the (L, length_key, b) histogram (other L's entries are ignored)."""
    entries = sorted(
        ((example_class(k, max_length, pack), b, k, c) for (L, k, b), c in histogram.items() if L == max_length and c > 0)
    )
    offsets: dict[tuple[int, int], int] = {}
    class_counts: dict[int, int] = defaultdict(int)
    for cls, b, k, count in entries:
        offsets[(k, b)] = class_counts[cls]
        class_counts[cls] += count
    num_examples = sum(class_counts.values())
    slots: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    if pack:
        runs = plan_runs_from_histogram(class_counts, max_length)
        slots = slots_from_runs(runs)
        num_rows = runs.num_rows
        tokens = sum(cls * count for cls, count in class_counts.items())
        min_seg, max_seg = (int(runs.segments.min()), int(runs.segments.max())) if num_rows else (0, 0)
    else:
        num_rows = num_examples
        tokens = 0
        min_seg = max_seg = 1 if num_rows else 0
    return LengthPlan(
        max_length=max_length,
        pack=pack,
        num_rows=num_rows,
        num_shards=choose_num_shards(num_rows, max_length, num_shards, target_shard_mb),
        num_examples=num_examples,
        tokens=tokens,
        min_segments=min_seg,
        max_segments=max_seg,
        offsets=offsets,
        slots=slots,
    )


def build_plans(
    histogram: Histogram, max_lengths: tuple[int, ...], pack: bool, num_shards: int | None, target_shard_mb: float
) -> dict[int, LengthPlan]:
    return {L: build_plan(histogram, L, pack, num_shards, target_shard_mb) for L in max_lengths}
