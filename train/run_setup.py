"""Builds everything a `prepack train` run needs, once: shards, checks, model + LoRA, optimizer, trainer.

The order matters for the user's time: every check that can refuse the run (flags, mesh,
vocabularies, another run's checkpoint) comes before the weights are loaded.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, TextIO

from train import objectives
from train.adapter_files import adapter_scale, lora_file
from train.checkpointing import checkpoints, resume
from train.measurement import divergence
from train.run_config import outputs
from train.compilation import executable_preload
from train.run_config.config import PROGRAM_OPTIONS, TrainConfig, TrainError
from prepack.format.manifest import packing_kind
from train.measurement.metrics import MetricsRecorder
from train.model.fingerprint import base_fingerprint
from train.packed_trainer import make_trainer_class
from train.run_config.mesh import make_mesh, parse_mesh
from train.resolved_run import ResolvedRun, resolve
from train.run_config.vocab import check_vocab


@dataclasses.dataclass
class Setup:
    """Everything a run needs, built once (tests reuse it to drive steps by hand)."""

    config: TrainConfig
    view: Any
    eval_view: Any
    built: Any  # train.model.models.BuiltModel (LoRA applied)
    mesh: Any
    trainer: Any
    recorder: MetricsRecorder
    static: dict[str, Any]
    checkpoint: checkpoints.CheckpointDir | None = None
    policy: checkpoints.EveryNStepsAndLast | None = None
    resumed_step: int = 0  # the checkpoint step Tunix restored (0: a fresh start)
    base_weights: dict[str, Any] | None = None  # {"source", "fingerprint"} when checkpointing or exporting
    preload: executable_preload.Preload | None = None  # where the cache and --compile-preload are on
    run: ResolvedRun | None = None  # the run's choices, resolved once (train/resolved_run.py); setup always sets it


def enable_compile_cache(cfg: TrainConfig, say: TextIO) -> str | None:
    """--compile-cache, once the output rule has judged its folder, before any compile; the folder (None: off)."""
    from train.compilation import compile_cache

    try:
        return compile_cache.enable(cfg.compile_cache, say)
    except compile_cache.CompileCacheError as e:
        raise TrainError(str(e)) from None


def begin_preload(cfg: TrainConfig, cache: str | None, max_length: int, say: TextIO) -> executable_preload.Preload | None:
    """--compile-preload: the executables the last run of these options looked up, loading on threads."""
    if cfg.compile_preload != executable_preload.ON:
        return None
    fields = {name: getattr(cfg, name) for name in PROGRAM_OPTIONS}
    return executable_preload.begin(cache, executable_preload.hint_of({"train": fields, "max_length": max_length}), say)


def setup(cfg: TrainConfig, out: TextIO | None = None, run: ResolvedRun | None = None) -> Setup:
    """Builds the model, LoRA and trainer; with cfg.checkpoint_dir, Tunix restores the latest checkpoint here.
    run: the config's choices where the caller resolved them already (trainer.execute); else resolved here."""
    check_flags(cfg)
    run = run if run is not None else resolve(cfg)
    run.objective.check_flags(cfg)
    # A resumed run appends to its metrics: the checkpoint folder is listed only if that matters.
    outputs.check_outputs(cfg, resumes=lambda: checkpoints.holds_checkpoint(cfg.checkpoint_dir))
    say = out if out is not None else sys.stderr
    view, eval_view = open_views(cfg, run.objective)
    max_length = view.manifest.max_length
    import jax

    from train import data

    data.check_batch(cfg, view, eval_view, jax.process_count())
    from train.step import memory_path

    memory_path.check_options(cfg, max_length)
    mesh = make_mesh(parse_mesh(cfg.mesh), cfg.batch_size)
    model = check_model_for_shards(cfg, run, view, eval_view)
    qlora_tile(cfg, model.config)  # a tile the widths refuse is refused before any weight loads
    ckpt, identity = open_checkpoint(cfg, run, model, view)
    # After every check that can refuse the run (its one line stays alone), before the first compile.
    run = run.with_cache(enable_compile_cache(cfg, say))
    # Before the weights: a repeat run's executables load on threads meanwhile (train/compilation/executable_preload.py).
    preload = begin_preload(cfg, run.cache_folder, max_length, say)
    try:
        return build(cfg, run, say, out, view, eval_view, mesh, model, ckpt, identity, preload)
    except BaseException:
        executable_preload.abandon(preload)
        raise


