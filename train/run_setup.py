"""Builds everything a `prepack train` run needs, once: shards, checks, model + LoRA, optimizer, trainer.

The order matters for the user's time: every check that can refuse the run (flags, mesh,
vocabularies, another run's checkpoint) comes before the weights are loaded.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, TextIO

from train import checkpoints, divergence, resume
from train.config import TrainConfig, TrainError
from train.data import packing_kind
from train.fingerprint import base_fingerprint
from train.mesh import make_mesh, parse_mesh
from train.metrics import MetricsRecorder
from train.packed_trainer import make_trainer_class
from train.vocab import check_vocab


@dataclasses.dataclass
class Setup:
    """Everything a run needs, built once (tests reuse it to drive steps by hand)."""

    config: TrainConfig
    view: Any
    eval_view: Any
    built: Any  # train.models.BuiltModel (LoRA applied)
    mesh: Any
    trainer: Any
    recorder: MetricsRecorder
    static: dict[str, Any]
    checkpoint: checkpoints.CheckpointDir | None = None
    policy: checkpoints.EveryNStepsAndLast | None = None
    resumed_step: int = 0  # the checkpoint step Tunix restored (0: a fresh start)
    base_weights: dict[str, Any] | None = None  # {"source", "fingerprint"} when checkpointing or exporting


def setup(cfg: TrainConfig, out: TextIO | None = None) -> Setup:
    """Builds the model, LoRA and trainer; with cfg.checkpoint_dir, Tunix restores the latest checkpoint here."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.sft import peft_trainer

    import loaders
    from train import memory_path
    from train import models, precision
    from train import optimizer as optimizer_lib

    if cfg.steps < 1:
        raise TrainError(f"--steps must be positive, got {cfg.steps}")
    if cfg.batch_size < 1:
        raise TrainError(f"--batch-size must be positive, got {cfg.batch_size}")
    if cfg.checkpoint_every is not None and cfg.checkpoint_every < 1:
        raise TrainError(f"--checkpoint-every must be positive, got {cfg.checkpoint_every}")
    if cfg.checkpoint_keep < 1:
        raise TrainError(f"--checkpoint-keep must be positive, got {cfg.checkpoint_keep}")
    divergence.check_policy(cfg.nan_policy)
    say = out if out is not None else sys.stderr
    view = loaders.open_shards(cfg.shards)
    eval_view = loaders.open_shards(cfg.eval_shards) if cfg.eval_shards else None
    manifest = view.manifest
    if eval_view is not None and eval_view.manifest.max_length != manifest.max_length:
        raise TrainError(
            f"--eval-shards {cfg.eval_shards} has max_length {eval_view.manifest.max_length}, "
            f"--shards {cfg.shards} has {manifest.max_length}; pack both for the same length"
        )

    memory_path.check_options(cfg, manifest.max_length)
    mesh = make_mesh(parse_mesh(cfg.mesh), cfg.batch_size)
    spec = models.get_spec(cfg.model)
    vocab = manifest.tokenizer.get("vocab_size")
    vocab = int(vocab) if vocab else None
    # Check the vocabularies on the config, before loading or drawing any weights.
    model_config = models.resolve_config(cfg.model, vocab_size=vocab, dtype=cfg.dtype, config_overrides=cfg.config_overrides)
    model_vocab = models.config_vocab_size(model_config)
    for v, path in ((view, cfg.shards), (eval_view, cfg.eval_shards)):
        if v is not None:
            check_vocab(v.manifest.tokenizer, cfg.model, spec.family, model_vocab, path)

    ckpt = identity = None
    if cfg.checkpoint_dir:
        ckpt = checkpoints.CheckpointDir(cfg.checkpoint_dir, jax.process_index(), jax.process_count())
        ckpt.require_backend()
        identity = resume.run_identity(cfg, spec, model_config, view)
        # Refuse another run's checkpoint now, before minutes of weight loading.
        ckpt.check_resumable(identity, info={"shards": cfg.shards})

    dtype_name = jnp.dtype(models.parse_dtype(cfg.dtype, spec.default_dtype)).name
    print(f"loading {cfg.model} weights ({models.describe_weights(spec, cfg.weights)}) as {dtype_name} ...", file=say, flush=True)
    started = time.perf_counter()
    built = models.build_model(
        cfg.model, weights=cfg.weights, vocab_size=vocab, dtype=cfg.dtype,
        seed=cfg.seed, mesh=mesh, config_overrides=cfg.config_overrides,
    )
    base_params = models.count_params(built.model)
    print(f"loaded {base_params:,} parameters ({base_params * jnp.dtype(dtype_name).itemsize / 1e6:,.0f} MB) "
          f"in {time.perf_counter() - started:.1f} s", file=say, flush=True)
    base_weights = None
    if ckpt is not None or cfg.save_lora:
        base_weights = {"source": built.weights, "fingerprint": base_fingerprint(built.model)}
    if ckpt is not None:
        # Same base weights as the checkpoint's LoRA was trained on (a random seed, a GGUF, an HF folder).
        if ckpt.check_resumable(identity, base_weights, info={"shards": cfg.shards}) is None:
            ckpt.write_run(identity, base_weights, {"shards": cfg.shards, "weights": built.weights, "steps": cfg.steps})
    built.model = models.apply_lora(built.model, spec, rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed)
    models.shard_model(built.model, mesh)
    memory_path.install_attention(built.model, cfg, manifest.max_length)
    memory_path.set_remat(built.model, cfg.remat == memory_path.REMAT_LAYER)

    loss_fn = memory_path.loss_fn(cfg)
    loss_fn = precision.in_compute_dtype(loss_fn, models.parse_dtype(cfg.dtype, spec.default_dtype))

    static = {
        "model": cfg.model,
        "weights": built.weights,
        "packing": packing_kind(manifest),
        "batch_size": cfg.batch_size,
        "seq_len": manifest.max_length,
        # On every step record: which mean `loss` is (train/loss.py), token or example.
        "loss_mean": cfg.loss_mean,
    }
    mixture = getattr(manifest, "mixture", None)
    if mixture:  # MetricsRecorder takes the names out of the static fields
        static["source_names"] = [s["name"] for s in mixture["sources"]]
    optimizer = optimizer_lib.adamw(cfg.learning_rate, skip_nonfinite=cfg.nan_policy == divergence.SKIP_STEP)
    policy = checkpoints.EveryNStepsAndLast(cfg.checkpoint_every, cfg.steps) if ckpt is not None else None
    training_config = peft_trainer.TrainingConfig(
        eval_every_n_steps=cfg.eval_every or cfg.steps,
        max_steps=cfg.steps,
        # Tunix's own checkpointing: it saves nnx.LoRAParam + optimizer state when the policy
        # says so and restores the latest step in the constructor below.
        checkpoint_root_directory=ckpt.tunix_root if ckpt is not None else None,
        checkpointing_options=checkpoints.checkpoint_options(policy, cfg.checkpoint_keep) if policy is not None else None,
        metrics_logging_options=None,  # in memory only; our JSONL is the record
        pbar_description=None,
    )
    trainer = make_trainer_class()(built.model, optimizer, training_config)
    resumed = int(trainer.train_steps)
    if mesh is None:
        # Commit model and optimizer state to the device. jit keys its lowering on which inputs
        # are committed: all-uncommitted (a fresh run) compiles as all-committed (every later
        # step), but Orbax restores LoRA params and optimizer state committed beside uncommitted
        # base weights, and that mix compiled the step a second time at the next step
        # (measured: +3.8 s on the tiny CPU model, minutes for a real model on a TPU).
        device = jax.devices()[0]
        nnx.update(built.model, jax.device_put(nnx.state(built.model), device))
        nnx.update(trainer.optimizer, jax.device_put(nnx.state(trainer.optimizer), device))
    if resumed:
        print(f"resuming from step {resumed} of {ckpt.path}", file=say)
    recorder = MetricsRecorder(
        cfg.metrics_out, static=static, log_every=cfg.log_every, out=out,
        resume_from=resumed or None, resume_note={"checkpoint_dir": cfg.checkpoint_dir},
        last_step=cfg.steps, nan_policy=cfg.nan_policy,
    )
    trainer.recorder = recorder
    trainer.vocab_size = built.vocab_size
    trainer.with_gen_model_input_fn(memory_path.gen_model_input_fn(cfg))
    trainer.with_loss_fn(loss_fn, has_aux=True)
    extra = {
        "shards": cfg.shards,
        "manifest_packing": getattr(manifest, "packing", None),
        "lora_rank": cfg.lora_rank,
        "learning_rate": cfg.learning_rate,
        "params": base_params,
        "lora_params": models.count_params(built.model, nnx.LoRAParam),
        "vocab_size": built.vocab_size,
        "mesh": cfg.mesh,
        "devices": jax.device_count(),
        "platform": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "loss_fn": cfg.loss,
        "dtype": dtype_name,
        "lora_dtype": jnp.dtype(precision.LORA_DTYPE).name,
        "nan_policy": cfg.nan_policy,
        "loss_chunk_tokens": cfg.loss_chunk_tokens,
        "attention": memory_path.attention_kind(cfg),
    }
    if ckpt is not None:
        extra.update({"checkpoint_dir": cfg.checkpoint_dir, "resumed_from_step": resumed})
    return Setup(cfg, view, eval_view, built, mesh, trainer, recorder, {**static, **extra},
                 checkpoint=ckpt, policy=policy, resumed_step=resumed, base_weights=base_weights)
