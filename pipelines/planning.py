"""Global packing plans from lengths alone, and the routing of examples to rows.

Why this shape: a global plan (best-fit-decreasing, or the exact fills of `--planner best`)
needs to see every length, but not every payload. So the job first combines a length
histogram (a few thousand numbers), plans once, and then each example finds its row from
(its length, its rank among examples of that length), which needs only the examples of one
length (and one hash sub-bucket) on one worker. The rows are exactly the global plan's
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
import os
from collections import defaultdict
from collections.abc import Iterator, Mapping

import numpy as np

from prepack.packing.packer import ClassRuns, HistogramPlan, Planner

# Hash sub-buckets per max length (--sub-buckets): B <= MAX_SUB_BUCKETS < 2**32 keeps the
# routing arithmetic below within 64 bits.
MAX_SUB_BUCKETS = 4096
# Compressed bytes per token of a row under zstd:3, measured in docs/row_format.md
# (2.4); used only to turn --target-shard-mb into a shard count.
EST_COMPRESSED_BYTES_PER_TOKEN = 2.5
# Examples per (length, sub-bucket) group that one worker sorts in memory.
PACKED_EXAMPLES_PER_SUB_BUCKET = 2_000_000
UNPACKED_EXAMPLES_PER_SUB_BUCKET = 100_000
# At the scales a local run reaches, packed groups are cut finer: one sub-bucket per local SDK
# worker's share (launch/local_memory.EXAMPLES_PER_LOCAL_WORKER), up to LOCAL_SCALE_SUB_BUCKETS.
# Beam's local runner deals a shuffle's keys to its workers round-robin, whatever their sizes, and
# a worker holds its whole deal. With one sub-bucket the keys are the distinct lengths (~150 on
# EN-FR pairs), each growing with the input, so as the input (and the worker count) grew each
# worker got fewer, bigger keys and the largest share outgrew the mean: 1.17x the mean at 13
# workers against 1.03x at 5 (docs/benchmarks.md, "Worker memory"). With a sub-bucket per share
# each worker gets about as many keys as there are lengths, at any size.
LOCAL_SCALE_EXAMPLES_PER_SUB_BUCKET = 250_000
LOCAL_SCALE_SUB_BUCKETS = 64
# Row slots (max length x rows) per write window: the unit one writer holds in memory. A shard's
# rows are written by window, each window to a part file, and the parts are streamed into the
# shard in row order, so a writer's memory does not grow with the shard or the input
# (pipelines/README.md, "Bounded worker memory").
WINDOW_TOKENS = 4 << 20
# Overrides WINDOW_TOKENS where the plan is built (tests use tiny windows to cross many window
# boundaries; the rows and bytes written do not depend on it).
WINDOW_TOKENS_ENV = "PREPACK_WINDOW_TOKENS"


def window_tokens() -> int:
    return max(1, int(os.environ.get(WINDOW_TOKENS_ENV, WINDOW_TOKENS)))

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
    """Enough sub-buckets that one group stays small (and, packed, at least one per local worker
    share up to LOCAL_SCALE_SUB_BUCKETS), derived from the input alone so two runs over the same
    inputs always agree."""
    if not pack:
        return int(min(MAX_SUB_BUCKETS, max(1, math.ceil(est_records / UNPACKED_EXAMPLES_PER_SUB_BUCKET))))
    wanted = max(math.ceil(est_records / PACKED_EXAMPLES_PER_SUB_BUCKET),
                 min(LOCAL_SCALE_SUB_BUCKETS, math.ceil(est_records / LOCAL_SCALE_EXAMPLES_PER_SUB_BUCKET)))
    return int(min(MAX_SUB_BUCKETS, max(1, wanted)))


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
    # class -> (row of the k-th slot, position of that slot in its row); packed only, and only
    # in the whole plan testkit/plans.build_plan makes: the job never holds every slot, it streams each
    # (length_key, b) group its own slice (LengthPlanner.group_slices).
    slots: dict[int, tuple[np.ndarray, np.ndarray]]
    group_counts: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    window_tokens: int = WINDOW_TOKENS
    bfd_rows: int | None = None  # BFD's own rows (packed), beside num_rows; None unpacked
    method: str = "bfd"  # what made the rows: "bfd", "exact_fill", or "unpacked"
    planner_fallback: str | None = None  # "budget": --planner best's exact fill ran past its work budget

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

    def group_slices(self):
        """((length_key, b), rows, positions) of every group, packed only: the group's slots in
        rank order, what `route` returns for it, as int32 arrays."""
        for (key, b), start in self.offsets.items():
            rows, positions = self.slots[example_class(key, self.max_length, True)]
            count = self.group_counts[(key, b)]
            yield (key, b), rows[start:start + count], positions[start:start + count]

    def without_slots(self) -> "LengthPlan":
        """What every worker holds: the plan's sizes, and when unpacked the group offsets (at most
        MAX_SUB_BUCKETS groups, all of length_key 0). A packed plan's groups get their slices
        instead, so its offsets (a million groups at 1B examples) stay with the planner."""
        return dataclasses.replace(self, slots={}, group_counts={}, offsets={} if self.pack else self.offsets)

    # Shards hold contiguous runs of rows, as even as the row count allows (none empty, since
    # num_shards <= num_rows). Why not row % num_shards: an example's slots at each max length sit
    # at about the same relative place in each plan, so with contiguous shards they mostly meet
    # in one write window and its tokens cross the window shuffle once; dealt round-robin, each L
    # put them in an unrelated shard (1.79 window copies per example against 1.10, 3 L, 2 shards
    # per L; docs/benchmarks.md). Readers shuffle rows globally, so a shard need not be a sample.
    def shard_start(self, shard: int) -> int:
        return shard * self.num_rows // self.num_shards

    def rows_in_shard(self, shard: int) -> range:
        return range(self.shard_start(shard), self.shard_start(shard + 1))

    def shards_of(self, rows: np.ndarray) -> np.ndarray:
        """The shard of each row: the s with shard_start(s) <= row < shard_start(s + 1)."""
        rows = np.asarray(rows, dtype=np.int64)
        return ((rows + 1) * self.num_shards - 1) // self.num_rows

    @property
    def rows_per_window(self) -> int:
        return max(1, self.window_tokens // self.max_length)

    def windows_of(self, rows: np.ndarray) -> np.ndarray:
        """The write window of each row: its rank within its shard // rows_per_window."""
        rows = np.asarray(rows, dtype=np.int64)
        return (rows - self.shards_of(rows) * self.num_rows // self.num_shards) // self.rows_per_window

    def rows_in_window(self, shard: int, window: int) -> range:
        per = self.rows_per_window
        return self.rows_in_shard(shard)[window * per:(window + 1) * per]

    def num_windows(self, shard: int) -> int:
        return -(-len(self.rows_in_shard(shard)) // self.rows_per_window)


class LengthPlanner:
    """One L's plan from the (L, length_key, b) histogram (other L's entries are ignored),
    streamed: `group_slices()` places one class at a time, longest first, and yields each of
    its groups' slices before it places the next class, so the planner never holds more than
    the BFD state (~8 bytes per row), one class's runs (O(rows it touches)), one group's slice
    and the group offsets (O(groups)); `plan()` is the plan once every class is placed.

    Groups take their class's slots in (b, length_key) order, each a consecutive range from
    `offsets[(length_key, b)]`; under truncation every length_key > L is in class L."""

    def __init__(self, histogram: Histogram, max_length: int, pack: bool, num_shards: int | None = None,
                 target_shard_mb: float = 256.0, planner: Planner = Planner.BEST, max_segments: int | None = None):
        self.max_length, self.pack = max_length, pack
        self.num_shards, self.target_shard_mb = num_shards, target_shard_mb
        entries = sorted(
            (example_class(k, max_length, pack), b, k, c) for (L, k, b), c in histogram.items() if L == max_length and c > 0
        )
        self.offsets: dict[tuple[int, int], int] = {}
        self.group_counts: dict[tuple[int, int], int] = {}
        self.class_counts: dict[int, int] = defaultdict(int)
        self._groups_by_class: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for cls, b, k, count in entries:
            key = (k, b)  # one tuple for the three maps: ~100 bytes per group less at 1M groups
            self.offsets[key] = self.class_counts[cls]
            self.group_counts[key] = count
            self.class_counts[cls] += count
            self._groups_by_class[cls].append(key)
        self._bfd = HistogramPlan(self.class_counts, max_length, planner, max_segments) if pack else None
        self._placed = not pack

    def classes(self) -> Iterator[ClassRuns]:
        """Each class's runs (packed only), placed one class at a time, longest first."""
        if self._bfd is not None:
            yield from self._bfd.classes()
            self._placed = True

    def group_slices(self) -> Iterator[tuple[tuple[int, int], np.ndarray, np.ndarray]]:
        """((length_key, b), rows, positions) of every group, packed only: the group's slots in
        rank order (int32), what LengthPlan.route returns for it; class by class."""
        for runs in self.classes():
            for key in self._groups_by_class[runs.length]:
                start = self.offsets[key]
                yield (key, *runs.slots(start, start + self.group_counts[key]))

    def plan(self, slots: dict[int, tuple[np.ndarray, np.ndarray]] | None = None) -> LengthPlan:
        """The plan, once every class is placed (classes() or group_slices() exhausted)."""
        if not self._placed:
            raise RuntimeError("LengthPlanner.plan() needs every class placed first: exhaust group_slices()")
        num_examples = sum(self.class_counts.values())
        if self._bfd is not None:
            num_rows = self._bfd.num_rows
            tokens = sum(cls * count for cls, count in self.class_counts.items())
            min_seg, max_seg = self._bfd.segment_range()
            bfd_rows, method = self._bfd.bfd_rows, self._bfd.method
            fallback = "budget" if self._bfd.budget_exhausted else None
        else:
            bfd_rows, method, fallback = None, "unpacked", None
            num_rows = num_examples
            tokens = 0
            min_seg = max_seg = 1 if num_rows else 0
        return LengthPlan(
            max_length=self.max_length,
            pack=self.pack,
            num_rows=num_rows,
            num_shards=choose_num_shards(num_rows, self.max_length, self.num_shards, self.target_shard_mb),
            num_examples=num_examples,
            tokens=tokens,
            min_segments=min_seg,
            max_segments=max_seg,
            offsets=self.offsets,
            slots=slots or {},
            group_counts=self.group_counts,
            window_tokens=window_tokens(),
            bfd_rows=bfd_rows,
            method=method,
            planner_fallback=fallback,
        )