def build(cfg: TrainConfig, run: ResolvedRun, say: TextIO, out: TextIO | None, view: Any, eval_view: Any, mesh: Any, model: ModelChoice,
          ckpt: checkpoints.CheckpointDir | None, identity: Any, preload: executable_preload.Preload | None) -> Setup:
    """setup's model, LoRA, trainer and recorder, once every check has passed and the cache is on."""
    max_length = view.manifest.max_length
    built, base_params = load_base_weights(cfg, run, model, mesh, say)
    base_weights = record_base_weights(cfg, built, ckpt, identity)
    prepare_model(cfg, model, built, mesh, max_length)
    loss_fn = step_loss_fn(cfg, run)
    static = run_static(cfg, run, view.manifest, built)
    trainer, policy = make_trainer(cfg, built, ckpt)
    resumed = int(trainer.train_steps)
    if mesh is None:
        commit_to_device(built, trainer)
    if resumed:
        print(f"resuming from step {resumed} of {ckpt.path}", file=say)
    throughput, throughput_facts = throughput_of(cfg, run, built)
    recorder = MetricsRecorder(
        cfg.metrics_out, static=static, log_every=cfg.log_every, out=out,
        resume_from=resumed or None, resume_note={"checkpoint_dir": cfg.checkpoint_dir},
        last_step=cfg.steps, nan_policy=cfg.nan_policy, throughput=throughput, grad_accum_steps=cfg.grad_accum_steps,
        tensorboard=cfg.tensorboard, objective=run.objective,
    )
    attach_step_functions(cfg, run, loss_fn, trainer, recorder, built, policy)
    extra = {**run_details(cfg, run, model, view.manifest, built, base_params), **throughput_facts}
    if ckpt is not None:
        extra.update({"checkpoint_dir": cfg.checkpoint_dir, "resumed_from_step": resumed})
    return Setup(cfg, view, eval_view, built, mesh, trainer, recorder, {**static, **extra},
                 checkpoint=ckpt, policy=policy, resumed_step=resumed, base_weights=base_weights, preload=preload, run=run)


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """The model the flags name, resolved against the shards' vocabulary (no weights yet)."""

    spec: Any  # train.model.models.ModelSpec
    config: Any  # the model's Tunix config
    vocab_size: int | None  # the shards' vocabulary size, where the manifest records it


def check_flags(cfg: TrainConfig) -> None:
    import math

    from train.run_config import options

    options.check_counts(cfg)  # every whole-number option in its range (train/run_config/options.py)
    options.check_reals(cfg)
    if not (math.isfinite(cfg.max_grad_norm) and cfg.max_grad_norm >= 0):
        raise TrainError(f"--max-grad-norm must be 0 (no clipping) or positive, got {cfg.max_grad_norm}")
    schedule_spec(cfg)
    if cfg.lora_format not in ("peft", "prepack"):
        raise TrainError(f"unknown --lora-format {cfg.lora_format!r}; choose peft or prepack")
    if cfg.compile_preload not in (executable_preload.ON, executable_preload.OFF):
        raise TrainError(f"unknown --compile-preload {cfg.compile_preload!r}; choose on or off")
    if cfg.peak_tflops is not None and not (math.isfinite(cfg.peak_tflops) and cfg.peak_tflops > 0):
        raise TrainError(f"--peak-tflops must be positive, got {cfg.peak_tflops}")
    divergence.check_policy(cfg.nan_policy)


def open_views(cfg: TrainConfig, objective: objectives.Objective) -> tuple[Any, Any]:
    import loaders

    view = loaders.open_shards(cfg.shards)
    eval_view = loaders.open_shards(cfg.eval_shards) if cfg.eval_shards else None
    objective.check_set(cfg, view.manifest, cfg.shards, "--shards")
    if eval_view is not None:
        objective.check_set(cfg, eval_view.manifest, cfg.eval_shards, "--eval-shards")
    if eval_view is not None and eval_view.manifest.max_length != view.manifest.max_length:
        raise TrainError(
            f"--eval-shards {cfg.eval_shards} has max_length {eval_view.manifest.max_length}, "
            f"--shards {cfg.shards} has {view.manifest.max_length}; pack both for the same length"
        )
    return view, eval_view


