"""End-to-end throughput of `prepack pack` against the raw batched tokenizer, same run.

For each real sample in $PREPACK_BENCH_DATA (benchmarks/data.py) (alpaca, oasst1 as prompt/response,
opus_en_fr as en->fr translation), repeated to at least --examples examples
into a temp folder (never the repository):

1. raw tokenizer: `tokenizer.encode_batch` on exactly the text pieces the
   job encodes (template + chat format, batches of 512), one core, measured
   before and after the job (the machine is shared; both are reported);
2. the job on all cores (FnApiRunner multi-processing, the default runner):
   examples/s, tokens/s, and the ratio per core against (1);
3. with --breakdown: the job on one in-process worker, where the per-stage
   time counters (read, template, tokenize, fit, route, write, copy) add up
   to the wall time, and the rest is Beam itself and the launcher.

Workers are started with a private bytecode cache (PYTHONPYCACHEPREFIX under
the work folder): this sandbox sets PYTHONDONTWRITEBYTECODE, so every worker
process would otherwise recompile Beam from source (~10 s each).

    python -m benchmarks.bench_pack_job --examples 200000 --breakdown
    python -m benchmarks.bench_pack_job --tokenizers gemma3 qwen3 --examples 50000   # both families, same data
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

from benchmarks.data import DATA_DIR as DATA
DATASETS = {
    # name: (file, --format, template options)
    "alpaca": ("alpaca.jsonl", "alpaca", {}),
    "oasst1": ("oasst1.jsonl", "prompt_response", {}),
    "opus_en_fr": ("opus_en_fr.jsonl", "translation", {"source_lang": "en", "target_lang": "fr"}),
}
STAGES = ("read", "template", "tokenize", "fit", "route", "write", "copy")


def repeat_to(src: str, dst: str, n: int) -> int:
    with open(src, "rb") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    written = 0
    with open(dst, "wb") as out:
        while written < n:
            for line in lines:
                out.write(line + b"\n")
                written += 1
    return written


def raw_tokenizer(path: str, fmt: str, options: dict, batch: int = 512, tokenizer: str = "gemma3") -> dict:
    """encode_batch over the job's own text pieces: one core, no Beam."""
    from prepack.text.chat import get_chat_format
    from prepack.text.formats import get_template
    from prepack.text.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    layout = get_chat_format("auto", tok)
    template = get_template(fmt, **options)
    with open(path, "rb") as f:
        records = [json.loads(line) for line in f]
    pieces_per_batch = []
    for lo in range(0, len(records), batch):
        texts = []
        for record in records[lo : lo + batch]:
            for conv in template.to_conversations(record):
                texts += [p for p, _ in layout.segments(conv) if isinstance(p, str) and p]
        pieces_per_batch.append(texts)
    tokens = 0
    started, cpu_started = time.perf_counter(), time.process_time()
    for texts in pieces_per_batch:
        tokens += sum(len(ids) for ids in tok.encode_batch(texts))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return {"tokens": tokens, "seconds": seconds, "cpu": cpu, "tokens_per_s": tokens / seconds, "tokens_per_cpu_s": tokens / cpu}


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def run_job(path: str, fmt: str, options: dict, out: str, max_lengths: list[int], beam_args: list[str],
            tokenizer: str = "gemma3") -> dict:
    from pipelines.launch.job import run
    from pipelines.options import parse_args

    args = ["--input", path, "--format", fmt, "--output", out, "--overwrite", "--no-progress",
            "--tokenizer", tokenizer, "--max-length", *map(str, max_lengths)]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", value]
    config, beam = parse_args(args + beam_args)
    self_before, children_before = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = run(config, beam)
    wall = time.perf_counter() - started
    self_after, children_after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    launcher_cpu = _cpu(self_after) - _cpu(self_before)
    workers_cpu = _cpu(children_after) - _cpu(children_before)
    first = result.stats[max_lengths[0]]
    stages = {s: result.metrics.get(f"time_us_{s}", 0) / 1e6 for s in STAGES}
    return {
        "wall": wall,
        "launcher_cpu": launcher_cpu,
        "workers_cpu": workers_cpu,
        "examples": first["examples_read"],
        "tokens": result.metrics.get("tokens_tokenized", 0),
        "window_copies": result.metrics.get("example_copies_to_windows", 0) / max(1, result.metrics.get("examples_routed", 0)),
        "stages": stages,
        "rows": {L: s["rows"] for L, s in result.stats.items()},
        "rows_over_bound": {L: s["rows_over_lower_bound"] for L, s in result.stats.items()},
    }


