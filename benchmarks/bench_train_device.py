"""`prepack train` itself on a device: packed rows against one example per row, per model, shape and attention.

Not a re-implementation: each run is `python3 -m apps.cli train ...` in its own process (the one
that holds the chip while it runs; this process imports no JAX and opens no device, and runs one
child at a time, since only one process can hold a TPU). Per run, from the metrics summary the
trainer writes (--metrics-out): the step time (median of the steps after the first), tokens/s,
target tokens/s, MFU (the trainer's: train/measurement/mfu.py's peak by device kind, v5e 197 TFLOP/s, or
--peak-tflops), the first step's time (its compile included), the process's peak device memory
(`device_peak_bytes`: jax's peak_bytes_in_use), and, per (model, shape, attention), the time to
a fixed budget of target tokens (--budget-target-tokens) packed against one example per row.

1. Here (needs Beam): pack the rows, Alpaca-like, packed and --no-pack, at every length of the
   shapes, for each tokenizer family the models need (gemma3, qwen3):

    python -m benchmarks.bench_train_device --pack --work-dir .bench_train [--examples 600] [--sample]

   (--examples: the first N records of $PREPACK_BENCH_DATA/alpaca.jsonl, benchmarks/data.py;
   --sample: the embedded sample instead). Carry the work dir to the device: the device needs
   no Beam, it only reads the shard sets.

2. On the device, as many calls as it takes (each run is skipped when the results already hold
   it, so a call that ran out of time is resumed by running it again):

    python3 -m benchmarks.bench_train_device --plan                       # the runs, in priority order
    python3 -m benchmarks.bench_train_device --work-dir .bench_train --out DIR [--models gemma3-270m]
        [--shapes 16x1024,8x2048,2x8192] [--attention flash,splash] [--layouts packed,unpacked]
        [--steps 20] [--remat none] [--budget-s 540] [--train-args "--compile-cache /tmp/xla"]
    python3 -m benchmarks.bench_train_device --work-dir .bench_train --out DIR --models gemma3-270m \
        --shapes 8x2048 --attention flash --layouts packed --profile DIR/profile   # one run, profiled

The priority (--plan, and the order runs are taken in): Gemma3 270M at (16, 1024), (8, 2048) and
(2, 8192) first, then Qwen3 0.6B and Gemma3 1B at (8, 2048), then those two at the other shapes;
within a (model, shape), each attention packed then one example per row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Any

from benchmarks import results_file
from benchmarks.data import DATA_DIR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_NAME = "bench_train_device.json"
MODELS = ("gemma3-270m", "qwen3-0.6b", "gemma3-1b")
SHAPES = ((16, 1024), (8, 2048), (2, 8192))
LAYOUTS = ("packed", "unpacked")
OUT_OF_MEMORY = "out of memory"
# The seed report's runs ("16 x 1024 one example per row") were taken at the same rank and steps.
DEFAULT_STEPS = 20
DEFAULT_LORA_RANK = 8


def family(model: str) -> str:
    """The tokenizer family a model's shard sets are packed with (the trainer checks the vocabulary)."""
    return "qwen3" if model.startswith(("qwen3", "tiny-qwen3")) else "gemma3"


def priority(model: str, shape: tuple[int, int]) -> int:
    """Lower runs first: Gemma3 270M (or a tiny Gemma3) at every shape, then the others at (8, 2048), then the rest."""
    if model in ("gemma3-270m", "tiny-gemma3", "tiny"):
        return 0
    return 1 if shape == (8, 2048) else 2


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    batch: int
    length: int
    layout: str  # packed | unpacked (one example per row)
    attention: str
    remat: str
    label: str = ""  # --label: what --train-args changed (e.g. loss=xla), part of the key

    @property
    def key(self) -> str:
        key = f"{self.model} {self.batch}x{self.length} {self.layout} {self.attention} remat={self.remat}"
        return f"{key} {self.label}" if self.label else key

    def shards(self, work_dir: str) -> str:
        return os.path.join(work_dir, family(self.model), self.layout, f"L{self.length}")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        b, _, l = part.strip().partition("x")
        if not (b.isdigit() and l.isdigit()):
            raise SystemExit(f"bench_train_device: --shapes {text!r}: each shape is BxL, e.g. 8x2048")
        shapes.append((int(b), int(l)))
    return shapes


