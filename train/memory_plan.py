"""`prepack train --plan-memory` and `--remat auto`: XLA's plan of the train step, before training.

The step is Tunix's own jitted train step (train/measurement/compiled.py), compiled for the shard set's L
and the run's batch size, model, dtype, attention and loss options, and not run here: it is the
trainer's own jit that is compiled, so a run's step 1 reuses the executable instead of compiling
it again (under `--remat auto` the step is compiled once, or twice when remat must be switched
on: without remat, then with it, the run's executable; their time is charged to step 1). What XLA
plans (arguments, temporaries, a peak estimate) is printed, with the step's FLOPs counted
analytically (train/measurement/flops.py: the model's shapes, the attention work of the set's first
batches' real segments, the loss path, LoRA and remat). XLA's own FLOP estimate is printed
beside it as `xla_flops`: it counts each loop body once (the layer scan, the loss chunks,
blocked attention's tiles) and a Pallas kernel as nothing, so it is right only for a
loop-free step (`--attention dense --loss-chunk-tokens 0 --remat none`).

A step found too large without remat (over the budget, or refused by a TPU's compiler) is
remembered beside the compilation cache (train/compilation/unfit_steps.py): a later run of it skips that
compile and plans only the step with remat.
"""

from __future__ import annotations

import dataclasses
import fractions
import json
from typing import Any, TextIO

import numpy as np

GIB = 1024**3
# When JAX reports no device memory (CPU): the size of common accelerators' memory (v5e: 16 GiB).
FALLBACK_BUDGET_GIB = 16.0


# How many of the run's first batches the attention work is read from.
FLOP_SAMPLE_BATCHES = 4


@dataclasses.dataclass(frozen=True)
class StepPlan:
    argument_bytes: int
    temp_bytes: int
    peak_bytes: int
    xla_flops: float  # XLA's cost analysis: loop bodies once, Pallas kernels zero
    compile_s: float

    def fits(self, budget_bytes: int) -> bool:
        return self.peak_bytes <= budget_bytes

    def as_json(self) -> dict[str, Any]:
        return {"argument_bytes": self.argument_bytes, "temp_bytes": self.temp_bytes,
                "peak_bytes": self.peak_bytes, "xla_flops": self.xla_flops}


def budget_bytes(memory_budget_gib: float | None) -> tuple[int, str]:
    """(bytes, where the figure comes from): the flag, else the device's memory, else 16 GiB."""
    import jax

    if memory_budget_gib is not None:
        # Exact: any finite budget is one (1e300 * GiB is inf as a float, and int(inf) a traceback).
        return int(fractions.Fraction(memory_budget_gib) * GIB), "--memory-budget-gib"
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001  (backends without memory_stats raise various errors)
        stats = {}
    limit = stats.get("bytes_limit")
    if limit:
        return int(limit), f"{jax.devices()[0].device_kind} memory"
    return int(FALLBACK_BUDGET_GIB * GIB), "default (JAX reports no device memory)"


def device_peak_bytes() -> int | None:
    """The most device memory this process has held at once (the largest of its local devices'
    peak_bytes_in_use); None where the backend reports none (a CPU)."""
    import jax

    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats() or {}
        except Exception:  # noqa: BLE001  (backends without memory_stats raise various errors)
            stats = {}
        if stats.get("peak_bytes_in_use") is not None:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def placeholder_batch(batch_size: int, max_length: int, mixture: bool, grad_accum_steps: int = 1,
                      pairs: bool = False) -> dict[str, np.ndarray]:
    """Shapes are all a compile needs: one full segment per row ([B, K, L] with K micro-batches);
    a preference set's rows (pairs) hold one pair, its two sides the row's halves, with `pair_side`."""
    shape = (batch_size, grad_accum_steps, max_length) if grad_accum_steps > 1 else (batch_size, max_length)
    batch = {"input_ids": np.zeros(shape, np.int32), "loss_mask": np.ones(shape, np.int32),
             "positions": np.broadcast_to(np.arange(max_length, dtype=np.int32), shape).copy(),
             "segment_ids": np.ones(shape, np.int32)}
    if pairs:
        half = max_length // 2
        batch["segment_ids"][..., half:] = 2
        batch["positions"][..., half:] -= half
        batch["pair_side"] = batch["segment_ids"].copy()
    if mixture:
        batch["source_ids"] = np.ones(shape, np.int32)
    return batch


def set_kind(manifest: Any) -> dict[str, bool]:
    """What a set's rows carry beyond format 1 that changes the step: a mixture's source ids, pairs."""
    from prepack.format.rowformat import has_pairs

    return {"mixture": bool(getattr(manifest, "mixture", None)), "pairs": has_pairs(int(manifest.format_version))}


