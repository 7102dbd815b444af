"""The cookbook on the chip: Gemma3 270M LoRA, packed rows against one example per row at equal epochs.

The tool-call task of benchmarks/bench_generate_tools.py and the identity task of
benchmarks/bench_generate_identity.py, each trained with `prepack train` twice per seed: on packed
rows (the project's way) and on one example per row padded to the set's longest example (the
cookbook's way, `prepack pack --no-pack`; rounded up to a multiple of 16). Every run takes
`--attention dense`: the one-per-row lengths are no multiple of 128, which the TPU's flash kernel
needs, dense costs little at these lengths (384 at most), and the layout is then the one thing the
two runs of a seed differ in.
Both layouts see the same records the same number of epochs (steps = ceil(epochs * rows / batch)),
with the same learning-rate schedule scaled to their steps (cosine, warmup a fraction of the
steps). Per run, from the trainer's metrics JSONL: chip seconds to the end of training (the first
step, which carries the compile, reported apart), target tokens/s, MFU, the final train loss (and
the last epoch's mean) and the eval loss on the held-out records; then `prepack generate --score` on
the held-out prompts with each adapter and the base model: full-call accuracy, valid-call rate,
no-call accuracy, exact match. Also: generation tokens/s at batch 1, 8 and 32 on the chip with an
adapter, how many leading greedy tokens the chip's completions share with the CPU's, and one
`--objective dpo` run on the shipped preference sample at the tool-call runs' shape (step time
against SFT's, first-step loss against ln 2).

Where each part runs. The device machine reaches no registry and has no Beam: every shard set is
packed here (--prepare) and carried. Its Python lacks transformers, which `--tokenizer hf:FOLDER`
(the tool-call task's FunctionGemma layout) needs, so the tool-call adapters come back and are
scored here on the CPU (the quality is the adapter's; the CPU benchmark scored the same way); the
identity task (the embedded Gemma3 tokenizer) is scored on the chip. Each run is its own process
(the only one holding the chip while it runs); this process imports no JAX.

Commands, in order. Seconds are estimates (`--plan` prints each run's, from the constants below:
measured where they say so), to be replaced by what the chip reports.

  Here (CPU, no chip; ~5 min, then ~10 min of CPU scoring that may run while the device works):

    python -m benchmarks.device_weights split --output .weights        # 6 parts (5 x 45 MiB, 16.4 MiB), manifest.json
    python -m benchmarks.bench_cookbook_device --prepare                # .cookbook/device (8.3 MiB, carried), .cookbook/here
    python -m benchmarks.bench_cookbook_device --plan                   # the runs, their estimates, the calls they take
    python -m benchmarks.bench_cookbook_device --here                   # the base models scored on the CPU (tools; identity @cpu)

  On the device: calls back to back (the machine's /tmp holds the installed wheels, the weight
  parts, the results and the compile cache while it stays warm, ~100 s idle); timeout_s 600 each.
  Every command starts with the text ENV stands for (the wheels installed once per machine, then
  found in /tmp):

    ENV = export XDG_CACHE_HOME=/tmp/xdg; if [ -d .whl-tpu ]; then eval "$(bash .whl-tpu/install.sh .whl-tpu)";
          else export PYTHONPATH=${PYTHONPATH:-}:/tmp/tpu-site:/tmp/tpu-site2 PYTHONUNBUFFERED=1; fi; unset JAX_COMPILATION_CACHE_DIR
    PART = .weights/gemma-3-270m-q4_k_m.gguf.part0N                    (N per call, below)

    call 1     carry .whl-tpu .weights/manifest.json $PART(N=5)        ~41 MiB   ~35 s (the install ~30 s)
               ENV; python3 -m benchmarks.device_weights collect .weights
    calls 2-6  carry .weights/manifest.json $PART(N=0..4)              ~50 MiB   ~1.5 s each (measured)
               ENV; python3 -m benchmarks.device_weights collect .weights
    calls 7-   carry .weights/manifest.json .cookbook/device             ~16 MiB   up to ~560 s each
               ENV; W=$(python3 -m benchmarks.device_weights join .weights) \
                   && python3 -m benchmarks.bench_cookbook_device --weights "$W" --export $OUT

  Each compute call runs, in order, the runs that fit its --budget-s (540 s) and stops before the
  first that would not; what is done is skipped next time (results merged in /tmp/cookbook). The
  fifth session (docs/benchmarks.md, "Tool calls on a TPU v5e"): the six weight calls took ~1.5 s
  of device time each after the first (the install, ~30 s), and two compute calls of --budget-s
  570 and 545 ran the ten runs to DPO (a run's process: 78-142 s; --plan's constants are now
  those figures). Chip seconds for all of it on one machine: ~140 (the machine's start and the
  install) + ~10 (transfers) + ~1,650 (the sixteen runs' processes) ~ 1,800, a whole session's;
  the verify runs of item 1 (~80-100 s each) then take another. Should a call take much longer than its
  estimate, add --no-eval to the next (the training runs' eval passes; the scoring's reference
  NLL is then the held-out loss). A call's $OUT brings back cookbook.json,
  cookbook-files.tar.gz and the adapters made since the last call (two to a tar; --export-all:
  every one, should a call's files have been lost).

  If the machine went cold (its /tmp lost): here, `--import FOLDER --resume-kit` writes
  .cookbook/device/resume.json (the runs it holds are skipped) and .cookbook/device/adapters (those
  the unfinished runs read); then calls 1-5 again and the compute calls.

  Here, after each call, with the folder its files were copied to:

    python -m benchmarks.bench_cookbook_device --import FOLDER --here   # tool-call scoring on the CPU, greedy agreement, tables
    python -m benchmarks.bench_cookbook_device --table                  # the tables again
    python -m benchmarks.bench_cookbook_device --compare CPU.jsonl CHIP.jsonl   # any two generation files, prompt by prompt

On this CPU end to end (tiny model, random weights, a few steps; the plumbing, not the figures):

    python -m benchmarks.bench_cookbook_device --prepare --smoke --work-dir /tmp/cook
    python -m benchmarks.bench_cookbook_device --work-dir /tmp/cook --budget-s 3600 --export /tmp/cook/export   # ~7 min
    python -m benchmarks.bench_cookbook_device --work-dir /tmp/cook --import /tmp/cook/export --here
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import results_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "cookbook.json"
FILES_TAR = "cookbook-files.tar.gz"
RESUME = "resume.json"
PLAN = "plan.json"
TASKS = ("tools", "identity")
LAYOUTS = ("packed", "unpacked")
DPO_SAMPLE = os.path.join(REPO, "prepack", "sample_data", "sample_preference.jsonl")
LN2 = math.log(2.0)
OUT_OF_MEMORY = "out of memory"
DEVICE, HERE = "device", "here"

# What --plan's estimate assumes, per process on one v5e, from the fifth session's runs
# (docs/results/tpu-v5e/cookbook.json) where they say "measured":
OPEN_S = 15.0  # a process opening the chip and importing Tunix (measured: ~15 s)
WEIGHTS_S = 40.0  # the GGUF dequantized and loaded in bf16 (measured: a run's process less its trainer's wall, 55-70 s, less OPEN_S)
TRAIN_COMPILE_S = {False: 48.0, True: 16.0}  # the 270M step under --scan-layers, cold / from --compile-cache (measured: 42-57, 15-17)
EVAL_COMPILE_S = {False: 18.0, True: 5.0}  # the eval passes' forward, before the first step and after the last (measured: ~20, ~6)
STEP_S_PER_16K_TOKENS = 0.19  # measured at 8 x 2048 packed; tiny rows take at least STEP_FLOOR_S
STEP_FLOOR_S = 0.021  # measured: 21-35 ms a step at 4 x 64 to 4 x 384
SAMPLER_COMPILE_S = {False: 40.0, True: 15.0}  # prefill and decode at one batch size (measured with NLL's: ~48-70 cold, ~25 cached)
NLL_COMPILE_S = {False: 20.0, True: 8.0}  # --score's teacher-forced reference NLL
DECODE_STEP_S = 0.01  # one token for the whole batch (a guess)
SAVE_S = 3.0
# --here: a 270M token on 2 CPU cores, per sequence of the batch (measured: the tool calls' 30 prompts at batch 8 took
# 101-159 s beside other work)
CPU_GENERATE_S_PER_TOKEN = 0.09


class CookbookError(Exception):
    """Bad options or a work folder not ready for the step asked: one line."""


# ----------------------------------------------------------------------------- the recipe


def recipe(smoke: bool) -> dict[str, Any]:
    """What every run of a plan shares: written once by --prepare into plan.json, read by every other step."""
    common = {"model": "gemma3-270m", "dtype": "bfloat16", "batch_size": 4, "lora_rank": 8, "learning_rate": 1e-3,
              "lr_schedule": "cosine", "warmup_ratio": 0.05, "seeds": [0, 1], "max_new_tokens": 32,
              "generate_batch_size": 8, "attention": "dense", "length_multiple": 16, "max_steps": None, "weights": None,
              # the layers' period under one scan: the 270M step compiles in ~24 s, not ~85 s (measured on the chip),
              # and these rows (384 tokens at most, batch 4) fit without remat; every layout runs the same way
              "scan_layers": True,
              "tasks": {"tools": {"max_length": 384, "epochs": 3.0, "scored": HERE},
                        "identity": {"max_length": 128, "epochs": 1.0, "scored": DEVICE}},
              "dpo": {"task_shape": "tools", "epochs": 2.0},
              # batch 8 (generate_batch_size) is the adapter's scoring run, on the held-out prompts
              "throughput": {"task": "identity", "adapter": "packed seed=0", "batch_sizes": [1, 32],
                             "repeat": 4, "max_prompts": {"1": 48}},
              "compare": {"task": "identity", "adapters": ["base", "packed seed=0"]}}
    if smoke:  # the plumbing on a CPU in minutes: a tiny random model, three steps a run, one seed
        common.update({"model": "tiny-gemma3", "dtype": "float32", "weights": "random", "max_steps": 3, "seeds": [0],
                       "max_new_tokens": 4})
        common["throughput"] = {**common["throughput"], "batch_sizes": [1, 32], "repeat": 1, "max_prompts": {"1": 4}}
    return common


def steps_for(rows: int, epochs: float, batch_size: int, max_steps: int | None) -> int:
    """Optimizer steps for `epochs` passes over `rows` rows (the loader streams epochs back to back)."""
    steps = max(2, math.ceil(epochs * rows / batch_size))  # two at least: the summary times the steps after the first
    return min(steps, max_steps) if max_steps else steps


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ----------------------------------------------------------------------------- runs


@dataclasses.dataclass(frozen=True)
class Run:
    kind: str  # train | dpo | score | generate
    task: str
    layout: str = ""  # packed | unpacked; "" for the base model
    seed: int = 0
    batch: int = 0  # generate: --batch-size
    where: str = DEVICE
    cpu_copy: bool = False  # the CPU's run of a run scored on the chip, for the greedy tokens they share

    @property
    def adapter(self) -> str:
        """The training run whose adapter a score/generate run reads ('' for the base model)."""
        return f"{self.layout} seed={self.seed}" if self.layout else ""

    @property
    def key(self) -> str:
        if self.kind == "train":
            return f"train {self.task} {self.layout} seed={self.seed}"
        if self.kind == "dpo":
            return f"dpo {self.layout} seed={self.seed}"
        key = f"{self.kind} {self.task} {self.adapter or 'base'}"
        key += f" batch={self.batch}" if self.kind == "generate" else ""
        return key + (" @cpu" if self.cpu_copy else "")

    @property
    def name(self) -> str:
        """The key as a file name."""
        return self.key.replace(" @", "-").replace(" ", "-").replace("=", "")

    @property
    def train_key(self) -> str:
        return f"train {self.task} {self.adapter}"


def planned_runs(plan: dict[str, Any]) -> list[Run]:
    """Every run, most wanted first, so that a session which runs out keeps what matters most: the
    tool-call layouts at every seed; identity's at the first seed and the scoring of each task's
    base model and first-seed adapters (where its tokenizer runs: a task's 'scored'); DPO;
    generation speed; identity's other seeds and their scoring; the CPU's copies of the chip's runs
    its greedy tokens are compared with. A machine takes its own runs in this order."""
    seeds, runs = plan["seeds"], []
    trained = lambda task, chosen: [Run("train", task, layout, seed) for seed in chosen for layout in LAYOUTS]  # noqa: E731
    scored = lambda task, chosen: [Run("score", task, layout, seed, where=plan["tasks"][task]["scored"])  # noqa: E731
                                   for seed in chosen for layout in LAYOUTS]
    runs += trained("tools", seeds) + trained("identity", seeds[:1])
    for task in TASKS:
        runs += [Run("score", task, where=plan["tasks"][task]["scored"])] + scored(task, seeds if task == "tools" else seeds[:1])
    runs.append(Run("dpo", "dpo", "packed", seeds[0]))
    speed = plan["throughput"]
    layout, _, seed = speed["adapter"].partition(" seed=")
    runs += [Run("generate", speed["task"], layout, int(seed), batch) for batch in speed["batch_sizes"]]
    runs += trained("identity", seeds[1:]) + scored("identity", seeds[1:])
    compare = plan["compare"]
    for adapter in compare["adapters"]:
        layout, _, seed = adapter.partition(" seed=")
        runs.append(Run("score", compare["task"], "" if adapter == "base" else layout, int(seed or 0), where=HERE,
                        cpu_copy=True))
    return runs


def length_of(plan: dict[str, Any], run: Run) -> int:
    if run.kind == "dpo":
        return plan["dpo"]["length"]
    return plan["tasks"][run.task]["layouts"][run.layout]["length"]


def train_steps(plan: dict[str, Any], run: Run) -> int:
    if run.kind == "dpo":
        return steps_for(plan["dpo"]["rows"], plan["dpo"]["epochs"], plan["batch_size"], plan["max_steps"])
    task = plan["tasks"][run.task]
    return steps_for(task["layouts"][run.layout]["rows"], task["epochs"], plan["batch_size"], plan["max_steps"])


# ----------------------------------------------------------------------------- commands


def model_args(plan: dict[str, Any], weights: str | None) -> list[str]:
    weights = weights or plan["weights"]
    return ["--model", plan["model"], "--dtype", plan["dtype"]] + (["--weights", weights] if weights else [])


def cache_args(compile_cache: str | None) -> list[str]:
    return ["--compile-cache", compile_cache] if compile_cache else []


def train_command(plan: dict[str, Any], run: Run, work: str, out: str, weights: str | None,
                  compile_cache: str | None, evaluate: bool = True) -> list[str]:
    """`prepack train` for one layout and seed (or the DPO run): the same recipe at every layout,
    the schedule's warmup a fraction of the run's own steps; `evaluate`: the held-out records' loss
    before the first step and after the last (--eval-shards)."""
    steps = train_steps(plan, run)
    length = length_of(plan, run)
    cmd = ["python3", "-m", "apps.cli", "train", *model_args(plan, weights), "--batch-size", str(plan["batch_size"]),
           "--steps", str(steps), "--lora-rank", str(plan["lora_rank"]), "--learning-rate", str(plan["learning_rate"]),
           "--lr-schedule", plan["lr_schedule"], "--warmup-ratio", str(plan["warmup_ratio"]), "--seed", str(run.seed),
           "--attention", plan["attention"], "--remat", "none", *(["--scan-layers"] if plan["scan_layers"] else []),
           "--log-every", str(steps),
           "--metrics-out", os.path.join(out, "metrics", run.name + ".jsonl"), "--overwrite", *cache_args(compile_cache)]
    if run.kind == "dpo":
        return cmd + ["--shards", os.path.join(work, DEVICE, "dpo", "packed", f"L{length}"), "--objective", "dpo"]
    folder = os.path.join(work, DEVICE, run.task)
    cmd += ["--eval-shards", os.path.join(folder, "eval", f"L{length}")] if evaluate else []
    return cmd + ["--shards", os.path.join(folder, run.layout, f"L{length}"),
                  "--save-lora", os.path.join(out, "adapters", adapter_name(run.task, run.adapter))]


def adapter_name(task: str, adapter: str) -> str:
    return f"{task}-{adapter}".replace(" ", "-").replace("=", "")


def generate_command(plan: dict[str, Any], run: Run, work: str, out: str, adapter_dir: str | None,
                     weights: str | None, compile_cache: str | None) -> list[str]:
    """`prepack generate --score` on the task's held-out prompts (generate: the repeated prompts at one batch size)."""
    folder = os.path.join(work, DEVICE, run.task)
    prompts = "throughput.jsonl" if run.kind == "generate" else "heldout.jsonl"
    cmd = ["python3", "-m", "apps.cli", "generate", "--input", os.path.join(folder, prompts), "--format", "chat",
           *tokenizer_args(run.task, work), *model_args(plan, weights), "--score",
           "--max-new-tokens", str(plan["max_new_tokens"]),
           "--batch-size", str(run.batch or plan["generate_batch_size"]),
           "--output", os.path.join(out, "generations", run.name + ".jsonl"), "--overwrite", *cache_args(compile_cache)]
    limit = plan["throughput"]["max_prompts"].get(str(run.batch)) if run.kind == "generate" else None
    cmd += ["--max-prompts", str(limit)] if limit else []
    return cmd + (["--lora", adapter_dir] if adapter_dir else [])


def tokenizer_args(task: str, work: str) -> list[str]:
    """The tool-call task reads its records through the FunctionGemma-layout folder (transformers: here only)."""
    if task == "tools":
        return ["--tokenizer", f"hf:{os.path.join(work, HERE, 'tools', 'tokenizer')}", "--chat-format", "hf"]
    return []


# ----------------------------------------------------------------------------- results


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


TRAIN_FIELDS = ("steps", "median_step_time_s", "tokens_per_s", "target_tokens_per_s", "mfu", "first_step_time_s",
                "first_loss", "final_loss", "eval_loss", "target_tokens", "examples", "mean_target_density",
                "device_kind", "platform", "peak_tflops", "device_peak_bytes", "wall_time_s")


def train_figures(metrics: str, rows_per_epoch: int | None, batch_size: int) -> dict[str, Any] | None:
    """The summary's figures and, from the step records, the seconds: train_s (every step, the first
    with its compile), steps_s (the steps after the first), compile_s (the first step less a median
    step) and the last epoch's mean loss; None without a summary."""
    try:
        records = read_jsonl(metrics)
    except (OSError, ValueError):
        return None
    summary = next((r["summary"] for r in reversed(records) if "summary" in r), None)
    steps = [r for r in records if "step_time_s" in r and "step" in r]
    if summary is None or not steps:
        return None
    out = {k: summary.get(k) for k in TRAIN_FIELDS}
    first, rest = steps[0]["step_time_s"], [s["step_time_s"] for s in steps[1:]]
    median = statistics.median(rest) if rest else 0.0
    out.update({"train_s": first + sum(rest), "steps_s": sum(rest), "compile_s": max(0.0, first - median),
                "train_without_compile_s": sum(rest) + median})
    if rows_per_epoch:
        last = steps[-math.ceil(rows_per_epoch / batch_size):]
        losses = [s["loss"] for s in last if s.get("loss") is not None]
        out["last_epoch_loss"] = sum(losses) / len(losses) if losses else None
    out["evals"] = [{"step": e.get("step"), "loss": e.get("loss")} for e in summary.get("evals") or []]
    for key in ("rewards/accuracies", "rewards/margins"):  # DPO's
        if key in steps[-1]:
            out[f"final_{key}"] = steps[-1][key]
    return out


SCORE_FIELDS = ("prompts", "exact_match", "reference_nll", "valid_call_rate", "function_name_accuracy",
                "full_call_accuracy", "no_call_accuracy", "call_prompts", "no_call_prompts", "completion_tokens_mean",
                "generation", "weights", "dtype")


def score_figures(generations: str) -> dict[str, Any] | None:
    stem = generations[:-len(".jsonl")]
    try:
        with open(stem + ".score.json") as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    return {k: summary.get(k) for k in SCORE_FIELDS}


def final(result: dict[str, Any]) -> bool:
    """Ran, or did not fit (out of memory is not retried); a timeout or another failure is retried."""
    return "failed" not in result or str(result["failed"]).startswith(OUT_OF_MEMORY)


def empty_results() -> dict[str, Any]:
    return {"machine": {}, "runs": {}, "commands": []}


def load_results(path: str) -> dict[str, Any]:
    try:
        return results_file.load(path, empty_results(), lambda d: isinstance(d.get("runs"), dict))
    except results_file.UnreadableResults as e:
        raise CookbookError(f"{path}: unreadable ({e}); move it away") from None


def merge_results(into: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """Adds `other`'s runs that `into` lacks or has only failed; its machines and commands. The keys taken."""
    taken = [k for k, r in other["runs"].items() if final(r) and not (k in into["runs"] and final(into["runs"][k]))]
    for key in taken:
        into["runs"][key] = other["runs"][key]
    for key, value in other.get("machine", {}).items():
        into["machine"].setdefault(key, value)
    into["commands"] += [c for c in other.get("commands", []) if c not in into["commands"]]
    return taken


save_results = results_file.save


# ----------------------------------------------------------------------------- the estimate


def compile_key(run: Run, plan: dict[str, Any]) -> str:
    """Runs with one key run one compiled program: the second finds it in --compile-cache."""
    if run.kind in ("train", "dpo"):
        return f"{run.kind} {plan['batch_size']}x{length_of(plan, run)}"
    return f"generate batch={run.batch or plan['generate_batch_size']}"


def estimate_s(run: Run, plan: dict[str, Any], compiled: set[str], evaluate: bool = True) -> float:
    """Seconds one run should take (OPEN_S and the others above: measured where they say so)."""
    cached = compile_key(run, plan) in compiled
    if run.kind in ("train", "dpo"):
        tokens = plan["batch_size"] * length_of(plan, run)
        step = max(STEP_FLOOR_S, STEP_S_PER_16K_TOKENS * tokens / 16384) * (1.5 if run.kind == "dpo" else 1.0)
        evals = EVAL_COMPILE_S[cached] + 2 * step if evaluate and run.kind == "train" else 0.0
        return OPEN_S + WEIGHTS_S + TRAIN_COMPILE_S[cached] + evals + train_steps(plan, run) * step + SAVE_S
    prompts = plan["tasks"][run.task]["heldout_prompts"]
    if run.kind == "generate":
        prompts = plan["throughput"]["max_prompts"].get(str(run.batch)) or prompts * plan["throughput"]["repeat"]
    batch = run.batch or plan["generate_batch_size"]
    batches = math.ceil(prompts / batch)
    if run.where == HERE:
        return 30.0 + batches * batch * plan["max_new_tokens"] * CPU_GENERATE_S_PER_TOKEN
    return OPEN_S + WEIGHTS_S + SAMPLER_COMPILE_S[cached] + NLL_COMPILE_S[cached] + batches * plan["max_new_tokens"] * DECODE_STEP_S


def estimates(runs: Sequence[Run], plan: dict[str, Any], done: set[str] = frozenset(), evaluate: bool = True) -> dict[str, float]:
    """Each run's estimate in order, the compile cache filling as runs go; done runs cost nothing, and their shapes
    count as compiled (the cache of a machine kept warm; a fresh machine compiles them again)."""
    compiled: set[str] = set()
    out = {}
    for run in runs:
        out[run.key] = 0.0 if run.key in done else estimate_s(run, plan, compiled, evaluate)
        if run.where == DEVICE:
            compiled.add(compile_key(run, plan))
    return out


# ----------------------------------------------------------------------------- running


@dataclasses.dataclass
class Context:
    plan: dict[str, Any]
    work: str
    out: str
    weights: str | None
    compile_cache: str | None
    where: str
    log: Callable[[str], None] = print
    evaluate: bool = True  # the training runs' --eval-shards

    def adapter_dir(self, run: Run) -> str | None:
        """The adapter a score/generate run reads: made here (OUT/adapters), carried (WORK/device/adapters)
        or brought back (--import: WORK/here/adapters); None where none is."""
        name = adapter_name(run.task, run.adapter)
        places = [os.path.join(self.out, "adapters", name), os.path.join(self.work, DEVICE, "adapters", name),
                  os.path.join(self.work, HERE, "adapters", name)]
        return next((p for p in places if os.path.isdir(p) and os.listdir(p)), None)


def child_env(work: str) -> dict[str, str]:
    """The children's environment: the carried Gemma3 tokenizer model where there is one (a device has no GGUF
    package to build it from)."""
    env = dict(os.environ)
    cache = os.path.join(work, DEVICE, "cache")
    if os.path.isdir(cache) and "PREPACK_CACHE_DIR" not in env:
        env["PREPACK_CACHE_DIR"] = os.path.abspath(cache)
    return env


def run_child(cmd: list[str], log_path: str, timeout: float, env: dict[str, str]) -> tuple[int | None, float, str]:
    """(exit status or None on timeout, seconds, the output's last line) of one command, its output in log_path."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            code: int | None = subprocess.run([sys.executable, *cmd[1:]], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                              env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.perf_counter() - started
    with open(log_path, errors="replace") as log:
        lines = [line.strip() for line in log if line.strip()]
    return code, seconds, (lines or ["(no output)"])[-1][:400]


CHIP_BUSY_WAIT_S = 5.0


def chip_was_busy(log: str) -> bool:
    """Whether a child stopped because another process still held the TPU (libtpu's multi-process lock file)."""
    with open(log, errors="replace") as f:
        text = f.read()
    return "libtpu" in text and ("lockfile" in text or "lock file" in text or "already in use" in text)


def one_run(run: Run, ctx: Context, timeout: float) -> dict[str, Any] | None:
    """Runs one run in its own process; its figures, why there are none, or None when it cannot start yet."""
    plan = ctx.plan
    if run.kind in ("train", "dpo"):
        cmd = train_command(plan, run, ctx.work, ctx.out, ctx.weights, ctx.compile_cache, ctx.evaluate)
    else:
        adapter = ctx.adapter_dir(run) if run.adapter else None
        if run.adapter and adapter is None:
            ctx.log(f"{run.key}: waiting for the adapter of '{run.train_key}' (not made here, carried or imported)")
            return None
        cmd = generate_command(plan, run, ctx.work, ctx.out, adapter, ctx.weights, ctx.compile_cache)
    shown = shlex.join(cmd)
    ctx.log(f"$ {shown}")
    log = os.path.join(ctx.out, "logs", run.name + ".log")
    code, seconds, last = run_child(cmd, log, timeout, child_env(ctx.work))
    if code and chip_was_busy(log) and timeout - seconds > CHIP_BUSY_WAIT_S:
        # A TPU can refuse a process started just as the one before it ended: once more, a moment later.
        ctx.log(f"{run.key}: the chip was still held (libtpu's lock file); again in {CHIP_BUSY_WAIT_S:.0f} s")
        time.sleep(CHIP_BUSY_WAIT_S)
        code, again, last = run_child(cmd, log, timeout - seconds - CHIP_BUSY_WAIT_S, child_env(ctx.work))
        seconds += CHIP_BUSY_WAIT_S + again
    result: dict[str, Any] = {"command": shown, "process_s": seconds, "where": ctx.where}
    if code is None:
        return {**result, "failed": f"no result within {timeout:.0f} s (the call's time left)"}
    if run.kind in ("train", "dpo"):
        rows = None if run.kind == "dpo" else plan["tasks"][run.task]["layouts"][run.layout]["rows"]
        figures = train_figures(cmd[cmd.index("--metrics-out") + 1], rows, plan["batch_size"]) if code == 0 else None
        result.update({"steps_planned": train_steps(plan, run), "length": length_of(plan, run),
                       "batch_size": plan["batch_size"]})
    else:
        figures = score_figures(cmd[cmd.index("--output") + 1]) if code == 0 else None
        result["generations"] = os.path.relpath(cmd[cmd.index("--output") + 1], ctx.out)
    if figures is None:
        failed = f"{OUT_OF_MEMORY}: {last}" if OUT_OF_MEMORY in last.lower() else f"exit {code}: {last}"
        return {**result, "failed": failed}
    return {**result, **figures}


def run_all(args: argparse.Namespace, where: str) -> int:
    from benchmarks.device_machine import line, versions

    plan = read_plan(args.work_dir)
    out = args.out or os.path.join(args.work_dir, HERE, "out")
    path = os.path.join(out, RESULTS)
    data = load_results(path)
    resume = os.path.join(args.work_dir, DEVICE, RESUME)
    if where == DEVICE and os.path.isfile(resume):
        taken = merge_results(data, load_results(resume))
        print(f"{resume}: {len(taken)} finished runs taken", flush=True)
    data["commands"].append(shlex.join(["python3", "-m", "benchmarks.bench_cookbook_device", *sys.argv[1:]]))
    if where == DEVICE:
        data["machine"] = {**data["machine"], **versions()}
    ctx = Context(plan, args.work_dir, out, args.weights, args.compile_cache, where, evaluate=not args.no_eval)
    runs = [r for r in chosen_runs(plan, args.runs) if r.where == where]
    budget = args.budget_s if args.budget_s is not None else (540.0 if where == DEVICE else math.inf)
    deadline = time.perf_counter() + budget
    compiled = compiled_shapes(runs, plan, data, args.compile_cache)
    for run in runs:
        if run.key in data["runs"] and final(data["runs"][run.key]):
            print(f"{run.key}: already in {path}, skipped", flush=True)
            continue
        left, cost = deadline - time.perf_counter(), estimate_s(run, plan, compiled, not args.no_eval)
        if left < cost * args.margin:  # in priority order: what is not started now waits for the next call
            print(f"{run.key}: not started, {left:.0f} s left of --budget-s and it should take ~{cost:.0f} s; it and "
                  "the runs after it wait for the next call (run the command again)", flush=True)
            break
        result = one_run(run, ctx, left)
        if result is None:
            continue
        compiled.add(compile_key(run, plan))
        print(f"{run.key}: {json.dumps({k: v for k, v in result.items() if k not in ('command', 'evals', 'generation')})}",
              flush=True)
        if where == DEVICE and result.get("device_kind"):
            data["machine"].update({"device": result["device_kind"], "backend": result.get("platform")})
        data["runs"][run.key] = result
        save_results(path, data)  # after each run: a call that ends later keeps it
    save_results(path, data)
    if args.export:
        export(out, args.export, args.export_all)
    if data["machine"]:
        print(f"\nmachine: {line(data['machine'])}")
    print_tables(data, plan, args.work_dir, out)
    print(f"-> {path}", flush=True)
    return 0


def compiled_shapes(runs: Sequence[Run], plan: dict[str, Any], data: dict[str, Any], compile_cache: str | None) -> set[str]:
    """The shapes the estimate takes as compiled: those of the runs already done, where the compile cache holds
    anything (a machine kept warm); none on a fresh machine, whose /tmp went with the cache."""
    if not (compile_cache and os.path.isdir(compile_cache) and os.listdir(compile_cache)):
        return set()
    return {compile_key(r, plan) for r in runs if r.key in data["runs"] and final(data["runs"][r.key])}


def chosen_runs(plan: dict[str, Any], kinds: str | None) -> list[Run]:
    runs = planned_runs(plan)
    if not kinds:
        return runs
    wanted = set(kinds.split(","))
    unknown = wanted - {r.kind for r in runs} - set(TASKS) - {"dpo"}
    if unknown:
        raise CookbookError(f"--runs {kinds}: {', '.join(sorted(unknown))} is none of train, dpo, score, generate, "
                            f"{', '.join(TASKS)}")
    return [r for r in runs if r.kind in wanted or r.task in wanted]


# ----------------------------------------------------------------------------- export and import


MAX_RETURNED_FILES = 8  # what one device call brings back: 8 files,
MAX_RETURNED_BYTES = 15 * 2**20  # each under 16 MiB


def adapter_bundles(adapters: str, names: Sequence[str]) -> list[list[str]]:
    """The named adapters in tars of at most MAX_RETURNED_BYTES (a rank-8 270M adapter is 7.6 MB: two a tar)."""
    bundles: list[list[str]] = []
    size = 0
    for name in names:
        folder = os.path.join(adapters, name)
        got = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
        if not bundles or size + got > MAX_RETURNED_BYTES:
            bundles.append([])
            size = 0
        bundles[-1].append(name)
        size += got
    return bundles


def export(out: str, dest: str, again: bool = False) -> list[str]:
    """DEST (a device call's $OUT): the results, one tar of the small files (metrics, generations, logs) and the
    adapters no earlier call exported (every one with `again`), in tars under the 16 MiB a file may bring
    back: the CPU scores the tool-call ones, and a fresh machine is given back those its runs still need
    (--resume-kit)."""
    os.makedirs(dest, exist_ok=True)
    written = [os.path.join(dest, RESULTS)]
    shutil.copyfile(os.path.join(out, RESULTS), written[0])
    with tarfile.open(os.path.join(dest, FILES_TAR), "w:gz") as tar:
        for folder in ("metrics", "generations", "logs"):
            if os.path.isdir(os.path.join(out, folder)):
                tar.add(os.path.join(out, folder), arcname=folder)
    written.append(os.path.join(dest, FILES_TAR))
    adapters, record = os.path.join(out, "adapters"), os.path.join(out, "exported.json")
    before: set[str] = set()
    if not again and os.path.isfile(record):
        with open(record) as f:
            before = set(json.load(f))
    made = sorted(os.listdir(adapters)) if os.path.isdir(adapters) else []
    bundles = adapter_bundles(adapters, [name for name in made if name not in before])
    if len(bundles) > MAX_RETURNED_FILES - len(written):
        raise CookbookError(f"{len(bundles)} adapter tars and {len(written)} files are more than the "
                            f"{MAX_RETURNED_FILES} files a call brings back")
    for k, names in enumerate(bundles):
        written.append(os.path.join(dest, f"adapters-{k}.tar"))
        with tarfile.open(written[-1], "w") as tar:
            for name in names:
                tar.add(os.path.join(adapters, name), arcname=name)
    with open(record, "w") as f:
        json.dump(sorted(before | {name for names in bundles for name in names}), f)
    print(f"exported {len(written)} files to {dest} ({sum(map(len, bundles))} adapters)", flush=True)
    return written


def import_files(folder: str, work: str) -> None:
    """A device call's files into WORK/here: its runs merged into the results, the adapters unpacked."""
    here = os.path.join(work, HERE, "out")
    path = os.path.join(here, RESULTS)
    if not os.path.isfile(os.path.join(folder, RESULTS)):
        raise CookbookError(f"--import {folder}: no {RESULTS} (a device call's files, written by --export $OUT)")
    data = load_results(path)
    taken = merge_results(data, load_results(os.path.join(folder, RESULTS)))
    save_results(path, data)
    for name in sorted(os.listdir(folder)):
        if name == FILES_TAR or (name.startswith("adapters-") and name.endswith(".tar")):
            target = os.path.join(here, "device-files") if name == FILES_TAR else os.path.join(work, HERE, "adapters")
            with tarfile.open(os.path.join(folder, name)) as tar:
                tar.extractall(target, filter="data")
    print(f"--import {folder}: {len(taken)} runs taken into {path}", flush=True)


def resume_kit(work: str) -> dict[str, Any]:
    """For a fresh device machine: WORK/device/resume.json (the results so far: their runs are skipped) and
    WORK/device/adapters (the adapters the device's unfinished runs read). A run whose adapter did not come
    back is left out of resume.json, so that it trains again."""
    plan, here = read_plan(work), os.path.join(work, HERE)
    data = load_results(os.path.join(here, "out", RESULTS))
    done = lambda key: key in data["runs"] and final(data["runs"][key])  # noqa: E731
    waiting = [r for r in planned_runs(plan) if r.where == DEVICE and r.adapter and not done(r.key)]
    carried = os.path.join(work, DEVICE, "adapters")
    shutil.rmtree(carried, ignore_errors=True)
    retrain = []
    for run in {r.train_key: r for r in waiting}.values():
        name = adapter_name(run.task, run.adapter)
        if os.path.isdir(os.path.join(here, "adapters", name)):
            shutil.copytree(os.path.join(here, "adapters", name), os.path.join(carried, name))
        elif data["runs"].pop(run.train_key, None) is not None:
            retrain.append(run.train_key)
    save_results(os.path.join(work, DEVICE, RESUME), data)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(carried) for f in fs)
    print(f"{os.path.join(work, DEVICE, RESUME)}: {sum(map(done, data['runs']))} finished runs; {carried}: "
          f"{len(os.listdir(carried)) if os.path.isdir(carried) else 0} adapters ({size / 2**20:.1f} MiB)"
          + (f"; trains again (its adapter did not come back): {', '.join(retrain)}" if retrain else ""), flush=True)
    return data


# ----------------------------------------------------------------------------- tables


def mean_spread(values: Sequence[float | None], shown: Callable[[Any], str]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "-"
    mean = shown(statistics.mean(got))
    return mean if len(got) == 1 else f"{mean} ± {shown((max(got) - min(got)) / 2)}"


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def score_of(runs: dict[str, Any], task: str, adapter: str) -> dict[str, Any]:
    key = f"score {task} {adapter or 'base'}"
    return runs.get(key) or runs.get(key + " @cpu") or {}


def print_tables(data: dict[str, Any], plan: dict[str, Any], work: str, out: str) -> None:
    runs = data["runs"]
    for task in TASKS:
        print(f"\n{task}: {plan['model']}, batch {plan['batch_size']}, {plan['tasks'][task]['epochs']:g} epochs, "
              f"LoRA rank {plan['lora_rank']}, lr {plan['learning_rate']:g} {plan['lr_schedule']} "
              f"(warmup {plan['warmup_ratio']:.0%} of the steps)\n")
        print("| layout | seed | rows x L | steps | chip s to the end (first step) | steps after the first | target tokens/s "
              "| MFU | final loss (last epoch) | eval loss | full calls | valid calls | no-call | exact match |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for adapter in [""] + [f"{layout} seed={seed}" for layout in LAYOUTS for seed in plan["seeds"]]:
            score = score_of(runs, task, adapter)
            scored = (f"{rate(score.get('full_call_accuracy'))} | {rate(score.get('valid_call_rate'))} | "
                      f"{rate(score.get('no_call_accuracy'))} | {rate(score.get('exact_match'))}")
            if not adapter:
                print(f"| base model | | | | | | | | | | {scored} |")
                continue
            layout, _, seed = adapter.partition(" seed=")
            r = runs.get(f"train {task} {adapter}", {})
            shape = plan["tasks"][task]["layouts"][layout]
            if "failed" in r or not r:
                print(f"| {layout} | {seed} | {shape['rows']} x {shape['length']} | | {r.get('failed', 'not run')} | | | | | | {scored} |")
                continue
            mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.3f}"
            print(f"| {layout} | {seed} | {shape['rows']} x {shape['length']} | {r['steps']} | {r['train_s']:.1f} s "
                  f"({r['first_step_time_s']:.1f} s) | {r['steps_s']:.2f} s | {fmt(r['target_tokens_per_s'])} | {mfu} "
                  f"| {fmt(r['final_loss'])} ({fmt(r.get('last_epoch_loss'))}) | {fmt(r['eval_loss'])} | {scored} |")
        print_layout_summary(runs, task, plan["seeds"])
        ratios = layout_ratios(runs, task, plan["seeds"])
        if ratios:
            print("\n" + "; ".join(f"{what}: {value}" for what, value in ratios.items()))
    print_speed_tables(data, plan, work, out)


SUMMARY_COLUMNS = (("chip s to the end", "train", "train_s", fmt), ("less the compile", "train", "train_without_compile_s", fmt),
                   ("eval loss", "train", "eval_loss", fmt), ("full calls", "score", "full_call_accuracy", rate),
                   ("no-call", "score", "no_call_accuracy", rate), ("exact match", "score", "exact_match", rate),
                   ("reference NLL", "score", "reference_nll", fmt))


def print_layout_summary(runs: dict[str, Any], task: str, seeds: Sequence[int]) -> None:
    """Per layout, each figure's mean over the seeds ± half their spread: the noise the verdict is read against."""
    print(f"\n| layout ({len(seeds)} seeds: mean ± half the spread) | " + " | ".join(c[0] for c in SUMMARY_COLUMNS) + " |")
    print("|---" * (len(SUMMARY_COLUMNS) + 1) + "|")
    for layout in LAYOUTS:
        cells = []
        for _, kind, field, shown in SUMMARY_COLUMNS:
            values = []
            for seed in seeds:
                r = runs.get(f"train {task} {layout} seed={seed}", {}) if kind == "train" else score_of(runs, task, f"{layout} seed={seed}")
                values.append(None if "failed" in r else r.get(field))
            cells.append(mean_spread(values, shown))
        print(f"| {layout} | " + " | ".join(cells) + " |")


def layout_ratios(runs: dict[str, Any], task: str, seeds: Sequence[int]) -> dict[str, str]:
    """One example per row over packed: each seconds figure's mean over the seeds, and their ratio."""
    got: dict[str, dict[str, list[float]]] = {layout: {} for layout in LAYOUTS}
    for layout in LAYOUTS:
        for seed in seeds:
            r = runs.get(f"train {task} {layout} seed={seed}", {})
            if "failed" in r or not r:
                continue
            for field in ("train_s", "train_without_compile_s", "process_s"):
                got[layout].setdefault(field, []).append(r[field])
    out = {}
    names = {"train_s": "chip s to the end of training", "train_without_compile_s": "less the compile",
             "process_s": "the whole process (chip opened, weights, evals, adapter saved)"}
    for field, what in names.items():
        packed, unpacked = got["packed"].get(field), got["unpacked"].get(field)
        if packed and unpacked:
            p, u = statistics.mean(packed), statistics.mean(unpacked)
            out[what] = f"packed {p:.1f} s, one per row {u:.1f} s, {u / p:.2f}x"
    return out


def print_speed_tables(data: dict[str, Any], plan: dict[str, Any], work: str, out: str) -> None:
    runs = data["runs"]
    speed = plan["throughput"]
    rows = [(b, f"generate {speed['task']} {speed['adapter']} batch={b}") for b in speed["batch_sizes"]]
    rows.append((plan["generate_batch_size"], f"score {speed['task']} {speed['adapter']}"))  # the scoring run's batch
    rows = [(b, key, runs.get(key, {})) for b, key in sorted(rows)]
    if any(r.get("generation") for _, _, r in rows):
        print(f"\nGeneration with the {speed['task']} adapter ({speed['adapter']}), --max-new-tokens {plan['max_new_tokens']}:\n")
        print("| batch | run | prompts | tokens | tokens/s | tokens/s without compiling | exact match |")
        print("|---|---|---|---|---|---|---|")
        for batch, key, r in rows:
            g = r.get("generation") or {}
            print(f"| {batch} | {key} | {fmt(r.get('prompts'))} | {fmt(g.get('tokens'))} | {fmt(g.get('tokens_per_s'))} "
                  f"| {fmt(g.get('steady_tokens_per_s'))} | {rate(r.get('exact_match'))} |")
    agreement = greedy_agreement_rows(data, plan, work, out)
    if agreement:
        print_agreement(agreement)
    dpo, sft = runs.get(f"dpo packed seed={plan['seeds'][0]}", {}), runs.get(f"train tools packed seed={plan['seeds'][0]}", {})
    if dpo and "failed" not in dpo:
        ratio = f", {dpo['median_step_time_s'] / sft['median_step_time_s']:.2f}x SFT's" if sft.get("median_step_time_s") else ""
        print(f"\nDPO at {plan['batch_size']} x {plan['dpo']['length']} ({plan['dpo']['rows']} rows of pairs): step "
              f"{dpo['median_step_time_s']:.4f} s{ratio} ({fmt(sft.get('median_step_time_s'))} s); first-step loss "
              f"{dpo['first_loss']:.6f} (ln 2 = {LN2:.6f}); first step {dpo['first_step_time_s']:.1f} s")


def greedy_agreement_rows(data: dict[str, Any], plan: dict[str, Any], work: str, out: str) -> list[dict[str, Any]]:
    """Per compared run, the chip's generations against the CPU's (both read where --import and --here left them)."""
    compare, runs, rows = plan["compare"], data["runs"], []
    for adapter in compare["adapters"]:
        key = f"score {compare['task']} {'base' if adapter == 'base' else adapter}"
        chip, cpu = runs.get(key, {}), runs.get(key + " @cpu", {})
        if not chip.get("generations") or not cpu.get("generations"):
            continue
        chip_file = os.path.join(out, "device-files", chip["generations"])
        if not os.path.isfile(chip_file):
            chip_file = os.path.join(out, chip["generations"])  # this folder is the device's own
        cpu_file = os.path.join(out, cpu["generations"])
        if not (os.path.isfile(chip_file) and os.path.isfile(cpu_file)):
            continue
        rows.append({"run": key, **agreement_summary(compare_generations(cpu_file, chip_file, tokenizer_of(compare["task"], work)))})
    return rows


def agreement_summary(counts: list[dict[str, Any]]) -> dict[str, Any]:
    equal = [c["equal"] for c in counts]
    return {"prompts": len(counts), "all_equal": sum(c["equal"] == c["cpu"] == c["chip"] for c in counts),
            "min": min(equal), "median": statistics.median(equal), "cpu_median": statistics.median(c["cpu"] for c in counts),
            "parted": [c for c in counts if not c["equal"] == c["cpu"] == c["chip"]]}


def print_agreement(rows: list[dict[str, Any]], shown: int = 3) -> None:
    print("\nGreedy tokens the chip shares with the CPU (completions re-encoded; leading tokens equal):\n")
    print("| run | prompts | all equal | fewest equal | median equal | CPU tokens (median) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['run']} | {row['prompts']} | {row['all_equal']} | {row['min']} | {row['median']:g} | {row['cpu_median']:g} |")
    for row in rows:
        for c in row["parted"][:shown]:
            print(f"  {row['run']}, {c['id']}: {c['equal']} of {c['cpu']} equal; after {c['before']!r}: "
                  f"CPU {c['cpu_next']!r}, chip {c['chip_next']!r}")


def tokenizer_of(task: str, work: str) -> Any:
    from prepack.text.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_args(task, work)[1] if task == "tools" else "gemma3")


def compare_generations(reference: str, other: str, tokenizer: Any) -> list[dict[str, Any]]:
    """Per prompt (by id), the leading tokens both completions share, re-encoded from their texts (the lines hold
    no ids), and where they part: {id, equal, cpu, chip, before, cpu_next, chip_next}. Prompts of one file the
    other lacks are an error."""
    ref, oth = ({line["id"]: line["completion"] for line in read_jsonl(p)} for p in (reference, other))
    if set(ref) != set(oth):
        raise CookbookError(f"{other}: not the prompts of {reference} ({len(set(ref) ^ set(oth))} ids differ)")
    counts = []
    for prompt_id, text in ref.items():
        a, b = list(tokenizer.encode(text)), list(tokenizer.encode(oth[prompt_id]))
        equal = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        counts.append({"id": prompt_id, "equal": equal, "cpu": len(a), "chip": len(b),
                       "before": tokenizer.decode(a[max(0, equal - 4):equal]), "cpu_next": tokenizer.decode(a[equal:equal + 3]),
                       "chip_next": tokenizer.decode(b[equal:equal + 3])})
    return counts


def compare_files(reference: str, other: str, tokenizer_spec: str) -> int:
    """--compare: every prompt's count, then the summary."""
    from prepack.text.tokenizer import load_tokenizer

    counts = compare_generations(reference, other, load_tokenizer(tokenizer_spec))
    for c in counts:
        tail = "" if c["equal"] == c["cpu"] == c["chip"] else f"; after {c['before']!r}: {c['cpu_next']!r} / {c['chip_next']!r}"
        print(f"{c['id']}: {c['equal']} equal of {c['cpu']} / {c['chip']} tokens{tail}")
    print_agreement([{"run": f"{os.path.basename(reference)} / {os.path.basename(other)}", **agreement_summary(counts)}], 0)
    return 0


# ----------------------------------------------------------------------------- --prepare (here, with Beam)


def read_plan(work: str) -> dict[str, Any]:
    path = os.path.join(work, DEVICE, PLAN)
    try:
        with open(path) as f:
            plan = json.load(f)
    except OSError:
        raise CookbookError(f"no {path}: run `python -m benchmarks.bench_cookbook_device --prepare --work-dir {work}` "
                            "here first (it needs Beam), then carry the folder") from None
    missing = sorted(set(recipe(smoke=False)) - set(plan))
    if missing:
        raise CookbookError(f"{path} has no {', '.join(missing)}: an older --prepare wrote it; run --prepare again")
    return plan


def pack(args: list[str], say: Callable[[str], None]) -> None:
    cmd = [sys.executable, "-m", "apps.cli", "pack", *args, "--overwrite", "--no-progress"]
    say("$ " + shlex.join(["python", *cmd[1:]]))
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise CookbookError(f"packing failed ({done.returncode}): {(done.stderr.strip().splitlines() or ['?'])[-1]}")


def set_facts(folder: str) -> dict[str, int]:
    """A shard set's rows, examples read and written, and its longest row's tokens (with one example per
    row: the longest example)."""
    from loaders.shards import open_shards

    with open_shards(folder) as view:
        valid = view.read(list(range(len(view))), check=False)["valid_mask"]
        stats = view.manifest.stats
    return {"rows": len(valid), "examples": int(stats["examples_written"]), "examples_read": int(stats["examples_read"]),
            "longest": int(valid.sum(axis=1).max()) if len(valid) else 0}


def write_task_records(task: str, folder: str, batch_size: int, repeat: int) -> dict[str, int]:
    """train.jsonl, heldout.jsonl (scored), eval.jsonl (the held-out records, as many as fill whole batches: the
    eval pass drops a short last batch) and throughput.jsonl (the held-out prompts `repeat` times)."""
    from benchmarks import bench_generate_identity, bench_generate_tools

    module = bench_generate_tools if task == "tools" else bench_generate_identity
    train, heldout = module.records(False), module.records(True)
    evaluated = heldout[: len(heldout) // batch_size * batch_size]
    os.makedirs(folder, exist_ok=True)
    for name, records in (("train", train), ("heldout", heldout), ("eval", evaluated), ("throughput", heldout * repeat)):
        bench_generate_identity.write_jsonl(os.path.join(folder, f"{name}.jsonl"), records)
    return {"train_records": len(train), "heldout_prompts": len(heldout), "eval_records": len(evaluated)}


def prepare_task(task: str, plan: dict[str, Any], work: str, say: Callable[[str], None]) -> dict[str, Any]:
    """One task's records and shard sets: packed at the task's L; one example per row at the longest example
    (train or held-out) rounded up to plan['length_multiple']; the held-out eval records one per row at both."""
    device, here = os.path.join(work, DEVICE, task), os.path.join(work, HERE, task)
    spec = plan["tasks"][task]
    facts = write_task_records(task, device, plan["batch_size"], plan["throughput"]["repeat"])
    source = ["--format", "chat", *tokenizer_args(task, work)]
    if task == "tools" and not os.path.isfile(os.path.join(here, "tokenizer", "tokenizer.json")):
        cmd = [sys.executable, "-m", "apps.cli", "tokenizer-folder", "--output", os.path.join(here, "tokenizer"), "--overwrite"]
        say("$ " + shlex.join(["python", *cmd[1:]]))
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    length = spec["max_length"]
    longest = 0
    for name in ("train", "eval"):  # one example per row at the task's L: the longest example of each
        probe = os.path.join(here, f"probe-{name}")
        pack(["--input", os.path.join(device, f"{name}.jsonl"), *source, "--max-length", str(length), "--no-pack",
              "--output", probe], say)
        got = set_facts(os.path.join(probe, f"L{length}"))
        if got["examples"] != got["examples_read"]:
            raise CookbookError(f"{task}: {got['examples_read'] - got['examples']} {name} examples do not fit L{length}; "
                                "raise the task's max_length")
        longest = max(longest, got["longest"])
    unpacked = min(length, round_up(longest, plan["length_multiple"]))
    pack(["--input", os.path.join(device, "train.jsonl"), *source, "--max-length", str(length), "--output",
          os.path.join(device, "packed")], say)
    pack(["--input", os.path.join(device, "train.jsonl"), *source, "--max-length", str(unpacked), "--no-pack",
          "--output", os.path.join(device, "unpacked")], say)
    pack(["--input", os.path.join(device, "eval.jsonl"), *source, "--max-length", *sorted({str(length), str(unpacked)}),
          "--no-pack", "--output", os.path.join(device, "eval")], say)
    layouts = {"packed": {"length": length, **set_facts(os.path.join(device, "packed", f"L{length}"))},
               "unpacked": {"length": unpacked, **set_facts(os.path.join(device, "unpacked", f"L{unpacked}"))}}
    return {**spec, **facts, "longest_example": longest, "layouts": layouts,
            "steps": {layout: steps_for(v["rows"], spec["epochs"], plan["batch_size"], plan["max_steps"])
                      for layout, v in layouts.items()}}


def prepare_dpo(plan: dict[str, Any], work: str, say: Callable[[str], None]) -> dict[str, Any]:
    length = plan["tasks"][plan["dpo"]["task_shape"]]["max_length"]
    folder = os.path.join(work, DEVICE, "dpo", "packed")
    pack(["--input", DPO_SAMPLE, "--format", "preference", "--max-length", str(length), "--output", folder], say)
    facts = set_facts(os.path.join(folder, f"L{length}"))
    return {**plan["dpo"], "length": length, "rows": facts["rows"], "pairs": facts["examples"],
            "steps": steps_for(facts["rows"], plan["dpo"]["epochs"], plan["batch_size"], plan["max_steps"])}


def copy_tokenizer_model(work: str) -> None:
    """The Gemma3 SentencePiece model built from the GGUF (cached here), for the device's `--tokenizer gemma3`."""
    from prepack.text import gemma3_gguf
    from prepack.text.tokenizer import load_tokenizer

    load_tokenizer("gemma3")  # builds the cached model if it is not there yet
    model = gemma3_gguf.cached_model_path()
    cache = os.path.join(work, DEVICE, "cache")
    os.makedirs(cache, exist_ok=True)
    for path in (str(model), str(model) + ".identity.json"):
        if os.path.isfile(path):
            shutil.copy(path, cache)


def prepare(args: argparse.Namespace) -> int:
    say = lambda text: print(text, flush=True)  # noqa: E731
    plan = recipe(args.smoke)
    started = time.perf_counter()
    for task in TASKS:
        plan["tasks"][task] = prepare_task(task, plan, args.work_dir, say)
    plan["dpo"] = prepare_dpo(plan, args.work_dir, say)
    copy_tokenizer_model(args.work_dir)
    path = os.path.join(args.work_dir, DEVICE, PLAN)
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)
    device = os.path.join(args.work_dir, DEVICE)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(device) for f in fs)
    say(f"wrote {path} in {time.perf_counter() - started:.0f} s; carry {device} ({size / 2**20:.1f} MiB)")
    print_plan(plan)
    return 0


def print_plan(plan: dict[str, Any], done: set[str] = frozenset(), budget_s: float = 540.0, evaluate: bool = True) -> None:
    runs = planned_runs(plan)
    costs = estimates(runs, plan, done, evaluate)
    for task in TASKS:
        t = plan["tasks"][task]
        print(f"{task}: {t['train_records']} records, longest {t['longest_example']} tokens; packed {t['layouts']['packed']['rows']} "
              f"rows x {t['layouts']['packed']['length']}, one per row {t['layouts']['unpacked']['rows']} x "
              f"{t['layouts']['unpacked']['length']}; {t['epochs']:g} epochs = {t['steps']['packed']} and {t['steps']['unpacked']} "
              f"steps of {plan['batch_size']}")
    for where in (DEVICE, HERE):
        print(f"\n{'on the device' if where == DEVICE else 'here (CPU)'}:")
        total = 0.0
        for i, run in enumerate([r for r in runs if r.where == where], 1):
            total += costs[run.key]
            steps = f", {train_steps(plan, run)} steps at {plan['batch_size']} x {length_of(plan, run)}" if run.kind in ("train", "dpo") else ""
            state = "done" if run.key in done else f"~{costs[run.key]:.0f} s"
            print(f"{i:2d}. {run.key}{steps}: {state} (total ~{total:.0f} s)")
    calls = device_calls([costs[r.key] for r in runs if r.where == DEVICE and r.key not in done], budget_s)
    print(f"\ndevice calls of --budget-s {budget_s:.0f}: " + "; ".join(
        f"{k + 1}: {len(call)} runs, ~{sum(call):.0f} s" for k, call in enumerate(calls)) + f" (~{sum(map(sum, calls)):.0f} s)")


def device_calls(costs: Sequence[float], budget_s: float) -> list[list[float]]:
    """The runs' estimates cut into calls as run_all takes them: in order, a call ends before the first that would
    not fit its budget (a run longer than a whole budget gets a call of its own)."""
    calls: list[list[float]] = []
    for cost in costs:
        if not calls or sum(calls[-1]) + cost > budget_s:
            calls.append([])
        calls[-1].append(cost)
    return calls


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default=".cookbook", help="WORK/device (carried to the device) and WORK/here (this machine's)")
    step = p.add_mutually_exclusive_group()
    step.add_argument("--prepare", action="store_true", help="here: records, shard sets (Beam), plan.json")
    step.add_argument("--plan", action="store_true", help="the runs in order with estimated seconds")
    step.add_argument("--here", action="store_true", help="this machine's runs (CPU scoring, the CPU's generations)")
    step.add_argument("--table", action="store_true", help="the tables of WORK/here/out's results")
    step.add_argument("--resume-kit", action="store_true",
                      help="for a fresh device machine: WORK/device/resume.json and the adapters its unfinished runs read")
    step.add_argument("--compare", nargs=2, metavar=("CPU.jsonl", "CHIP.jsonl"),
                      help="two `prepack generate` outputs of the same prompts: per prompt, the leading greedy tokens they share")
    p.add_argument("--tokenizer", default="gemma3", help="--compare: the tokenizer that re-encodes the completions")
    p.add_argument("--smoke", action="store_true", help="--prepare: the tiny random model, three steps a run, one seed")
    p.add_argument("--out", default=None, help="results folder (default: /tmp/cookbook on the device, WORK/here/out here)")
    p.add_argument("--weights", default=None, help="each run's --weights (on the device: the joined GGUF's path)")
    p.add_argument("--compile-cache", default=None, help="each device run's --compile-cache (default: /tmp/xla, off with --smoke's plan)")
    p.add_argument("--runs", default=None, help="only these kinds or tasks, comma-separated (train, dpo, score, generate, tools, identity)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall time for this call (default 540 s on the device, none here); a run that would not fit "
                   "waits for the next call, with those after it")
    p.add_argument("--no-eval", action="store_true",
                   help="the training runs skip --eval-shards (about 120 s of chip time in all: each shape's eval "
                   "compiles); the scoring's reference NLL is then the held-out loss")
    p.add_argument("--margin", type=float, default=1.0, help="start a run only with its estimate times this left")
    p.add_argument("--export", default=None, metavar="DIR", help="after the runs, the files the CPU needs into DIR ($OUT)")
    p.add_argument("--export-all", action="store_true", help="--export every adapter, also those an earlier call exported")
    p.add_argument("--import", dest="import_from", default=None, metavar="DIR", help="a device call's files: merged here first")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.prepare:
            return prepare(args)
        if args.compare:
            return compare_files(*args.compare, args.tokenizer)
        if args.import_from:
            import_files(args.import_from, args.work_dir)
        if args.plan:
            plan = read_plan(args.work_dir)
            out = args.out or os.path.join(args.work_dir, HERE, "out")
            print_plan(plan, {k for k, r in load_results(os.path.join(out, RESULTS))["runs"].items() if final(r)},
                       args.budget_s or 540.0, not args.no_eval)
            return 0
        if args.resume_kit:
            resume_kit(args.work_dir)
            return 0
        if args.table:
            out = args.out or os.path.join(args.work_dir, HERE, "out")
            print_tables(load_results(os.path.join(out, RESULTS)), read_plan(args.work_dir), args.work_dir, out)
            return 0
        if args.here:
            return run_all(args, HERE)
        if args.import_from:
            return 0
        plan = read_plan(args.work_dir)
        if args.compile_cache is None and plan["model"] == "gemma3-270m":
            args.compile_cache = "/tmp/xla"
        args.out = args.out or ("/tmp/cookbook" if plan["model"] == "gemma3-270m" else os.path.join(args.work_dir, "device-out"))
        return run_all(args, DEVICE)
    except CookbookError as e:
        print(f"bench_cookbook_device: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
