"""How a checkpointed `prepack train` run resumes: the run identity it must match, and the data stream.

Resuming. PeftTrainer restores the latest step in its constructor and then, in train(),
re-reads and discards `iter_steps` batches from a fresh iterator (its TODO says so: it
skips rather than restores the iterator). Our loader can seek instead (`set_state`), which
costs nothing however far the run got. To keep Tunix's loop unchanged and still not re-read
anything, the trainer is handed a `ResumableStream`: `iter_steps` placeholders first (what
Tunix's skip discards, read from nowhere), then the loader iterator already positioned after
the restored step. Tunix therefore sees the same number of elements it expects to skip and the
first real batch it trains on is exactly the one that followed the checkpoint. Should a
future Tunix stop skipping, a placeholder would reach the step and the trainer refuses it
(train/packed_trainer.py) instead of training on the wrong batch. If a step has no saved loader
state (a checkpoint written by something else), the stream starts at batch 0 with no
placeholders and Tunix's own skipping positions it: slower, still exact, since the order is
a function of (shard set, seed, batch size, hosts), all of which run.json pins.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

from train.checkpointing import checkpoints
from train.checkpointing.checkpoints import CheckpointError
from train.run_config.config import TrainConfig, TrainError

log = logging.getLogger(__name__)


class _Placeholder:
    """What Tunix's post-restore skip consumes instead of re-read batches."""

    def __repr__(self) -> str:
        return "<batch skipped by Tunix after a restore; never read>"


PLACEHOLDER = _Placeholder()


class ResumableStream:
    """The train iterable handed to PeftTrainer.train: `placeholders` placeholders, then the loader iterator.

    `consumed` counts real batches since the start of the data stream (the restored step
    included), and the loader state after each of the last few is kept, so that a save for
    step s records the state after exactly s batches even when Tunix has already pulled the
    next batch (it reads one batch past max_steps before it stops, then saves in close()).
    """

    KEEP = 4

    def __init__(self, iterator: Any, *, consumed: int = 0, placeholders: int = 0):
        self._it = iterator
        self._placeholders = placeholders
        self.consumed = consumed
        self._states: dict[int, dict[str, Any]] = {consumed: iterator.get_state()}
        self._iterated = False

    def __iter__(self) -> Iterator[Any]:
        # Tunix calls iter() once per train(); a second pass would not restart the data.
        if self._iterated:
            raise RuntimeError("a ResumableStream is iterated once; build a new one for another train() call")
        self._iterated = True
        return self

    def __next__(self) -> Any:
        if self._placeholders:
            self._placeholders -= 1
            return PLACEHOLDER
        batch = next(self._it)
        self.consumed += 1
        self._states[self.consumed] = self._it.get_state()
        for old in [k for k in self._states if k <= self.consumed - self.KEEP]:
            del self._states[old]
        return batch

    def state_after(self, step: int) -> dict[str, Any]:
        try:
            return self._states[step]
        except KeyError:
            raise CheckpointError(
                f"no loader state recorded after batch {step} (have {sorted(self._states)}); "
                "the trainer saved a step the data stream did not reach"
            ) from None


def run_identity(cfg: TrainConfig, objective: Any, spec: Any, config: Any, view: Any) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint (see checkpoints.IDENTITY_LABELS); objective: the
    run's (train/objectives/), as resolved once (train/resolved_run.py)."""
    import jax
    import jax.numpy as jnp

    from loaders.dataset import shard_set_id
    from train.model import models
    from train.run_config import schedule
    from train.step import precision

    return {
        "model": cfg.model,
        "dtype": jnp.dtype(getattr(config, "param_dtype", None) or jnp.float32).name,
        "vocab_size": models.config_vocab_size(config),
        "config_overrides": dict(cfg.config_overrides or {}),
        "lora_rank": cfg.lora_rank,
        "lora_alpha": float(cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_rank),
        "lora_module_path": spec.lora_module_path,
        "shard_set": shard_set_id(view),
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "processes": jax.process_count(),
        # inject_hyperparams keeps the learning rate in the optimizer state, so a restore would
        # silently bring back the old one; the loss changes what the gradients mean.
        "learning_rate": cfg.learning_rate,
        "loss": cfg.loss,
        "loss_mean": cfg.loss_mean,
        "objective": objective.identity(cfg),
        # float32 adapters since mixed precision (train/step/precision.py); skip-step adds
        # apply_if_finite's counters to the optimizer state, so its layout differs.
        "lora_dtype": jnp.dtype(precision.LORA_DTYPE).name,
        "nan_policy": cfg.nan_policy,
        # The schedule's curve (its count is in the optimizer state), clipping, and how many
        # micro-batches make a step (the loader state of step s is after s * K batches).
        "lr_schedule": schedule.resolve(cfg.lr_schedule, cfg.learning_rate, cfg.steps, cfg.warmup_steps,
                                        cfg.warmup_ratio, cfg.min_lr_ratio).identity(),
        "max_grad_norm": float(cfg.max_grad_norm),
        "grad_accum_steps": cfg.grad_accum_steps,
        # QLoRA's quantized base is another base: the adapters trained on it belong to it.
        "qlora": None if not cfg.qlora else {"qtype": cfg.qlora, "tile_size": models.qlora_tile_size(config, cfg.qlora_tile_size)},
    }


def checkpointed_stream(
    trainer: Any,
    checkpoint: checkpoints.CheckpointDir,
    policy: checkpoints.EveryNStepsAndLast,
    resumed_step: int,
    keep: int,
    train_ds: Iterable[Any],
) -> ResumableStream:
    """The train iterable for a checkpointed run, positioned after the restored step without re-reading.

    Tunix (0.1.7) restores model and optimizer in its constructor, then discards
    trainer.iter_steps elements of the train iterable before training. We hand it that many
    placeholders followed by the loader iterator set to the saved state, so its skip costs
    nothing and does not move the data a second time. And we wrap its checkpoint manager so
    every save writes the loader state for that step first (checkpoints.DataStateCheckpoints).
    """
    it = iter(train_ds)
    k = resumed_step
    if trainer.iter_steps != k:
        # Tunix's own accumulation would make it skip k * G elements; ours stacks a step's K
        # micro-batches into one element (train/data.py), so it skips exactly k.
        raise TrainError(f"Tunix restored {k} steps but will skip {trainer.iter_steps} elements; its "
                         "gradient_accumulation_steps must stay unset (--grad-accum-steps stacks micro-batches instead)")
    if not k:
        stream = ResumableStream(it)
    else:
        state = checkpoint.load_data_state(k)
        if state is None:
            log.warning(
                "%s: no loader state for step %d; Tunix will re-read and skip %d batches (exact, since run.json "
                "pins shards, seed and batch size, but slower)", checkpoint.path, k, k,
            )
            stream = ResumableStream(it)
        else:
            try:
                it.set_state(state)
            except ValueError as e:
                raise CheckpointError(f"{checkpoint.data_path}: step {k}: {e}") from e
            stream = ResumableStream(it, consumed=k, placeholders=trainer.iter_steps)
    trainer.checkpoint_manager = checkpoints.DataStateCheckpoints(trainer.checkpoint_manager, checkpoint, stream, policy, keep=keep)
    return stream
