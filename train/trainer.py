"""LoRA SFT with Tunix's PeftTrainer on a pre-packed shard set (packed or one example per row).

Wiring (google-tunix 0.1.7: PeftTrainer takes any iterable of batches and calls gen_model_input_fn
inside its jitted train step):
- data: loaders.make_dataset -> dicts of int32 [B, L] numpy arrays; the trainer
  consumes them as they are (Tunix does no batching or collation).
- gen_model_input_fn (train/step/model_inputs.py) runs inside the jitted step and builds
  the block-causal mask on the device; the loss (train/step/loss.py) is the token mean
  of the masked NLL, returning its sum and token count as aux.
- mesh: `--mesh fsdp=F,tp=T` makes a ('fsdp', 'tp') mesh. Tunix shards each batch
  along 'fsdp' and pre-shards the optimizer only when the mesh is active through the
  legacy `with mesh:` context, so training runs inside `with mesh:` (train/run_config/mesh.py).

Metrics: train/measurement/metrics.py (one JSONL line per step, eval lines, a summary line). Mixed
precision: train/step/precision.py and train/step/optimizer.py. A diverging run: train/measurement/divergence.py.

Checkpoints (cfg.checkpoint_dir, train/checkpointing/checkpoints.py and train/checkpointing/resume.py): Tunix's own CheckpointManager
saves the LoRA params and optimizer state, our wrapper adds the loader state for the same
step; a run started on a folder holding a checkpoint of the same run resumes from its
latest step with exactly the next batch (seeked, not re-read), numbering steps on and
appending to the metrics JSONL. cfg.save_lora exports the adapters as safetensors at the end.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, TextIO

from train import data, memory_plan, resolved_run
from train.adapter_files import lora_file
from train.checkpointing import checkpoints, resume
from train.generation import eval_generate
from train.measurement import divergence, out_of_memory
from train.compilation import executable_preload
from train.run_config import outputs
from train.run_config.config import TrainConfig, TrainError
from train.run_setup import Setup, setup
from train.step import memory_path, precision
from train.verification import parity

__all__ = ["TrainConfig", "TrainError", "Setup", "setup", "execute", "run", "export_lora"]


def export_lora(s: Setup, path: str, overwrite: bool | None = None, step: int | None = None) -> dict[str, str]:
    """--save-lora: the trained adapter and what it belongs to: a PEFT folder (--lora-format peft,
    train/adapter_files/peft_export.py) or one safetensors file of qwix names (prepack, train/adapter_files/lora_file.py)."""
    from loaders.dataset import shard_set_id

    cfg = s.config
    base = s.base_weights or {}
    alpha = float(cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_rank)
    metadata = {
        "model": cfg.model,
        "lora_alpha": alpha,
        "lora_module_path": s.built.spec.lora_module_path,
        "base_weights": base.get("source"),
        "base_fingerprint": base.get("fingerprint"),
        "base_dtype": s.static.get("dtype"),
        "config_overrides": dict(cfg.config_overrides) if cfg.config_overrides else None,
        "qlora": {"qtype": cfg.qlora, "tile_size": s.static.get("qlora_tile_size")} if cfg.qlora else None,
        "vocab_size": s.built.vocab_size,
        "step": int(s.trainer.train_steps) if step is None else step,
        "shards": cfg.shards,
        "shard_set": shard_set_id(s.view),
        "seed": cfg.seed,
    }
    if cfg.lora_format == "peft":
        from train.adapter_files import peft_export

        return peft_export.save_peft(s.built.model, s.built.spec.family, s.built.config, path, model_name=cfg.model,
                                     rank=cfg.lora_rank, alpha=alpha, metadata=metadata,
                                     overwrite=cfg.overwrite if overwrite is None else overwrite)
    return lora_file.save_lora(s.built.model, path, metadata)


def adapter_saved_line(record: dict[str, Any]) -> str:
    """Where --save-lora put the adapter, and what reads it."""
    what = ("a PEFT folder: prepack generate --lora, prepack export --merge, peft" if record["format"] == "peft"
            else "a prepack LoRA file: prepack generate --lora, prepack export --merge")
    return f"saved the adapter (step {record['step']:,}, rank {record['rank']}) to {record['path']} ({what})"


def export_adapter(s: Setup, say: TextIO, step: int | None = None) -> None:
    """--save-lora after training (or of `step`, the last finite one, after a divergence); should it
    fail, the adapter is saved where outputs.recovery_path says and the run fails naming that place
    (outputs.ExportFailed): what was trained is never lost."""
    cfg = s.config
    step = int(s.trainer.train_steps) if step is None else step
    record = {"path": cfg.save_lora, "format": cfg.lora_format, "step": step, "rank": cfg.lora_rank}
    try:
        outputs.export_or_recover(cfg, lambda path, overwrite: export_lora(s, path, overwrite, step), say)
        print(adapter_saved_line(record), file=say, flush=True)
    except outputs.ExportFailed as e:
        record["failed"] = str(e)
        raise
    finally:
        s.recorder.static_extra["lora_export"] = record


def save_last_finite(s: Setup, error: divergence.Diverged, say: TextIO) -> None:
    """--nan-policy stop with --save-lora: the last LoRA values fetched finite are put back on the model
    and exported; raises Diverged again with the step they are of. Nothing when none was kept."""
    from flax import nnx

    kept = getattr(s.trainer, "last_finite", None)
    if not s.config.save_lora or kept is None:
        return
    step, lora = kept
    nnx.update(s.built.model, lora)
    export_adapter(s, say, step)
    raise divergence.Diverged(error.step, error.reason, saved=f"the adapter of step {step}, the last step fetched finite, "
                                                             f"was saved to {s.config.save_lora}") from error


def verify_first(s: Setup, batch: dict[str, Any], out: TextIO, packed_layout: parity.LayoutFn = parity.stored_layout) -> None:
    """--verify-first: the parity check (train/verification/parity.py) on the first batch; ParityFailed stops the run.
    packed_layout: tests only, to show a layout bug stops the run."""
    result = parity.check_first_batch(s, batch, packed_layout)
    print(f"verify-first: {result.summary()}", file=out, flush=True)
    s.recorder.static_extra["verify_first"] = {"ok": result.ok, "dtype": result.dtype, "max_abs_diff": result.max_abs_diff,
                                               "statistic": result.statistic, "worst": result.worst,
                                               "tolerance": result.tolerance, "segments": len(result.segments)}
    if not result.ok:
        raise parity.ParityFailed(f"--verify-first: parity FAILED before step 1: {result.failure_lines(1)[0]}")


def train_steps(s: Setup, context: Any, say: TextIO, prompts: Any = None) -> None:
    """--remat auto's plan, --verify-first, then Tunix's loop (resumed where a checkpoint says);
    --eval-generate's `prompts` are generated and scored before, during and after it."""
    cfg = s.config
    with context:  # --remat auto: plan the step (compile only) and switch remat on if it would not fit
        auto = memory_plan.choose_remat(s, say)
    if auto is not None:  # it compiled the executable step 1 runs: step 1's time includes it
        s.recorder.charge_first_step(auto.seconds)
        s.recorder.static_extra["remat_auto_plan_s"] = auto.seconds
    s.recorder.static_extra["remat"] = "layer" if memory_path.remat_is_on(s.built.model) else "none"
    if s.resumed_step >= cfg.steps:
        print(f"checkpoint step {s.resumed_step} >= --steps {cfg.steps}: nothing to train", file=say)
        return
    train_ds, eval_ds = data.datasets(cfg, s.view, s.eval_view)
    if cfg.verify_first:
        with context:
            verify_first(s, data.first_micro_batch(next(iter(train_ds)), cfg.grad_accum_steps), say)
    if s.checkpoint is not None and s.policy is not None:
        train_ds = resume.checkpointed_stream(
            s.trainer, s.checkpoint, s.policy, s.resumed_step, cfg.checkpoint_keep, train_ds
        )
    evaluator = None
    if prompts is not None:
        with context:
            evaluator = eval_generate.Evaluator(s, prompts, cfg.eval_generate_every, say)
            evaluator.evaluate(s.resumed_step)
        train_ds = evaluator.every_n(train_ds)
    with context:
        s.trainer.train(train_ds, eval_ds)
        if evaluator is not None:
            evaluator.finish()


