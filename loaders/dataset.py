"""The Grain pipeline over a shard set: fixed [B, L] batches, split across hosts, resumable.

    row indices 0..N-1 -> global shuffle(seed) -> repeat(num_epochs), reshuffled each epoch
      -> keep a whole number of global steps (finite runs with drop_remainder)
      -> this host's slice [shard_index::shard_count]
      -> batch B indices -> read and decode those B rows in one call (ShardView.read)
      -> to_iter_dataset(read threads) -> optional mp_prefetch(worker processes)

The pipeline moves integers until the batch, so a batch costs one hand-off to
a read thread, not one per row. Each record already is a packed row, so the
host does no tokenizing or packing: the work per row is one ArrayRecord read (a
zstd decompression) and a memcpy. That is also why mp_prefetch keeps the order
exactly: the pipeline is one-to-one up to the batch, with nothing stateful (see
Grain's mp_prefetch docs).

Read threads, when not given, are chosen by where the shards are (see
default_read_threads): on local disk a read is CPU work that more threads only
contend for; on gcsfuse each read waits on the network; gs:// sets are read
from whole-shard local copies that a background prefetch fills.

What each host sees (rows are positions in the global stream
epoch 0's permutation, then epoch 1's, ...; host h takes positions h, h+n, h+2n...):
- hosts are disjoint, and across hosts every epoch holds every row exactly once;
- all hosts step the same number of batches: with finite num_epochs and
  drop_remainder, the stream is cut to a multiple of shard_count * batch_size,
  i.e. the last (num_rows * num_epochs) % (shard_count * batch_size) positions of
  the final epoch are dropped (see HostPlan) and nothing else; with
  num_epochs=None nothing is ever dropped;
- batches are not aligned to epochs: a batch may hold the end of one epoch and
  the start of the next, as with any repeat-then-batch pipeline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

import grain
import numpy as np

from loaders import mounts
from loaders.shards import ShardSetError, ShardView, TokenizerLike, open_shards, tokenizer_identity

# Bumped when the meaning of a saved iterator state changes.
STATE_FORMAT = 1

# Read threads by where the shards are. Local disk: one thread overlaps reading
# with the training step at ~no CPU cost (16 cost 2.5x the CPU per row, GIL
# contention). gcsfuse/NFS: each read waits on the network, so many in flight.
# gs://: reads are local once a shard is cached; a few threads let batches whose
# shards are already cached go ahead of one that waits on a download.
READ_THREADS_LOCAL = 1
READ_THREADS_NETWORK_MOUNT = 16
READ_THREADS_GCS = 4
# Concurrent whole-shard downloads started by make_dataset for gs:// sets.
GCS_PREFETCH_DOWNLOADS = 8
# Batches the read threads decode ahead of the consumer (make_dataset's prefetch): what a host
# holds of a dataset at most, beside the batch in use.
PREFETCH_BATCHES = 32


def default_read_threads(view: ShardView) -> int:
    """The read threads make_dataset uses when read_threads is None, chosen by the set's location."""
    if view.is_remote:
        return READ_THREADS_GCS
    return READ_THREADS_NETWORK_MOUNT if mounts.is_network_mount(view.path) else READ_THREADS_LOCAL


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """What one host reads: rows and batches per host, and what is dropped.

    num_epochs None means "repeat forever": rows_per_host and batches_per_host
    are then None and nothing is dropped.
    """

    num_rows: int
    batch_size: int
    shard_count: int
    num_epochs: int | None
    drop_remainder: bool = True

    @property
    def stream_rows(self) -> int | None:
        """Positions in the global stream (all epochs, all hosts) before any cut."""
        return None if self.num_epochs is None else self.num_rows * self.num_epochs

    @property
    def used_rows(self) -> int | None:
        """Positions read by all hosts together."""
        total = self.stream_rows
        if total is None or not self.drop_remainder:
            return total
        step = self.shard_count * self.batch_size
        return total // step * step

    @property
    def dropped_rows(self) -> int:
        """Positions of the final epoch's tail that no host reads (0 when repeating forever)."""
        total = self.stream_rows
        return 0 if total is None else total - (self.used_rows or 0)

    def rows_for_host(self, shard_index: int) -> int | None:
        used = self.used_rows
        if used is None:
            return None
        return len(range(shard_index, used, self.shard_count))

    def batches_for_host(self, shard_index: int) -> int | None:
        rows = self.rows_for_host(shard_index)
        if rows is None:
            return None
        return rows // self.batch_size if self.drop_remainder else math.ceil(rows / self.batch_size)

    @property
    def batches_per_host(self) -> int | None:
        """Batches each host yields; equal on all hosts when drop_remainder."""
        return self.batches_for_host(0)


