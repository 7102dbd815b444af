"""Regenerating shards for a new max length from the tokenized set, against a full run, same run.

For Alpaca and OASST1 (as prompt/response), each repeated to at least --examples examples
into a temp folder (never the repository), on the default local runner (FnApiRunner,
multi-processing, all cores):

1. a full run at --first-lengths (512 1024 2048), which also publishes OUTPUT/tokens;
2. `--from-tokens OUTPUT/tokens` at --new-length (4096): no inputs read, no tokenizer;
3. the baseline: a full run at --new-length with --no-tokens (what regenerating costs today);
4. with --overhead: run 1 again with --no-tokens, for what writing the tokenized set adds.

Reported: CPU (launcher + workers, the figure a shared machine does not distort) and wall
of each run, the ratios (2) / (3), the tokenized set's bytes per token, and a check that
(2) and (3) wrote the same shards (sha256 of every shard and the dead letter).

    python -m benchmarks.bench_from_tokens --data DIR --examples 200000 --overhead
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import sys
import time

from benchmarks.bench_pack_job import DATA, DATASETS, make_workdir, repeat_to  # the same data preparation


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def timed_run(args: list[str], beam_args: list[str]) -> dict:
    from pipelines.launch.job import run
    from pipelines.options import parse_args

    config, beam = parse_args(args + ["--no-progress", "--overwrite"] + beam_args)
    self_before, children_before = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = run(config, beam)
    wall = time.perf_counter() - started
    self_after, children_after = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = _cpu(self_after) - _cpu(self_before) + _cpu(children_after) - _cpu(children_before)
    first = next(iter(result.stats.values()))
    return {"wall": wall, "cpu": cpu, "examples": first["examples_read"],
            "rows": {L: s["rows"] for L, s in result.stats.items()}}


def set_digest(folder: str) -> str:
    """sha256 over the shard set's files except the manifest (whose created_at and lineage differ)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name != "manifest.json":
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.environ.get("PREPACK_BENCH_DATA", DATA),
                    help="folder with alpaca.jsonl and oasst1.jsonl (the real samples)")
    ap.add_argument("--examples", type=int, default=200_000)
    ap.add_argument("--datasets", nargs="+", default=["alpaca", "oasst1"], choices=list(DATASETS))
    ap.add_argument("--first-lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--new-length", type=int, default=4096)
    ap.add_argument("--overhead", action="store_true", help="also run the first run with --no-tokens")
    ap.add_argument("--workdir", default=None, help="temp folder (default: a new one under /tmp)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    work = make_workdir(args.workdir, "prepack-bench-tokens-")
    beam_args = ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", f"--direct_num_workers={os.cpu_count()}"]

    warm = os.path.join(work, "warm.jsonl")
    repeat_to(os.path.join(args.data, "alpaca.jsonl"), warm, 200)
    timed_run(["--input", warm, "--format", "alpaca", "--output", os.path.join(work, "warm_out"), "--max-length", "512"], beam_args)

    new = str(args.new_length)
    results = {}
    for name in args.datasets:
        file, fmt, options = DATASETS[name]
        path = os.path.join(work, f"{name}.jsonl")
        n = repeat_to(os.path.join(args.data, file), path, args.examples)
        source = ["--input", path, "--format", fmt]
        for key, value in options.items():
            source += [f"--{key.replace('_', '-')}", value]
        first_out, from_out, full_out = (os.path.join(work, f"{name}_{k}") for k in ("first", "from", "full"))
        first_lengths = [str(L) for L in args.first_lengths]
        entry: dict = {"records": n, "load_before": os.getloadavg()[0]}
        entry["first"] = timed_run(source + ["--output", first_out, "--max-length", *first_lengths], beam_args)
        with open(os.path.join(first_out, "tokens", "manifest.json"), encoding="utf-8") as f:
            tokens = json.load(f)
        entry["tokens_set"] = {"bytes": tokens["stats"]["bytes"], "tokens": tokens["tokens"], "files": len(tokens["shards"]),
                               "bytes_per_token": tokens["stats"]["bytes_per_token"]}
        entry["from_tokens"] = timed_run(["--from-tokens", os.path.join(first_out, "tokens"), "--output", from_out,
                                          "--max-length", new], beam_args)
        entry["full"] = timed_run(source + ["--output", full_out, "--max-length", new, "--no-tokens"], beam_args)
        entry["same_shards"] = set_digest(os.path.join(from_out, f"L{new}")) == set_digest(os.path.join(full_out, f"L{new}"))
        if args.overhead:
            entry["first_no_tokens"] = timed_run(source + ["--output", os.path.join(work, f"{name}_first_nt"),
                                                           "--max-length", *first_lengths, "--no-tokens"], beam_args)
        entry["load_after"] = os.getloadavg()[0]
        results[name] = entry
        for k in ("first", "from", "full", "first_nt"):
            shutil.rmtree(os.path.join(work, f"{name}_{k}"), ignore_errors=True)
        os.remove(path)
        print(f"{name}: done", file=sys.stderr, flush=True)

    print(report(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


def report(results: dict, args: argparse.Namespace) -> str:
    L = args.new_length
    lines = [
        f"First run: full, L {' '.join(map(str, args.first_lengths))}, publishes the tokenized set. "
        f"Then L {L} two ways: --from-tokens, and a full run with --no-tokens (the baseline). "
        f"CPU = launcher + workers. {os.cpu_count()} cores, FnApiRunner multi-processing.",
        "",
        f"| dataset | examples | first run CPU (s) / wall (s) | tokenized set: MB, files, bytes per token | "
        f"from-tokens L{L} CPU / wall | full L{L} CPU / wall | ratio CPU | ratio wall | same shards | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in results.items():
        f, t, full, ts = e["first"], e["from_tokens"], e["full"], e["tokens_set"]
        lines.append(
            f"| {name} | {f['examples']:,} | {f['cpu']:.1f} / {f['wall']:.1f} | {ts['bytes'] / 1e6:.1f}, {ts['files']}, "
            f"{ts['bytes_per_token']:.2f} | {t['cpu']:.1f} / {t['wall']:.1f} | {full['cpu']:.1f} / {full['wall']:.1f} | "
            f"**{t['cpu'] / full['cpu']:.2f}** | {t['wall'] / full['wall']:.2f} | {'yes' if e['same_shards'] else 'NO'} | "
            f"{e['load_before']:.1f} / {e['load_after']:.1f} |"
        )
    with_overhead = {n: e for n, e in results.items() if "first_no_tokens" in e}
    if with_overhead:
        lines += ["", "What publishing the tokenized set adds to the first run (the same run with --no-tokens):", "",
                  "| dataset | with tokens CPU / wall | --no-tokens CPU / wall | CPU added |", "|---|---|---|---|"]
        for name, e in with_overhead.items():
            a, b = e["first"], e["first_no_tokens"]
            lines.append(f"| {name} | {a['cpu']:.1f} / {a['wall']:.1f} | {b['cpu']:.1f} / {b['wall']:.1f} | "
                         f"{100 * (a['cpu'] / b['cpu'] - 1):+.0f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