def check_model_for_shards(cfg: TrainConfig, run: ResolvedRun, view: Any, eval_view: Any) -> ModelChoice:
    """The vocabularies, checked on the config before any weights are loaded or drawn."""
    from train.model import models

    spec = run.spec
    vocab = view.manifest.tokenizer.get("vocab_size")
    vocab = int(vocab) if vocab else None
    model_config = models.resolve_config(cfg.model, vocab_size=vocab, dtype=cfg.dtype, config_overrides=cfg.config_overrides)
    model_vocab = models.config_vocab_size(model_config)
    width = int(model_config.embed_dim)
    if cfg.lora_rank > width:
        # Every adapted projection has the hidden width on one side: a rank-`width` adapter is
        # already a full-rank update, and --lora-rank 100000 asked 13.8 GB of a 64-wide model.
        raise TrainError(f"--lora-rank {cfg.lora_rank:,} is more than {cfg.model}'s hidden width {width:,}: a LoRA update of "
                         f"a {width:,}-wide projection has rank {width:,} at most; use --lora-rank {width:,} or less")
    for v, path in ((view, cfg.shards), (eval_view, cfg.eval_shards)):
        if v is not None:
            check_vocab(v.manifest.tokenizer, cfg.model, spec.family, model_vocab, path)
    return ModelChoice(spec, model_config, vocab)


def open_checkpoint(cfg: TrainConfig, run: ResolvedRun, model: ModelChoice, view: Any) -> tuple[checkpoints.CheckpointDir | None, Any]:
    if not cfg.checkpoint_dir:
        return None, None
    import jax

    ckpt = checkpoints.CheckpointDir(cfg.checkpoint_dir, jax.process_index(), jax.process_count())
    ckpt.require_backend()
    identity = resume.run_identity(cfg, run.objective, model.spec, model.config, view)
    # Refuse another run's checkpoint now, before minutes of weight loading, and one that lacks a
    # part of what a resume restores or whose loader state is another step's.
    step = ckpt.check_resumable(identity, info={"shards": cfg.shards})
    if step is not None:
        ckpt.check_complete(step, cfg.grad_accum_steps)
    return ckpt, identity


def load_base_weights(cfg: TrainConfig, run: ResolvedRun, model: ModelChoice, mesh: Any, say: TextIO) -> tuple[Any, int]:
    import jax.numpy as jnp

    from train.model import models

    name = run.dtype_name
    print(f"loading {cfg.model} weights ({models.describe_weights(model.spec, cfg.weights)}) as {name} ...", file=say, flush=True)
    started = time.perf_counter()
    built = models.build_model(
        cfg.model, weights=cfg.weights, vocab_size=model.vocab_size, dtype=cfg.dtype,
        seed=cfg.seed, mesh=mesh, config_overrides=cfg.config_overrides,
    )
    base_params = models.count_params(built.model)
    print(f"loaded {base_params:,} parameters ({base_params * jnp.dtype(name).itemsize / 1e6:,.0f} MB) "
          f"in {time.perf_counter() - started:.1f} s", file=say, flush=True)
    return built, base_params


def record_base_weights(cfg: TrainConfig, built: Any, ckpt: checkpoints.CheckpointDir | None, identity: Any) -> dict[str, Any] | None:
    """The base weights' identity, for a checkpoint or an exported LoRA; a resumed checkpoint must
    have been trained on the same ones (a random seed, a GGUF, an HF folder)."""
    if ckpt is None and not cfg.save_lora:
        return None
    base_weights = {"source": built.weights, "fingerprint": base_fingerprint(built.model)}
    if ckpt is not None and ckpt.check_resumable(identity, base_weights, info={"shards": cfg.shards}) is None:
        ckpt.write_run(identity, base_weights, {"shards": cfg.shards, "weights": built.weights, "steps": cfg.steps})
    return base_weights


def qlora_tile(cfg: TrainConfig, config: Any) -> int | None:
    """--qlora's tile size (checked against the model's widths), None without --qlora."""
    from train.model import models

    return models.qlora_tile_size(config, cfg.qlora_tile_size) if cfg.qlora else None