def make_workdir(workdir: str | None, prefix: str) -> str:
    """The benchmark's temp folder, also holding a bytecode cache for the Beam workers: this
    sandbox sets PYTHONDONTWRITEBYTECODE, so each worker would otherwise compile Beam from source."""
    work = workdir or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(work, exist_ok=True)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = os.path.join(work, "pycache")
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
    sys.dont_write_bytecode = False
    return work


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=200_000)
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    ap.add_argument("--max-length", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--workers", type=int, default=0, help="direct_num_workers (0: all cores)")
    ap.add_argument("--breakdown", action="store_true", help="also run one in-process worker for the per-stage times")
    ap.add_argument("--workdir", default=None, help="temp folder (default: a new one under /tmp)")
    ap.add_argument("--tokenizers", nargs="+", default=["gemma3"], choices=["gemma3", "qwen3"],
                    help="tokenizer specs, each against its own raw tokenizer on the same data (default gemma3)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    work = make_workdir(args.workdir, "prepack-bench-")
    import multiprocessing

    cores = args.workers or multiprocessing.cpu_count()
    multi = ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", f"--direct_num_workers={cores}"]
    single = ["--runner=FnApiRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]

    # Warm-up: fills the bytecode cache and the tokenizer cache; not timed.
    warm = os.path.join(work, "warm.jsonl")
    repeat_to(os.path.join(DATA, "alpaca.jsonl"), warm, 200)
    for spec in args.tokenizers:
        run_job(warm, "alpaca", {}, os.path.join(work, "warm_out"), [512], multi, spec)

    results = {}
    for name in args.datasets:
        file, fmt, options = DATASETS[name]
        path = os.path.join(work, f"{name}.jsonl")
        n = repeat_to(os.path.join(DATA, file), path, args.examples)
        for spec in args.tokenizers:
            key = name if args.tokenizers == ["gemma3"] else f"{name} ({spec})"
            load_before = os.getloadavg()[0]
            raw_before = raw_tokenizer(path, fmt, options, tokenizer=spec)
            job = run_job(path, fmt, options, os.path.join(work, f"out_{name}"), args.max_length, multi, spec)
            raw_after = raw_tokenizer(path, fmt, options, tokenizer=spec)
            entry = {"records": n, "cores": cores, "raw_before": raw_before, "raw_after": raw_after, "job": job,
                     "load_before": load_before, "load_after": os.getloadavg()[0]}
            if args.breakdown:
                entry["single"] = run_job(path, fmt, options, os.path.join(work, f"out1_{name}"), args.max_length, single, spec)
            results[key] = entry
            if args.json:  # after each dataset, so a long run interrupted still leaves what it measured
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=2, default=str)
            shutil.rmtree(os.path.join(work, f"out_{name}"), ignore_errors=True)
            shutil.rmtree(os.path.join(work, f"out1_{name}"), ignore_errors=True)
            print(f"{key}: done", file=sys.stderr, flush=True)

    print(report(results, args.max_length))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


def report(results: dict, max_lengths: list[int]) -> str:
    lines = [
        f"Max lengths {' '.join(map(str, max_lengths))} in one run (one tokenization, three shard sets). "
        "Raw tokenizer = `encode_batch` on the same text pieces, batches of 512, one core. "
        "Ratios compare time for the same tokenizing work: wall ratio per core = raw wall / (job wall x cores); "
        "CPU ratio = raw CPU / job CPU (launcher + workers), which a shared machine does not distort.",
        "",
        "| dataset | examples | tokens | cores | job wall (s) | job examples/s | job tokens/s | job CPU (s) | raw wall (s) | raw CPU (s) | raw tokens/s (wall) | ratio per core (wall) | ratio (CPU) | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in results.items():
        job = e["job"]
        raw_wall = (e["raw_before"]["seconds"] + e["raw_after"]["seconds"]) / 2
        raw_cpu = (e["raw_before"]["cpu"] + e["raw_after"]["cpu"]) / 2
        job_cpu = job["launcher_cpu"] + job["workers_cpu"]
        raw_tps = (e["raw_before"]["tokens_per_s"] + e["raw_after"]["tokens_per_s"]) / 2
        lines.append(
            f"| {name} | {job['examples']:,} | {job['tokens']:,} | {e['cores']} | {job['wall']:.1f} | "
            f"{job['examples'] / job['wall']:,.0f} | {job['tokens'] / job['wall']:,.0f} | {job_cpu:.1f} | {raw_wall:.1f} | "
            f"{raw_cpu:.1f} | {raw_tps:,.0f} | {raw_wall / (job['wall'] * e['cores']):.2f} | {raw_cpu / job_cpu:.2f} | "
            f"{e['load_before']:.1f} / {e['load_after']:.1f} |"
        )
    singles = {n: e for n, e in results.items() if "single" in e}
    if singles:
        lines += ["", "Where the time goes: the same job on one in-process worker, CPU seconds per stage "
                  "(`beam + launcher` = the rest of the process's CPU time: coders, shuffles, the launcher's "
                  "checks and the tokenizer identity).", ""]
        lines.append("| dataset | job CPU | " + " | ".join(STAGES) + " | beam + launcher | raw tokenizer CPU | ratio (CPU, 1 core) | wall |")
        lines.append("|---|---|" + "---|" * len(STAGES) + "---|---|---|---|")
        for name, e in singles.items():
            s = e["single"]
            cpu = s["launcher_cpu"] + s["workers_cpu"]
            rest = cpu - sum(s["stages"].values())
            raw_cpu = (e["raw_before"]["cpu"] + e["raw_after"]["cpu"]) / 2
            lines.append(
                f"| {name} | {cpu:.1f} | " + " | ".join(f"{s['stages'][k]:.1f}" for k in STAGES)
                + f" | {rest:.1f} | {raw_cpu:.1f} | {raw_cpu / cpu:.2f} | {s['wall']:.1f} |"
            )
    lines += ["", "Rows over the lower bound ceil(tokens / L) (the rows are exactly the global BFD rows):", ""]
    for name, e in results.items():
        lines.append(f"- {name}: " + ", ".join(f"L{L} {v:.4f}" for L, v in e["job"]["rows_over_bound"].items()))
    lines += ["", f"Write-window copies per example (how often an example's tokens cross the shuffle to the write "
              f"windows: 1 = once for all {len(max_lengths)} max lengths, {len(max_lengths)} = once per max length):", ""]
    for name, e in results.items():
        lines.append(f"- {name}: {e['job']['window_copies']:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
