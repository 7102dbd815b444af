"""The train and eval datasets of a run, from its shard sets (loaders.make_dataset)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from train.config import TrainConfig, TrainError


class FirstN:
    """Re-iterable first-n view of a re-iterable dataset (Tunix re-iterates eval_ds at every eval)."""

    def __init__(self, ds: Iterable[Any], n: int | None):
        self.ds, self.n = ds, n

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.ds), self.n)


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
    eval_ds = None
    if eval_view is not None:
        try:
            eval_ds = loaders.make_dataset(eval_view, per_host, cfg.seed, jax.process_index(), procs, 1, read_threads=cfg.read_threads)
        except ValueError as e:
            raise TrainError(f"--eval-shards {cfg.eval_shards}: {e}") from e
        eval_ds = FirstN(eval_ds, cfg.eval_batches)
    return train_ds, eval_ds