def planned_runs(args: argparse.Namespace) -> list[Run]:
    shapes = parse_shapes(args.shapes)
    runs = [Run(m, b, l, layout, kind, args.remat, args.label) for m in args.models.split(",") for b, l in shapes
            for kind in args.attention.split(",") for layout in args.layouts.split(",")]
    order = {m: i for i, m in enumerate(args.models.split(","))}
    return sorted(runs, key=lambda r: (priority(r.model, (r.batch, r.length)), order[r.model], shapes.index((r.batch, r.length))))


def train_cmd(run: Run, args: argparse.Namespace, metrics: str) -> list[str]:
    cmd = [sys.executable, "-m", "apps.cli", "train", "--shards", run.shards(args.work_dir), "--model", run.model,
           "--weights", "random", "--dtype", "bfloat16", "--batch-size", str(run.batch), "--steps", str(args.steps),
           "--lora-rank", str(args.lora_rank), "--attention", run.attention, "--remat", run.remat,
           "--metrics-out", metrics, "--overwrite", "--log-every", str(args.steps)]
    if args.peak_tflops:
        cmd += ["--peak-tflops", str(args.peak_tflops)]
    if args.profile:
        cmd += ["--profile-steps", args.profile_steps, "--profile-dir", args.profile]
    return cmd + shlex.split(args.train_args or "")


def read_summary(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return None
    return next((line["summary"] for line in reversed(lines) if isinstance(line, dict) and "summary" in line), None)


SUMMARY_FIELDS = ("median_step_time_s", "tokens_per_s", "target_tokens_per_s", "mfu", "first_step_time_s",
                  "device_peak_bytes", "mean_density", "mean_target_density", "mean_input_wait_s", "timed_steps",
                  "final_loss", "device_kind", "platform", "peak_tflops", "remat", "wall_time_s",
                  "launch_to_first_step_s", "remat_auto_plan_s", "compile_preload")


def file_stem(key: str) -> str:
    """A run's key as a file name of plain characters (a device's transfer refuses ',' and '=')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", key)


def one_run(run: Run, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """`prepack train` for one run, in its own process; its summary's figures, or why there are none."""
    name = run.key + ("_profiled" if args.profile else "")
    metrics = os.path.join(args.out, "metrics", file_stem(name) + ".jsonl")
    os.makedirs(os.path.dirname(metrics), exist_ok=True)
    cmd = train_cmd(run, args, metrics)
    shown = shlex.join(["python3", *cmd[1:]])
    print(f"$ {shown}", flush=True)
    started = time.perf_counter()
    log = os.path.join(args.out, "logs", os.path.basename(metrics)[: -len(".jsonl")] + ".log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        # The child's output so far is kept: where a run was when the budget ended (a compile, a step).
        said = save_log(log, e.stdout, e.stderr)
        return {"failed": f"no result within {timeout:.0f} s (the time budget); last said: {said}", "command": shown,
                "log": log}
    save_log(log, done.stdout, done.stderr)
    result: dict[str, Any] = {"command": shown, "process_s": time.perf_counter() - started, "log": log}
    summary = read_summary(metrics) if done.returncode == 0 else None
    if summary is None:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1][:400]
        failed = f"{OUT_OF_MEMORY}: {last}" if OUT_OF_MEMORY in last.lower() else f"exit {done.returncode}: {last}"
        return {**result, "failed": failed}
    result.update({k: summary.get(k) for k in SUMMARY_FIELDS})
    result["target_tokens"] = summary.get("target_tokens")
    return result


def save_log(path: str, stdout: str | bytes | None, stderr: str | bytes | None) -> str:
    """The child's stdout and stderr in one file; its last non-empty line (what it last said)."""
    text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x for x in (stdout, stderr) if x)
    with open(path, "w") as f:
        f.write(text)
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(nothing)"


def final(result: dict[str, Any]) -> bool:
    """Ran, or did not fit (out of memory is not retried); timeouts and other failures are retried."""
    return "failed" not in result or str(result["failed"]).startswith(OUT_OF_MEMORY)


def load_results(path: str) -> dict[str, Any]:
    try:
        return results_file.load(path, {"machine": {}, "runs": {}, "commands": []}, lambda d: isinstance(d.get("runs"), dict))
    except results_file.UnreadableResults as e:
        raise SystemExit(f"bench_train_device: {path}: unreadable ({e}); move it away or give another --out") from None