def execute(cfg: TrainConfig, out: TextIO | None = None) -> tuple[Setup, dict[str, Any]]:
    """Trains as configured; returns the Setup (its model is the trained one) and the summary."""
    prompts = None
    eval_generate.check_flags(cfg)
    if cfg.eval_generate:  # read and rendered before any weights load: a bad file stops the run at once
        import loaders

        prompts = eval_generate.prepare(cfg, loaders.open_shards(cfg.shards).manifest, out)
    run = resolved_run.resolve(cfg)
    with precision.matmul_precision(run.compute_dtype):
        return _execute(cfg, run, out, prompts)


def _execute(cfg: TrainConfig, run: resolved_run.ResolvedRun, out: TextIO | None, prompts: Any) -> tuple[Setup, dict[str, Any]]:
    """execute's run, inside its matmul precision (--dtype float32: float32 matmuls on every backend)."""
    s = setup(cfg, out=out, run=run)
    context = s.mesh if s.mesh is not None else contextlib.nullcontext()
    try:
        # A batch too large for the device fails in the compile or a step: one line, not XLA's traceback.
        with out_of_memory.refused_as_train_error(s):
            try:
                train_steps(s, context, out if out is not None else sys.stderr, prompts)
            except divergence.Diverged as e:
                save_last_finite(s, e, out if out is not None else sys.stderr)
                raise
        if cfg.save_lora:
            export_adapter(s, out if out is not None else sys.stderr)
    finally:
        # Steps dispatched after the last fetch when the run ended by an exception: their
        # records, if the device can still give them (never after a --nan-policy stop).
        try:
            s.recorder.fetch()
        except Exception:  # noqa: BLE001  (the exception that ended the run is the one to report)
            pass
        # Tunix's close() already waited for in-flight saves after a normal end; after an
        # exception it was never called, and the last save may still be writing.
        s.trainer.checkpoint_manager.close()
        if isinstance(s.trainer.checkpoint_manager, checkpoints.DataStateCheckpoints):
            s.recorder.static_extra["checkpoints_saved"] = s.trainer.checkpoint_manager.saved_steps
        s.recorder.static_extra["device_peak_bytes"] = memory_plan.device_peak_bytes()
        preloaded = executable_preload.end(s.preload, out if out is not None else sys.stderr)
        if preloaded is not None:
            s.recorder.static_extra["compile_preload"] = preloaded
        summary = s.recorder.summary(extra={k: v for k, v in s.static.items() if k not in s.recorder.static})
        s.recorder.close(summary)
    return s, summary


def run(cfg: TrainConfig, out: TextIO | None = None) -> dict[str, Any]:
    """Trains as configured; returns the summary (also the JSONL's last line)."""
    return execute(cfg, out=out)[1]