def resolve_host(shard_index: int | None, shard_count: int | None) -> tuple[int, int]:
    """This host's (index, count): as given, or JAX's process_index/process_count, or (0, 1) without JAX."""
    if shard_index is None and shard_count is None:
        try:
            import jax
        except ImportError:
            return 0, 1
        return jax.process_index(), jax.process_count()
    if shard_index is None or shard_count is None:
        raise ValueError("give both shard_index and shard_count, or neither (then JAX's process_index/process_count are used)")
    if shard_count < 1 or not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index must be in [0, shard_count), got {shard_index} of {shard_count}")
    return shard_index, shard_count


def ensure_absl_flags_parsed() -> None:
    """grain 0.2.18's mp_prefetch reads absl flags; in a plain script (no absl.app.run)
    that raises UnparsedFlagAccessError (google/grain#1355, fixed after 0.2.18).
    Marking the flags parsed keeps their defaults and changes nothing else."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _index_array(indices: list[int]) -> np.ndarray:
    return np.asarray(indices, dtype=np.int64)


def shard_set_id(view: ShardView) -> str:
    """A short content id of a shard set: equal for the same shards wherever they are stored."""
    m = view.manifest
    digest = hashlib.sha256(json.dumps([m.max_length, m.num_rows, [s.sha256 for s in m.shards]]).encode())
    return digest.hexdigest()[:16]


class _StateCheckedIterDataset(grain.IterDataset):
    """Tags the iterator state with the pipeline's settings, and refuses a state from another pipeline.

    Grain's state holds only positions, so restoring it into a pipeline with
    another seed, batch size, host split or shard set would silently yield other
    data; this turns that into an error.
    """

    def __init__(self, parent: grain.IterDataset, settings: dict[str, Any]):
        super().__init__(parent)
        self._settings = settings

    def __iter__(self) -> grain.DatasetIterator:
        return _StateCheckedIterator(self._parent.__iter__(), self._settings)


class _StateCheckedIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, settings: dict[str, Any]):
        super().__init__(parent)
        self._settings = settings

    def __next__(self):
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return {"loader": dict(self._settings), "grain": self._parent.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "loader" not in state or "grain" not in state:
            raise ValueError("not an iterator state saved from loaders.make_dataset (expected keys 'loader' and 'grain')")
        saved = state["loader"]
        differ = [f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in self._settings.items() if saved.get(k) != v]
        if differ:
            raise ValueError(
                "iterator state was saved from a different pipeline, so it would not resume the same data: " + "; ".join(differ)
            )
        self._parent.set_state(state["grain"])


def batches_read(state: Any) -> int | None:
    """How many batches a make_dataset iterator had yielded when it gave `state` (its get_state()):
    a saved position is checked against the step it claims (train/checkpointing/checkpoints.py). None where the
    pipeline reads in worker processes (Grain's state then is per worker). ValueError, in words,
    for what is no such state."""
    if not isinstance(state, dict) or not isinstance(state.get("loader"), dict) or not isinstance(state.get("grain"), dict):
        raise ValueError("not an iterator state saved from loaders.make_dataset (expected an object with 'loader' and "
                         "'grain' objects)")
    if state["loader"].get("worker_count"):
        return None
    position = state["grain"].get("next_index")
    if type(position) is not int or position < 0:
        from prepack.hostile_input.untrusted import shown

        raise ValueError(f"its position (grain next_index) is {shown(position)}, not a count of batches")
    return position


def make_dataset(
    path: str | ShardView,
    batch_size: int,
    seed: int,
    shard_index: int | None = None,
    shard_count: int | None = None,
    num_epochs: int | None = None,
    *,
    expected_max_length: int | None = None,
    tokenizer: TokenizerLike | None = None,
    drop_remainder: bool = True,
    read_threads: int | None = None,
    prefetch: int = PREFETCH_BATCHES,
    worker_count: int = 0,
    worker_buffer_size: int = 2,
    verify: bool = False,
    cache_dir: str | None = None,
) -> grain.IterDataset:
    """A grain.IterDataset of batches: dicts of int32 [batch_size, L] numpy arrays
    input_ids, loss_mask, valid_mask, positions, segment_ids.

    path: a shard set folder (local, gcsfuse, gs://) or an already opened ShardView.
    seed: the global shuffle seed; every host must pass the same one.
    shard_index, shard_count: this host and the number of hosts. Leave both None
      to take jax.process_index()/process_count() (0 and 1 without JAX).
    num_epochs: None repeats forever; each epoch is a new permutation.
    expected_max_length, tokenizer, verify, cache_dir: as for open_shards.
    drop_remainder: keep batches a fixed [B, L]; see HostPlan for what is dropped.
    read_threads, prefetch: Grain read threads (None: chosen by the set's location,
      see default_read_threads) and the number of batches they buffer.
      For gs:// sets every shard is also downloaded in the background from the start.
    worker_count: > 0 reads and decodes in that many processes (mp_prefetch),
      each buffering worker_buffer_size batches.
    The iterator's get_state()/set_state() resume at the exact next batch.
    """
    _check_counts(batch_size, num_epochs, worker_count)
    view = path if isinstance(path, ShardView) else open_shards(path, expected_max_length, tokenizer, verify=verify, cache_dir=cache_dir)
    if isinstance(path, ShardView) and (expected_max_length is not None or tokenizer is not None):
        view.manifest.check_compatible(expected_max_length, tokenizer_identity(tokenizer), source=view.path)
    shard_index, shard_count = resolve_host(shard_index, shard_count)
    plan = _host_plan(view, batch_size, shard_count, num_epochs, drop_remainder)
    if read_threads is None:
        read_threads = default_read_threads(view)
    if read_threads < 0:
        raise ValueError(f"read_threads must be >= 0 or None, got {read_threads}")

    # The stream is of row indices (a shuffle permutes positions, not contents), so the
    # order, host split and iterator state are those of shuffling the rows themselves.
    ds = grain.MapDataset.range(len(view))
    # Shuffle before repeat: repeat then reseeds the shuffle every epoch.
    ds = ds.shuffle(seed=seed).repeat(num_epochs)
    if plan.used_rows is not None and plan.used_rows < len(ds):
        ds = ds[: plan.used_rows]
    # Every host computes the same global order; slicing it keeps hosts disjoint.
    ds = ds[shard_index::shard_count]
    # Batch the indices, then read and decode the batch's rows in one call.
    ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=_index_array).map(view.read)
    view.prefetch(GCS_PREFETCH_DOWNLOADS)  # gs:// only: start copying every shard now
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch))
    if worker_count > 0:
        ensure_absl_flags_parsed()
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count, per_worker_buffer_size=worker_buffer_size))
    settings = {
        "state_format": STATE_FORMAT,
        "shard_set": shard_set_id(view),
        "seed": seed,
        "batch_size": batch_size,
        "shard_index": shard_index,
        "shard_count": shard_count,
        "num_epochs": num_epochs,
        "drop_remainder": drop_remainder,
        "worker_count": worker_count,
    }
    return _StateCheckedIterDataset(it_ds, settings)


def _check_counts(batch_size: int, num_epochs: int | None, worker_count: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be positive or None, got {num_epochs}")
    if worker_count < 0:
        raise ValueError(f"worker_count must be >= 0, got {worker_count}")


def _host_plan(view: ShardView, batch_size: int, shard_count: int, num_epochs: int | None, drop_remainder: bool) -> HostPlan:
    """The host's plan; refuses a set with no rows, or too few to fill one batch on every host."""
    if len(view) == 0:
        raise ShardSetError(f"{view.path}: the shard set has no rows")
    plan = HostPlan(len(view), batch_size, shard_count, num_epochs, drop_remainder)
    if plan.batches_per_host == 0:
        raise ValueError(
            f"{view.path}: {len(view)} rows x {num_epochs} epochs do not fill one batch of {batch_size} "
            f"on each of {shard_count} hosts; lower batch_size or raise num_epochs"
        )
    return plan