save_results = results_file.save


def budget_times(runs: dict[str, dict[str, Any]], budget: float) -> list[dict[str, Any]]:
    """Per (model, shape, attention, remat) with both layouts: seconds to `budget` target tokens at
    the steady rate (and with the first step's time added), unpacked / packed."""
    out = []
    for key, packed in runs.items():
        if " packed " not in key or key.endswith(" profiled") or "failed" in packed or not packed.get("target_tokens_per_s"):
            continue
        unpacked = runs.get(key.replace(" packed ", " unpacked "))
        if not unpacked or "failed" in unpacked or not unpacked.get("target_tokens_per_s"):
            continue
        p, u = budget / packed["target_tokens_per_s"], budget / unpacked["target_tokens_per_s"]
        pc, uc = p + (packed["first_step_time_s"] or 0.0), u + (unpacked["first_step_time_s"] or 0.0)
        out.append({"run": key.replace(" packed ", " "), "budget_target_tokens": budget, "packed_s": p, "unpacked_s": u,
                    "unpacked_over_packed": u / p, "packed_with_first_step_s": pc, "unpacked_with_first_step_s": uc,
                    "unpacked_over_packed_with_first_step": uc / pc})
    return out


def print_table(data: dict[str, Any], budget: float) -> None:
    from benchmarks.device_machine import line

    if data["machine"]:
        print(f"\nmachine: {line(data['machine'])}")
    print("\n| run | step | tokens/s | target tokens/s | MFU | first step | peak device memory | target density |")
    print("|---|---|---|---|---|---|---|---|")
    for key, r in data["runs"].items():
        if "failed" in r:
            print(f"| {key} | {r['failed']} | | | | | | |")
            continue
        mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.3f}"
        peak = "-" if r.get("device_peak_bytes") is None else f"{r['device_peak_bytes'] / 2**30:.2f} GiB"
        print(f"| {key} | {r['median_step_time_s']:.3f} s | {r['tokens_per_s']:,.0f} | {r['target_tokens_per_s']:,.0f} | {mfu} "
              f"| {r['first_step_time_s']:.1f} s | {peak} | {r['mean_target_density']:.3f} |")
    times = budget_times(data["runs"], budget)
    if times:
        print(f"\nTime to {budget:,.0f} target tokens (steady rate; with the first step's time added):\n")
        print("| run | packed | one example per row | ratio | with first step: packed / one per row / ratio |")
        print("|---|---|---|---|---|")
        for t in times:
            print(f"| {t['run']} | {t['packed_s']:.1f} s | {t['unpacked_s']:.1f} s | {t['unpacked_over_packed']:.2f}x "
                  f"| {t['packed_with_first_step_s']:.1f} s / {t['unpacked_with_first_step_s']:.1f} s / "
                  f"{t['unpacked_over_packed_with_first_step']:.2f}x |")
    print(flush=True)


def run_all(args: argparse.Namespace) -> int:
    from benchmarks.device_machine import versions

    deadline = time.perf_counter() + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, RESULTS_NAME)
    data = load_results(path)
    data["commands"].append(shlex.join(["python3", "-m", "benchmarks.bench_train_device", *sys.argv[1:]]))
    data["machine"] = {**data["machine"], **versions()}
    runs = planned_runs(args)
    missing = sorted({r.shards(args.work_dir) for r in runs if not os.path.exists(os.path.join(r.shards(args.work_dir), "manifest.json"))})
    if missing:
        raise SystemExit(f"bench_train_device: no shard set at {', '.join(missing)}; build them first (with Beam, here): "
                         f"python -m benchmarks.bench_train_device --pack --work-dir {args.work_dir}")
    for run in runs:
        key = run.key + (" profiled" if args.profile else "")  # a traced run's times are its own, never the plain run's
        if key in data["runs"] and final(data["runs"][key]):
            print(f"{key}: already in {path}, skipped", flush=True)
            continue
        left = deadline - time.perf_counter()
        if left < args.min_run_s:
            print(f"{run.key}: not started, {left:.0f} s left of --budget-s (run the command again to go on)", flush=True)
            continue
        result = one_run(run, args, left)
        print(f"{key}: {json.dumps({k: v for k, v in result.items() if k != 'command'})}", flush=True)
        if "device_kind" in result:
            data["machine"].update({"device": result["device_kind"], "backend": result["platform"]})
        if args.profile:
            result["profile_dir"] = args.profile
        data["runs"][key] = result
        save_results(path, data)  # after each run: a call that ends later keeps it
    save_results(path, data)
    print_table(data, args.budget_target_tokens)
    print(f"-> {path}", flush=True)
    return 0