def plan_step(trainer: Any, batch_size: int, max_length: int, mixture: bool = False, grad_accum_steps: int = 1,
              pairs: bool = False, lowered: Any = None) -> StepPlan:
    """The step's plan, compiled from `lowered` when the caller lowered it already (lower_step)."""
    import time

    from train.measurement import compiled

    started = time.perf_counter()
    if lowered is None:
        lowered = lower_step(trainer, batch_size, max_length, mixture, grad_accum_steps, pairs)
    program = lowered.compile()
    memory = compiled.memory_of(program, time.perf_counter() - started, fingerprint=False)
    return StepPlan(memory.argument_bytes, memory.temp_bytes, memory.peak_estimate_bytes,
                    compiled.flops_of(program), memory.compile_s)


def lower_step(trainer: Any, batch_size: int, max_length: int, mixture: bool = False, grad_accum_steps: int = 1,
               pairs: bool = False) -> Any:
    from train.measurement import compiled

    return compiled.lower_trainers_step(trainer, placeholder_batch(batch_size, max_length, mixture, grad_accum_steps, pairs))


@dataclasses.dataclass(frozen=True)
class RematChoice:
    """--remat auto's decision: the plan of the step the run will execute, whether it remats, and
    the seconds spent planning (the compiles step 1 would otherwise do, charged to it)."""

    plan: StepPlan
    remat_on: bool
    seconds: float


def plan_run_step(setup: Any, lowered: Any = None) -> StepPlan:
    """The run's own step, compiled through its trainer for the set's shapes (step 1 reuses it)."""
    cfg, manifest = setup.config, setup.view.manifest
    return plan_step(setup.trainer, cfg.batch_size, manifest.max_length, grad_accum_steps=cfg.grad_accum_steps,
                     lowered=lowered, **set_kind(manifest))


def lower_run_step(setup: Any) -> Any:
    cfg, manifest = setup.config, setup.view.manifest
    return lower_step(setup.trainer, cfg.batch_size, manifest.max_length, grad_accum_steps=cfg.grad_accum_steps,
                      **set_kind(manifest))


def choose_remat(setup: Any, out: TextIO) -> RematChoice | None:
    """--remat auto: plan without remat; rematerialise each layer only if that does not fit, and then
    plan (compile) the step with remat, the one the run executes."""
    import time

    from train.compilation import unfit_steps
    from train.step import memory_path

    cfg = setup.config
    if cfg.remat != memory_path.REMAT_AUTO:
        return None
    started = time.perf_counter()
    budget, source = budget_bytes(cfg.memory_budget_gib)
    folder = setup.run.cache_folder  # the folder setup enabled (train/resolved_run.py); None: off
    lowered = lower_run_step(setup)
    # The key prints the whole lowered step (a second or so for an unrolled model): only where a verdict may be found.
    key = unfit_steps.step_key(lowered) if folder and unfit_steps.any_remembered(folder) else None
    known = unfit_steps.recall(folder, key, budget) if key else None
    if known is not None:
        # The compile without remat was refused or over budget before: not paid again (train/compilation/unfit_steps.py).
        on, planned = True, (f"{known.planned} (remembered from an earlier run: "
                             f"{unfit_steps.path_of(folder, key)}; delete it to plan again)")
    else:
        plan, planned = plan_without_remat(setup, lowered)
        on = plan is None or not plan.fits(budget)
        if on and folder:
            key = key or unfit_steps.step_key(lowered)
            try:
                unfit_steps.remember(folder, unfit_steps.UnfitStep(key, budget, planned))
            except OSError as e:  # the run goes on; the next one plans this step again
                print(f"--remat auto: could not remember that the step does not fit without remat "
                      f"({unfit_steps.path_of(folder, key)}: {e.strerror or e})", file=out, flush=True)
    print(f"--remat auto: the step plans {planned} without remat, budget {budget / GIB:.2f} GiB "
          f"({source}): {'rematerialising each layer' if on else 'no remat'}", file=out, flush=True)
    if on:
        memory_path.set_remat(setup.built.model, True)
        setup.trainer.clear_jit_cache()  # its step holds the graph without remat (train/measurement/compiled.py)
        plan = plan_run_step(setup)
    return RematChoice(plan, on, time.perf_counter() - started)


def plan_without_remat(setup: Any, lowered: Any) -> tuple[StepPlan | None, str]:
    """The step's plan without remat (None: the compiler refused it) and what it said."""
    from train.measurement import out_of_memory

    try:
        plan = plan_run_step(setup, lowered)
    except Exception as e:  # noqa: BLE001  (re-raised unless it is XLA's allocation failure)
        # A TPU's compiler assigns the program's memory itself and refuses one that does not fit
        # (RESOURCE_EXHAUSTED at compile time; seen on a v5e for Qwen3 0.6B and Gemma3 1B at (8, 2048)):
        # that is the plan's answer, not the run's end.
        if not out_of_memory.is_out_of_memory(e):
            raise
        return None, "more than the device holds (its compiler ran out of memory)"
    return plan, f"{plan.peak_bytes / GIB:.2f} GiB"


