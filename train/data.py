"""The train and eval datasets of a run, from its shard sets (loaders.make_dataset); K micro-batches per step."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from train.run_config.config import TrainConfig, TrainError


class FirstN:
    """Re-iterable first-n view of a re-iterable dataset (Tunix re-iterates eval_ds at every eval)."""

    def __init__(self, ds: Iterable[Any], n: int | None):
        self.ds, self.n = ds, n

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.ds), self.n)


class MicroBatches:
    """K consecutive loader batches as one optimizer step's batch: every field [B, K, L] (the
    micro-batches on axis 1, so Tunix still shards axis 0, the rows; train/step/train_step.py scans axis 1).

    Its iterator's get_state/set_state are the loader's own: the state after n elements is the
    loader's after n * K batches, so checkpoints and resume (train/checkpointing/resume.py) stay exact."""

    def __init__(self, ds: Iterable[Any], k: int):
        self.ds, self.k = ds, k

    def __iter__(self) -> "_MicroBatchIterator":
        return _MicroBatchIterator(iter(self.ds), self.k)


class _MicroBatchIterator:
    def __init__(self, it: Any, k: int):
        self._it, self._k = it, k

    def __iter__(self) -> "_MicroBatchIterator":
        return self

    def __next__(self) -> dict[str, Any]:
        import numpy as np

        batches = [next(self._it) for _ in range(self._k)]
        return {key: np.stack([b[key] for b in batches], axis=1) for key in batches[0]}

    def get_state(self) -> Any:
        return self._it.get_state()

    def set_state(self, state: Any) -> None:
        self._it.set_state(state)


def first_micro_batch(batch: dict[str, Any], grad_accum_steps: int) -> dict[str, Any]:
    """A step's first [B, L] micro-batch (the batch itself without accumulation)."""
    return {k: v[:, 0] for k, v in batch.items()} if grad_accum_steps > 1 else batch


def host_memory_bytes() -> int | None:
    """This machine's physical memory, where the OS tells it."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_batch(cfg: TrainConfig, view: Any, eval_view: Any = None, processes: int = 1) -> None:
    """Refuses, before any weight loads, a batch the sets cannot fill without repeating rows in one
    step, or that this host's loader could not hold (--batch-size 10^9 tried to allocate 477 GiB)."""
    from loaders.dataset import PREFETCH_BATCHES
    from prepack.format import rowformat

    per_step = cfg.batch_size * cfg.grad_accum_steps
    rows = len(view)
    if per_step > rows:
        accum = f" x --grad-accum-steps {cfg.grad_accum_steps} = {per_step:,}" if cfg.grad_accum_steps > 1 else ""
        raise TrainError(
            f"--batch-size {cfg.batch_size:,}{accum} rows per step is more than the {rows:,} rows of --shards {cfg.shards}: "
            f"each step would train {min(per_step - rows, rows):,} of them twice or more; use at most {rows:,} rows per step")
    if eval_view is not None and len(eval_view) < cfg.batch_size:
        raise TrainError(f"--eval-shards {cfg.eval_shards} holds {len(eval_view):,} rows, fewer than one batch of --batch-size "
                         f"{cfg.batch_size:,}: eval would have no batch; give a larger eval set or a smaller --batch-size")
    # The read threads decode up to PREFETCH_BATCHES micro-batches ahead; a step stacks K of them.
    batch_bytes = -(-cfg.batch_size // processes) * rowformat.record_size(view.max_length, view.manifest.format_version)
    held = batch_bytes * (PREFETCH_BATCHES + 2 * cfg.grad_accum_steps)
    memory = host_memory_bytes()
    if memory is not None and held > memory:
        raise TrainError(
            f"--batch-size {cfg.batch_size:,} at max_length {view.max_length:,}: this host's loader holds up to "
            f"{PREFETCH_BATCHES + 2 * cfg.grad_accum_steps} batches of {_size(batch_bytes)} each "
            f"({_size(held)}), more than its {_size(memory)} of memory; lower --batch-size")


def _size(n: int) -> str:
    unit = next(u for u in ("GiB", "MiB", "KiB") if n >= {"GiB": 2**30, "MiB": 2**20, "KiB": 0}[u])
    return f"{n / {'GiB': 2**30, 'MiB': 2**20, 'KiB': 2**10}[unit]:,.1f} {unit}"


def datasets(cfg: TrainConfig, view: Any, eval_view: Any = None) -> tuple[Any, Any]:
    """The train dataset (endless, this host's share of each global batch) and the eval one (one pass, or None)."""
    import jax

    import loaders

    procs = jax.process_count()
    if cfg.batch_size % procs:
        raise TrainError(f"--batch-size {cfg.batch_size} must be divisible by the {procs} processes")
    per_host = cfg.batch_size // procs
    train_ds = loaders.make_dataset(
        view, per_host, cfg.seed, jax.process_index(), procs, None, read_threads=cfg.read_threads
    )
    if cfg.grad_accum_steps > 1:
        train_ds = MicroBatches(train_ds, cfg.grad_accum_steps)
    eval_ds = None
    if eval_view is not None:
        try:
            eval_ds = loaders.make_dataset(eval_view, per_host, cfg.seed, jax.process_index(), procs, 1, read_threads=cfg.read_threads)
        except ValueError as e:
            raise TrainError(f"--eval-shards {cfg.eval_shards}: {e}") from e
        eval_ds = FirstN(eval_ds, cfg.eval_batches)
    return train_ds, eval_ds