def prepare_model(cfg: TrainConfig, model: ModelChoice, built: Any, mesh: Any, max_length: int) -> None:
    """LoRA, sharding, the attention path and remat, in place on the base model."""
    from train.model import models
    from train.step import memory_path

    built.model = models.apply_lora(built.model, model.spec, rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed,
                                    qlora=cfg.qlora, qlora_tile=qlora_tile(cfg, model.config), lora_kernel=cfg.lora_kernel)
    models.shard_model(built.model, mesh)
    memory_path.install_attention(built.model, cfg, max_length)
    memory_path.set_remat(built.model, cfg.remat == memory_path.REMAT_LAYER, scan_layers=cfg.scan_layers)


def run_static(cfg: TrainConfig, run: ResolvedRun, manifest: Any, built: Any) -> dict[str, Any]:
    """The fields every step record carries."""
    static = {
        "model": cfg.model,
        "weights": built.weights,
        "packing": packing_kind(manifest),
        "batch_size": cfg.batch_size,
        "seq_len": manifest.max_length,
        # On every step record: which mean `loss` is (train/step/loss.py: token or example; the
        # objective's own otherwise), the objective and its options.
        **run.objective.static_fields(cfg),
        "grad_accum_steps": cfg.grad_accum_steps,  # a step trains this many micro-batches of batch_size rows
    }
    mixture = getattr(manifest, "mixture", None)
    if mixture:  # MetricsRecorder takes the names out of the static fields
        static["source_names"] = [s["name"] for s in mixture["sources"]]
    return static


def schedule_spec(cfg: TrainConfig) -> Any:
    from train.run_config import schedule

    return schedule.resolve(cfg.lr_schedule, cfg.learning_rate, cfg.steps, cfg.warmup_steps, cfg.warmup_ratio,
                            cfg.min_lr_ratio)


def make_trainer(cfg: TrainConfig, built: Any, ckpt: checkpoints.CheckpointDir | None) -> tuple[Any, checkpoints.EveryNStepsAndLast | None]:
    from tunix.sft import peft_trainer

    from train.run_config import schedule
    from train.step import optimizer as optimizer_lib

    optimizer = optimizer_lib.adamw(schedule.make_schedule(schedule_spec(cfg)), max_grad_norm=cfg.max_grad_norm,
                                    skip_nonfinite=cfg.nan_policy == divergence.SKIP_STEP)
    policy = checkpoints.EveryNStepsAndLast(cfg.checkpoint_every, cfg.steps) if ckpt is not None else None
    training_config = peft_trainer.TrainingConfig(
        eval_every_n_steps=cfg.eval_every or cfg.steps,
        max_steps=cfg.steps,
        # Tunix's own checkpointing: it saves nnx.LoRAParam + optimizer state when the policy
        # says so and restores the latest step in the constructor below.
        checkpoint_root_directory=ckpt.tunix_root if ckpt is not None else None,
        checkpointing_options=checkpoints.checkpoint_options(policy, cfg.checkpoint_keep) if policy is not None else None,
        metrics_logging_options=None,  # in memory only; our JSONL (and --tensorboard) is the record
        profiler_options=outputs.profiler_options(cfg),
        pbar_description=None,
    )
    cls = make_trainer_class()
    if ckpt is None:
        return cls(built.model, optimizer, training_config), policy
    step = ckpt.latest_step()
    try:  # Tunix restores the latest checkpoint here
        trainer = cls(built.model, optimizer, training_config)
    except Exception as e:  # noqa: BLE001  (Orbax's errors on truncated files: 150 lines of traceback)
        if step is None:
            raise
        raise checkpoints.CheckpointError(ckpt.restore_problem(step, e)) from e
    resumed = int(trainer.train_steps)
    if resumed:  # a checkpoint is read as any adapter is: its LoRA values finite and their update too, or the run stops here
        tensors = lora_file.lora_tensors(built.model)
        where = f"--checkpoint-dir {ckpt.path}: step {resumed}"
        lora_file.check_finite(tensors, where, f"{ckpt.remedy(resumed)}")
        alpha = cfg.lora_alpha if cfg.lora_alpha is not None else 2.0 * cfg.lora_rank  # run.json's, checked equal
        adapter_scale.check(alpha, cfg.lora_rank, adapter_scale.qwix_pairs(tensors), config_at=ckpt.run_path,
                            tensors_at=where, alpha_field="lora_alpha", rank_field="lora_rank", remedy=ckpt.remedy(resumed))
    problem = checkpoints.optimizer_problem(trainer.optimizer, resumed) if resumed else None
    if problem:
        raise checkpoints.CheckpointError(f"--checkpoint-dir {ckpt.path}: step {resumed} was restored, but {problem}; "
                                          f"{ckpt.remedy(resumed)}")
    return trainer, policy