def sample_rows(cfg: Any, view: Any, batches: int = FLOP_SAMPLE_BATCHES) -> tuple[np.ndarray, float]:
    """[rows, L] segment ids of the run's first batches (the training stream, as it would draw them),
    and their targets per position (what the chunked loss projects)."""
    import itertools

    from train import data

    train_ds, _ = data.datasets(cfg, view)
    length = view.manifest.max_length
    drawn = list(itertools.islice(iter(train_ds), batches))
    # [B, L] rows, or [B, K, L] with --grad-accum-steps: rows either way.
    seg = np.concatenate([np.asarray(b["segment_ids"]).reshape(-1, length) for b in drawn])
    mask = np.concatenate([np.asarray(b["loss_mask"]).reshape(-1, length) for b in drawn])
    return seg, float(np.count_nonzero(mask[:, 1:])) / mask.size


def analytic_flops(setup: Any, remat_on: bool) -> Any:
    """train/measurement/flops.py's count of this run's step, on its first batches' segments and targets."""
    from train.measurement import flops
    from train.step import memory_path

    cfg, length, run = setup.config, setup.view.manifest.max_length, setup.run
    opts = flops.StepOptions(cfg.batch_size * cfg.grad_accum_steps, length, run.attention,
                             memory_path.attention_tile(cfg, length), cfg.loss_chunk_tokens, remat_on,
                             extra_forwards=run.objective.extra_forwards)
    segment_ids, target_fraction = sample_rows(cfg, setup.view)
    return flops.step_flops(flops.model_cost(setup.built.model), opts, segment_ids, target_fraction)


def print_plan(plan: StepPlan, step: Any, budget: int, source: str, describe: str, out: TextIO) -> dict[str, Any]:
    fits = plan.fits(budget)
    print(f"planned train step: {describe}", file=out)
    print(f"  arguments    {plan.argument_bytes / GIB:8.2f} GiB", file=out)
    print(f"  temporaries  {plan.temp_bytes / GIB:8.2f} GiB", file=out)
    print(f"  peak         {plan.peak_bytes / GIB:8.2f} GiB (estimate)", file=out)
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.2e}" for k, v in step.parts.items() if v)
    pairs = ", ".join(f"{k} {v:,.0f}" for k, v in step.attention_pairs_per_row.items())
    print(f"  FLOPs        {step.total:.3e} (analytic: {parts}; attention pairs per row and head: {pairs})", file=out)
    print(f"  XLA FLOPs    {plan.xla_flops:.3e} (XLA's estimate counts each loop body once and Pallas kernels as "
          f"nothing: right only for --attention dense --loss-chunk-tokens 0 --remat none)", file=out)
    print(f"  budget       {budget / GIB:8.2f} GiB ({source}): {'fits' if fits else 'does NOT fit'}", file=out)
    result = {**plan.as_json(), **step.as_json(), "budget_bytes": budget, "fits": fits}
    print(json.dumps(result), file=out, flush=True)
    return result


def run_plan(cfg: Any, out: TextIO) -> dict[str, Any]:
    """--plan-memory: set up as for training (no checkpoint folder touched), plan, print, return the JSON."""
    import dataclasses as dc
    import sys

    from train.compilation import executable_preload
    from train.run_setup import setup
    from train.step import memory_path

    cfg = dc.replace(cfg, checkpoint_dir=None, metrics_out=None, save_lora=None, tensorboard=None, profile_steps=None)
    s = setup(cfg, out=sys.stderr)
    auto = choose_remat(s, sys.stderr)
    manifest = s.view.manifest
    remat_on = memory_path.remat_is_on(s.built.model)
    plan = auto.plan if auto is not None else plan_run_step(s)
    executable_preload.end(s.preload, sys.stderr)  # the step a train run of these options will look up
    budget, source = budget_bytes(cfg.memory_budget_gib)
    kind = s.run.attention
    describe = (f"{cfg.model} {s.run.dtype_name} LoRA rank {cfg.lora_rank}, "
                f"{s.run.objective.plan_note}"
                f"B={cfg.batch_size} L={manifest.max_length} "
                f"({cfg.batch_size * manifest.max_length:,} tokens{f' x {cfg.grad_accum_steps} micro-batches' if cfg.grad_accum_steps > 1 else ''}), "
                f"attention {kind}{'' if kind == 'dense' else f' (tile {memory_path.attention_tile(cfg, manifest.max_length)})'}, "
                f"loss chunk {cfg.loss_chunk_tokens or 'off (full logits)'}, remat {'layer' if remat_on else 'none'}"
                f"{' (auto)' if cfg.remat == memory_path.REMAT_AUTO else ''}")
    return print_plan(plan, analytic_flops(s, remat_on), budget, source, describe, out)
