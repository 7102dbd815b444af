"""The per-batch row check of `prepack train` (issue 46) against the loader's read and the train step, in one run.

Every batch the loader hands the trainer passes `rowformat.row_fault` (the rules `prepack verify`
judges rows by) in `ShardView.read`, before it goes to the device. This times, on one synthetic
set (testkit.shard_sets: 1..4 segments per row, rows 50-100% full, ids inside the model's
vocabulary) at --max-length and --batch-size:
- read: `ShardView.read(indices, check=False)` of a random batch: the records fetched and decoded,
  nothing judged (what the loader cost before the check);
- check: `rowformat.row_fault` on that batch alone (what the check adds per batch);
- loader: `make_dataset` batches as `prepack train` reads them (checked), one read thread;
- step: each --models entry trained by `train.trainer.execute` for --steps steps on the same set
  and batch size (random weights, LoRA rank 8, --remat layer; the first step, the compile, left
  out); the median of the metrics' step_time_s (wall time per step, input wait included).
Ratios: check / read and check / step. CPU time is process time (all threads).

    python -m benchmarks.bench_row_check
    python -m benchmarks.bench_row_check --max-length 2048 --batch-size 8 --models tiny-qwen3 gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

# The Gemma3 tokenizer's size: a set of this vocabulary trains gemma3-270m (train/run_config/vocab.py's check).
GEMMA3_VOCAB = 262_144


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rows", type=int, default=512, help="rows in the synthetic set (default 512)")
    p.add_argument("--batches", type=int, default=200, help="batches timed for read, check and loader (default 200)")
    p.add_argument("--models", nargs="*", default=["tiny-qwen3", "gemma3-270m"],
                   help="models whose train step is timed (default tiny-qwen3 gemma3-270m; none: skip the step)")
    p.add_argument("--steps", type=int, default=4, help="train steps per model (the first, the compile, left out)")
    p.add_argument("--remat", default="layer", choices=["none", "layer"],
                   help="the step's --remat (default layer: gemma3-270m at B 8, L 1024 took 14 GB of host memory without)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def _timed(fn, repeats: int) -> tuple[float, float]:
    """(wall s, CPU s) per call, over `repeats` calls."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - wall) / repeats, (time.process_time() - cpu) / repeats


def build(folder: str, args: argparse.Namespace, vocab: int) -> str:
    import numpy as np

    from testkit.shard_sets import TEST_TOKENIZER, build_shard_set, synthetic_row

    rng = np.random.default_rng(0)
    rows = [synthetic_row(r, args.max_length, rng, vocab_size=vocab) for r in range(args.rows)]
    name = "gemma3" if vocab == GEMMA3_VOCAB else "bench"
    build_shard_set(folder, rows=rows, num_shards=4, max_length=args.max_length, tokenizer={**TEST_TOKENIZER, "name": name, "vocab_size": vocab})
    return folder


def loader_costs(path: str, args: argparse.Namespace) -> dict[str, float]:
    import numpy as np

    import loaders
    from prepack.format import rowformat

    view = loaders.open_shards(path)
    rng = np.random.default_rng(1)
    batches = [rng.choice(len(view), size=args.batch_size, replace=False) for _ in range(args.batches)]
    read = [view.read(b, check=False) for b in batches]  # warm the page cache and the readers
    facts = view.row_facts
    assert all(rowformat.row_fault(r, facts) is None for r in read)
    it = iter(batches * 2)
    read_s = _timed(lambda: view.read(next(it), check=False), args.batches)
    it2 = iter(read * 2)
    check_s = _timed(lambda: rowformat.row_fault(next(it2), facts), args.batches)
    ds = iter(loaders.make_dataset(view, args.batch_size, seed=0, shard_index=0, shard_count=1, read_threads=1))
    next(ds)
    loader_s = _timed(lambda: next(ds), args.batches)
    return {"read_s": read_s[0], "read_cpu_s": read_s[1], "check_s": check_s[0], "check_cpu_s": check_s[1],
            "loader_s": loader_s[0], "loader_cpu_s": loader_s[1]}


def step_time(path: str, model: str, args: argparse.Namespace, folder: str) -> float:
    from train import trainer

    metrics = os.path.join(folder, f"{model}.jsonl")
    cfg = trainer.TrainConfig(shards=path, model=model, weights="random", batch_size=args.batch_size, steps=args.steps,
                              log_every=1, metrics_out=metrics, read_threads=1, lora_rank=8, remat=args.remat)
    trainer.execute(cfg, out=open(os.devnull, "w"))
    with open(metrics) as f:
        times = [r["step_time_s"] for r in map(json.loads, f) if "step_time_s" in r and r.get("step", 0) > 1]
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    results: dict[str, object] = {"max_length": args.max_length, "batch_size": args.batch_size}
    with tempfile.TemporaryDirectory() as tmp:
        small = build(os.path.join(tmp, "small"), args, vocab=4096)
        costs = loader_costs(small, args)
        results.update(costs)
        print(json.dumps(costs), flush=True)
        steps = {}
        for model in args.models:
            path = small
            if model.startswith("gemma3-"):  # a model of Gemma3's tokenizer trains a set of it
                path = os.path.join(tmp, "gemma3")
                if not os.path.exists(path):
                    build(path, args, vocab=GEMMA3_VOCAB)
            steps[model] = step_time(path, model, args, tmp)
        results["step_s"] = steps
    us = lambda s: f"{s * 1e6:,.0f}"  # noqa: E731
    print(f"L {args.max_length}, batch {args.batch_size}: per batch (wall µs, CPU µs)")
    print(f"| what | wall µs/batch | CPU µs/batch | check as a fraction |")
    print(f"|---|---:|---:|---:|")
    print(f"| read (records decoded, unchecked) | {us(costs['read_s'])} | {us(costs['read_cpu_s'])} | "
          f"{costs['check_s'] / costs['read_s']:.3f} of it |")
    print(f"| row check (rowformat.row_fault) | {us(costs['check_s'])} | {us(costs['check_cpu_s'])} | 1 |")
    print(f"| loader batch as train reads it (checked, 1 thread) | {us(costs['loader_s'])} | {us(costs['loader_cpu_s'])} | "
          f"{costs['check_s'] / costs['loader_s']:.3f} of it |")
    for model, s in steps.items():
        print(f"| train step, {model} (median, compile left out) | {us(s)} | | {costs['check_s'] / s:.2g} of it |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