def pack_all(args: argparse.Namespace) -> int:
    """The shard sets every planned run reads: per tokenizer family, packed and --no-pack, at each L."""
    lengths = sorted({l for _, l in parse_shapes(args.shapes)})
    source = ["--sample"]
    if not args.sample:
        os.makedirs(args.work_dir, exist_ok=True)
        subset = os.path.join(args.work_dir, f"alpaca-{args.examples}.jsonl")
        with open(args.data) as f:
            records = [line for line in f if line.strip()][: args.examples]
        with open(subset, "w") as f:
            f.writelines(records)
        source = ["--input", subset, "--format", "alpaca"]
    for fam in sorted({family(m) for m in args.models.split(",")}):
        for layout in args.layouts.split(","):
            out = os.path.join(args.work_dir, fam, layout)
            if all(os.path.exists(os.path.join(out, f"L{l}", "manifest.json")) for l in lengths):
                print(f"reusing {out}", flush=True)
                continue
            cmd = [sys.executable, "-m", "apps.cli", "pack", *source, "--tokenizer", fam, "--output", out, "--overwrite",
                   "--no-progress", "--max-length", *map(str, lengths)] + (["--no-pack"] if layout == "unpacked" else [])
            print("$ " + shlex.join(cmd), flush=True)
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"bench_train_device: packing failed ({done.returncode}): {done.stderr.strip()[-1500:]}")
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.work_dir) for f in fs)
    print(f"{args.work_dir}: {total / 2**20:.1f} MiB to carry to the device", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pack", action="store_true", help="build the shard sets (needs Beam; on this machine, not the device)")
    p.add_argument("--plan", action="store_true", help="print the runs in priority order and exit")
    p.add_argument("--work-dir", default=".bench_train", help="the shard sets: WORK/<gemma3|qwen3>/<packed|unpacked>/L<n>")
    p.add_argument("--out", default=os.environ.get("OUT"), help="results folder: OUT/bench_train_device.json, merged and resumed")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--shapes", default=",".join(f"{b}x{l}" for b, l in SHAPES), help="BxL, comma-separated")
    p.add_argument("--attention", default="flash,splash", help="attention kinds, comma-separated (dense, blocked, flash, splash)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="packed and/or unpacked (one example per row)")
    p.add_argument("--remat", default="none", choices=["none", "layer", "auto"], help="each run's --remat")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--lora-rank", type=int, default=DEFAULT_LORA_RANK)
    p.add_argument("--peak-tflops", type=float, default=None, help="default: the trainer's table by device kind (v5e 197)")
    p.add_argument("--train-args", default=None, help="more `prepack train` options for every run, one string")
    p.add_argument("--label", default="", help="a name for what --train-args changes (e.g. loss=xla), added to each "
                   "run's key so variants of one run are recorded side by side")
    p.add_argument("--profile", default=None, metavar="DIR", help="trace the runs (--profile-steps, --profile-dir DIR); "
                   "recorded apart from the plain runs, as '<run> profiled'")
    p.add_argument("--profile-steps", default="10:13", help="with --profile: the steps traced")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall time for this call; runs not started are left for the next")
    p.add_argument("--min-run-s", type=float, default=150.0, help="start no run with less than this left of --budget-s")
    p.add_argument("--budget-target-tokens", type=float, default=10e6, help="the fixed target-token budget timed per layout")
    p.add_argument("--data", default=os.path.join(DATA_DIR, "alpaca.jsonl"), help="--pack: the Alpaca JSONL")
    p.add_argument("--examples", type=int, default=600, help="--pack: its first N records")
    p.add_argument("--sample", action="store_true", help="--pack: the embedded sample instead of --data")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plan:
        for i, run in enumerate(planned_runs(args), 1):
            print(f"{i:2d}. {run.key}")
        return 0
    if args.pack:
        return pack_all(args)
    if not args.out:
        raise SystemExit("bench_train_device: give --out DIR (or set $OUT)")
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
