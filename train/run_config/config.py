"""What a `prepack train` run is asked to do (TrainConfig) and the error for a run that cannot start."""

from __future__ import annotations

import dataclasses
from typing import Any


class TrainError(ValueError):
    """A training run that cannot start as configured; the message says what to change."""


@dataclasses.dataclass
class TrainConfig:
    shards: str
    model: str = "tiny"
    lora_rank: int = 8
    lora_alpha: float | None = None  # default 2 * rank
    batch_size: int = 8  # global rows per step
    steps: int = 100
    learning_rate: float = 1e-4  # the peak of the schedule
    # The learning rate per optimizer step (train/run_config/schedule.py): constant, cosine, linear or wsd,
    # after a linear warmup of warmup_steps (or warmup_ratio x steps; default none), decaying to
    # min_lr_ratio x learning_rate at the last step.
    lr_schedule: str = "constant"
    warmup_steps: int | None = None
    warmup_ratio: float | None = None
    min_lr_ratio: float = 0.0
    max_grad_norm: float = 1.0  # clip the global gradient norm to this before the update; 0: no clipping
    grad_accum_steps: int = 1  # micro-batches of batch_size rows per optimizer step (train/step/train_step.py)
    seed: int = 0
    mesh: str | None = None  # "fsdp=F,tp=T"
    eval_shards: str | None = None
    eval_every: int | None = None  # default: only before the first and after the last step
    eval_batches: int | None = None  # default: one pass over the eval set
    weights: str | None = None  # HF safetensors folder, "random", "gguf"; see train/model/models.py
    dtype: str | None = None  # parameter dtype; default per model (bf16 real, f32 tiny)
    metrics_out: str | None = None
    loss: str = "masked"  # "masked" (train/step/loss.py) or "tunix-default" (for comparisons)
    # "token": the mean over every target token of the batch; "example": the mean over the batch's
    # examples of each one's token mean (train/step/loss.py; pieces of a split example count as one).
    loss_mean: str = "token"
    # What the run trains: an objective's name (train/objectives/; None: the default), and the DPO
    # loss's beta (None: 0.1, TRL's and Tunix's default; train/objectives/dpo.py).
    objective: str | None = None
    beta: float | None = None
    read_threads: int | None = None  # None: the loader chooses by where the shards are (local disk, mount, gs://)
    config_overrides: dict[str, Any] | None = None  # e.g. {"sliding_window_size": 4} for tests
    # Every N steps the trainer fetches the steps' metrics from the device, writes their JSONL
    # records and prints a progress line (0: only at the end); steps in between are not waited for.
    log_every: int = 10
    # Checkpoints (train/checkpointing/checkpoints.py): LoRA params + optimizer state through Tunix, plus the
    # loader state, every checkpoint_every steps and at the last one; a run resumes from the latest.
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = 100
    checkpoint_keep: int = 3  # Orbax max_to_keep
    save_lora: str | None = None  # the LoRA export at the end (train/adapter_files/peft_export.py, train/adapter_files/lora_file.py)
    lora_format: str = "peft"  # peft: a Hugging Face PEFT adapter folder; prepack: one safetensors file of qwix names
    overwrite: bool = False  # replace an existing --save-lora target (otherwise refused before any weight loads)
    # QLoRA (train/model/models.py): the frozen base's projections quantized by qwix (nf4 or int8) in
    # tiles of qlora_tile_size along their contracting axes (None: chosen from the model's dims).
    qlora: str | None = None
    qlora_tile_size: int | None = None
    tensorboard: str | None = None  # a TensorBoard log folder: the JSONL's figures as scalars (train/measurement/metrics.py)
    profile_steps: str | None = None  # "A:B": a JAX profiler trace of optimizer steps A..B (train/run_config/outputs.py)
    profile_dir: str | None = None  # where the trace goes (default: the --tensorboard folder)
    nan_policy: str = "stop"  # on a non-finite loss or gradient norm: "stop" or "skip-step" (train/measurement/divergence.py)
    # The memory path (train/step/memory_path.py): chunked loss (0 = full [B, L, V] logits), attention
    # from segment ids (None = the backend's default), per-layer rematerialisation, planning.
    # By measurement (docs/benchmarks.md): on a TPU v5e Gemma3 270M's (8, 2048) step 0.988x 1024's (the
    # targets-first skip wastes half a chunk less); on a CPU the loss alone as fast as 1024, 1 GiB less.
    loss_chunk_tokens: int = 512
    loss_kernel: str = "auto"  # train/step/fused_head.py: auto | xla | fused
    lora_kernel: str = "qwix"  # train/step/fused_lora.py: qwix | fused
    attention: str | None = None  # dense | blocked | flash | splash
    attention_tile: int | None = None  # tokens per tile (blocked) or block (flash, splash); None: the kind's default
    # none | layer | auto (plan the step, remat only if it would not fit). prepack train defaults to auto;
    # the library default is none, so a caller that plans itself does not pay a second compile.
    remat: str = "none"
    # The layers as one lax.scan over their repeating period, without remat (train/step/layer_scan.py).
    scan_layers: bool = False
    memory_budget_gib: float | None = None  # None: the device's memory where JAX reports it, else 16
    # Before step 1, run the first batch packed and each of its segments alone through the
    # run's model (train/verification/parity.py) and stop if any target's log-probability differs.
    verify_first: bool = False
    # MFU's denominator: one chip's dense bf16 TFLOP/s; None: train/measurement/mfu.py's table by device kind.
    peak_tflops: float | None = None
    # --eval-generate FILE: held-out records (the set's format) generated and scored before the first
    # step, every eval_generate_every steps and after the last (train/generation/eval_generate.py).
    eval_generate: str | None = None
    eval_generate_every: int | None = None
    compile_cache: str | None = None  # --compile-cache (train/compilation/compile_cache.py): a folder, off, or None: the default
    # --compile-preload on|off (train/compilation/executable_preload.py): a repeat run's cached executables
    # loaded on threads while the run traces them.
    compile_preload: str = "on"


# The options that shape a run's compiled programs (with the shards' max length): the name of the
# record a repeat run preloads its executables from (train/compilation/executable_preload.py). Only a
# hint: an option missing here can cost a wasted background load, never a wrong program (JAX's own
# cache key decides). The learning rate, its schedule, the seed and the step count are left out: they
# are the step's inputs, not its program (train/compilation/compile_cache.py).
PROGRAM_OPTIONS = (
    "model", "weights", "dtype", "lora_rank", "lora_alpha", "batch_size", "grad_accum_steps", "mesh", "loss",
    "loss_mean", "objective", "beta", "max_grad_norm", "qlora", "qlora_tile_size", "config_overrides",
    "loss_chunk_tokens", "loss_kernel", "lora_kernel", "attention", "attention_tile", "remat", "scan_layers",
    "memory_budget_gib", "verify_first", "eval_shards", "eval_generate",
)