def commit_to_device(built: Any, trainer: Any) -> None:
    """Commits model and optimizer state to the one device. jit keys its lowering on which inputs
    are committed: all-uncommitted (a fresh run) compiles as all-committed (every later step), but
    Orbax restores LoRA params and optimizer state committed beside uncommitted base weights, and
    that mix compiled the step a second time at the next step (measured: +3.8 s on the tiny CPU
    model, minutes for a real model on a TPU)."""
    import jax
    from flax import nnx

    device = jax.devices()[0]
    nnx.update(built.model, jax.device_put(nnx.state(built.model), device))
    nnx.update(trainer.optimizer, jax.device_put(nnx.state(trainer.optimizer), device))


def throughput_of(cfg: TrainConfig, run: ResolvedRun, built: Any) -> tuple[Any, dict[str, Any]]:
    """MFU's inputs (train/measurement/mfu.py): the model's FLOP cost, this process's chips and their peak."""
    import jax

    from train.measurement import mfu

    return mfu.for_run(built.model, jax.devices()[0].device_kind, jax.local_device_count(), cfg.peak_tflops,
                       run.objective.extra_forwards)


def step_loss_fn(cfg: TrainConfig, run: ResolvedRun) -> Any:
    """The objective's loss as the options choose it, computed in the run's compute dtype."""
    from train.step import precision

    return precision.in_compute_dtype(run.objective.loss_fn(cfg), run.compute_dtype)


def attach_step_functions(cfg: TrainConfig, run: ResolvedRun, loss_fn: Any, trainer: Any, recorder: MetricsRecorder, built: Any,
                          policy: checkpoints.EveryNStepsAndLast | None) -> None:
    from train.step import memory_path

    profile = outputs.profile_range(cfg)
    eval_every = cfg.eval_every if cfg.eval_shards else None

    def fetch_before(step: int) -> bool:
        """Steps whose results must be read before Tunix goes on: a checkpoint save (nothing of a
        non-finite step is saved), an eval, a profile's last step, the last step."""
        return (step == cfg.steps or (policy is not None and policy.wants(step))
                or bool(eval_every and step % eval_every == 0) or (profile is not None and step == profile[1]))

    objective = run.objective
    trainer.configure(loss_fn=loss_fn, gen_model_input_fn=objective.model_input_fn(memory_path.gen_model_input_fn(cfg)),
                      recorder=recorder, vocab_size=built.vocab_size, loss_mean=cfg.loss_mean,
                      grad_accum_steps=cfg.grad_accum_steps, max_grad_norm=cfg.max_grad_norm, fetch_before=fetch_before,
                      sums=objective.step_sums(),
                      keep_last_finite=bool(cfg.save_lora) and cfg.nan_policy == divergence.STOP)


def run_details(cfg: TrainConfig, run: ResolvedRun, model: ModelChoice, manifest: Any, built: Any, base_params: int) -> dict[str, Any]:
    """The run's summary fields beside the static ones: sizes, devices, dtypes, options."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from train.model import models
    from train.step import precision

    return {
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
        "dtype": run.dtype_name,
        "lora_dtype": jnp.dtype(precision.LORA_DTYPE).name,
        "nan_policy": cfg.nan_policy,
        "loss_chunk_tokens": cfg.loss_chunk_tokens,
        "attention": run.attention,
        "lr_schedule": schedule_spec(cfg).identity(),
        "max_grad_norm": cfg.max_grad_norm,
        "qlora": cfg.qlora,
        "qlora_tile_size": qlora_tile(cfg, model.config),
    }
