"""The planners against the lower bound: BFD and `best` (exact fills over the length histogram,
or BFD where that is not fewer), in the same run, on the same lengths.

    python -m benchmarks.bench_planner [--unique-pairs 1000000] [--scale 10000000 100000000]

- rows over the bound ceil(tokens / L) for `--planner bfd` and `--planner best` at L 512, 1024,
  2048 and 4096, on the real samples ($PREPACK_BENCH_DATA: Alpaca, OASST1, OPUS EN-FR,
  tokenized in process with the embedded gemma3 tokenizer, gemma chat format) and on 1M unique
  EN-FR pairs (the sample's pairs, copy c of each suffixed " (c)" in both languages, as
  benchmarks/bench_worker_memory.py writes them, all tokenized for real); examples longer than
  L are dropped, as `--overlong drop` does;
- the same rows with a segment cap of 4, 8 and 16 (`--max-segments-per-row`);
- planner CPU and peak RSS at 10M and 100M examples (the synthetic lognormal histogram of
  benchmarks/bench_plan_scale.py, the job's sub-buckets, L 2048 and 512): LengthPlanner's whole
  work, each (size, planner) in its own process.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from benchmarks.data import DATA_DIR

REPO = Path(__file__).resolve().parent.parent
LENGTHS = (512, 1024, 2048, 4096)
CAPS = (4, 8, 16)
SAMPLES = {"alpaca": ("alpaca.jsonl", "alpaca"), "oasst1": ("oasst1.jsonl", "prompt_response"),
           "oasst1_chat": ("oasst1_chat.jsonl", "chat"), "opus_en_fr": ("opus_en_fr.jsonl", "translation")}


def tokenized_lengths(records: list[dict], template_name: str) -> np.ndarray:
    from prepack.text.chat import get_chat_format, tokenize_conversations_flat
    from prepack.text.formats import get_template
    from prepack.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("gemma3")
    chat = get_chat_format("gemma", tokenizer)
    template = get_template(template_name)
    out = []
    for lo in range(0, len(records), 20_000):
        convs = [c for r in records[lo:lo + 20_000] for c in template.to_conversations(r)]
        flat = tokenize_conversations_flat(convs, tokenizer, chat)
        if flat is not None:
            out.append(np.diff(np.concatenate([[0], flat[2]])))
    return np.concatenate(out).astype(np.int64)


def sample_lengths(data_dir: Path) -> dict[str, np.ndarray]:
    out = {}
    for name, (file, template_name) in SAMPLES.items():
        records = [json.loads(line) for line in (data_dir / file).open(encoding="utf-8") if line.strip()]
        out[name] = tokenized_lengths(records, template_name)
    return out


def unique_pair_lengths(data_dir: Path, n: int) -> np.ndarray:
    pairs = [json.loads(line) for line in (data_dir / "opus_en_fr.jsonl").open(encoding="utf-8") if line.strip()]
    records = []
    for i in range(n):
        copy, k = divmod(i, len(pairs))
        records.append({"en": f"{pairs[k]['en']} ({copy})", "fr": f"{pairs[k]['fr']} ({copy})"})
    return tokenized_lengths(records, "translation")


def martello_toth_bound(histogram: dict[int, int], max_length: int) -> int:
    """The L2 lower bound (Martello and Toth, 1990): for every a <= L/2, the items longer than
    L - a and those longer than L/2 each need a row of their own, and the items in [a, L/2]
    need the room those rows leave, or more rows. At least ceil(tokens / L); tighter when
    many items are longer than L/2 (they cannot share a row)."""
    L = max_length
    counts = np.zeros(L + 1, dtype=np.int64)
    for n, c in histogram.items():
        counts[n] += c
    sizes = np.arange(L + 1, dtype=np.int64)
    items = np.concatenate([[0], np.cumsum(counts)])  # items[k]: items of length < k
    tokens = np.concatenate([[0], np.cumsum(counts * sizes)])
    best = math.ceil(int(tokens[-1]) / L)
    half = L // 2
    for a in range(0, half + 1):
        j1 = int(items[L + 1] - items[L - a + 1]) if a else 0
        j2_items = int(items[L - a + 1] - items[half + 1])
        j2_tokens = int(tokens[L - a + 1] - tokens[half + 1])
        j3_tokens = int(tokens[half + 1] - tokens[max(a, 1)])
        best = max(best, j1 + j2_items + max(0, -(-(j3_tokens - (j2_items * L - j2_tokens)) // L)))
    return best


def plan_rows(histogram: dict[int, int], max_length: int, planner: str, cap: int | None) -> tuple[int, int, float]:
    """(rows, BFD's rows, CPU seconds) of one planner."""
    from prepack.packing.packer import HistogramPlan

    started = time.process_time()
    plan = HistogramPlan(histogram, max_length, planner, cap)
    for _ in plan.classes():
        pass
    return plan.num_rows, plan.bfd_rows, time.process_time() - started


def quality(name: str, lengths: np.ndarray, caps: tuple[int | None, ...]) -> list[dict]:
    out = []
    for L in LENGTHS:
        kept = lengths[lengths <= L]
        histogram = dict(Counter(kept.tolist()))
        bound = math.ceil(int(kept.sum()) / L)
        l2 = martello_toth_bound(histogram, L)
        for cap in caps:
            bfd, _, bfd_s = plan_rows(histogram, L, "bfd", cap)
            best, bfd_rows, best_s = plan_rows(histogram, L, "best", cap)
            assert bfd_rows == bfd and best <= bfd
            row = {"dataset": name, "L": L, "cap": cap, "examples": len(kept), "dropped": len(lengths) - len(kept),
                   "bound": bound, "l2_bound": l2, "cap_bound": max(bound, math.ceil(len(kept) / cap)) if cap else bound,
                   "bfd": bfd, "best": best, "bfd_s": round(bfd_s, 3), "best_s": round(best_s, 3)}
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def scale_child(num_examples: int, max_length: int, planner: str) -> dict:
    from benchmarks.bench_plan_scale import synthetic_histogram
    from pipelines.planning import LengthPlanner, choose_sub_buckets

    hist = synthetic_histogram(num_examples, max_length, choose_sub_buckets(num_examples, True))
    # Building the histogram peaks higher than planning: reset the peak (VmHWM) to what is held now.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss_before = _status_mb("VmRSS")
    started = time.process_time()
    planner_ = LengthPlanner(hist, max_length, True, planner=planner)
    for _ in planner_.group_slices():
        pass
    plan = planner_.plan()
    cpu = time.process_time() - started
    rss = _status_mb("VmHWM")
    tokens = sum(k * c for (_, k, _), c in hist.items())
    return {"examples": num_examples, "L": max_length, "planner": planner, "method": plan.method, "rows": plan.num_rows,
            "bfd_rows": plan.bfd_rows, "bound": math.ceil(tokens / max_length), "cpu_s": round(cpu, 2),
            "peak_rss_mb": round(rss, 1), "rss_before_planning_mb": round(rss_before, 1),
            "planner_bytes_per_row": round((rss - rss_before) * 2**20 / max(plan.num_rows, 1), 2)}


def scale(sizes: list[int], lengths: tuple[int, ...]) -> list[dict]:
    out = []
    for L in lengths:
        for n in sizes:
            for planner in ("bfd", "best"):
                cmd = [sys.executable, "-m", "benchmarks.bench_planner", "--scale-child", str(n), str(L), planner]
                done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True)
                row = json.loads(done.stdout.strip().splitlines()[-1])
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


def over(rows: int, bound: int) -> str:
    return f"{rows:,} (+{rows - bound})"


def markdown(quality_rows: list[dict], scale_rows: list[dict]) -> str:
    lines = ["| dataset | L | examples | bound | L2 bound | BFD | best | BFD CPU s | best CPU s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in quality_rows:
        if r["cap"] is None:
            lines.append(f"| {r['dataset']} | {r['L']} | {r['examples']:,} | {r['bound']:,} | {r['l2_bound']:,} "
                         f"| {over(r['bfd'], r['bound'])} | {over(r['best'], r['bound'])} | {r['bfd_s']} | {r['best_s']} |")
    lines += ["", "Rows over max(ceil(tokens / L), ceil(examples / cap)), the bound under a cap:", "",
              "| dataset | L | " + " | ".join(f"bound cap {c} | BFD cap {c} | best cap {c}" for c in CAPS) + " |",
              "|---|---|" + "---|---|---|" * len(CAPS)]
    by = {(r["dataset"], r["L"], r["cap"]): r for r in quality_rows}
    for (name, L) in dict.fromkeys((r["dataset"], r["L"]) for r in quality_rows):
        if (name, L, CAPS[0]) not in by:
            continue
        cells = []
        for c in CAPS:
            r = by[(name, L, c)]
            cells.append(f"{r['cap_bound']:,} | {over(r['bfd'], r['cap_bound'])} | {over(r['best'], r['cap_bound'])}")
        lines.append(f"| {name} | {L} | " + " | ".join(cells) + " |")
    if scale_rows:
        lines += ["", "| examples | L | planner | rows | BFD rows | bound | CPU s | peak RSS MB | planner B/row |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in scale_rows:
            lines.append(f"| {r['examples']:,} | {r['L']} | {r['planner']} ({r['method']}) | {r['rows']:,} | {r['bfd_rows']:,} "
                         f"| {r['bound']:,} | {r['cpu_s']} | {r['peak_rss_mb']} | {r['planner_bytes_per_row']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path(DATA_DIR))
    ap.add_argument("--unique-pairs", type=int, default=1_000_000, help="EN-FR unique pairs (0: none)")
    ap.add_argument("--scale", type=int, nargs="*", default=[10_000_000, 100_000_000], help="example counts for CPU/RSS")
    ap.add_argument("--scale-lengths", type=int, nargs="*", default=[2048, 512])
    ap.add_argument("--scale-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.scale_child:
        n, L, planner = args.scale_child
        print(json.dumps(scale_child(int(n), int(L), planner)))
        return
    datasets = sample_lengths(args.data)
    if args.unique_pairs:
        started = time.perf_counter()
        datasets[f"en_fr_unique_{args.unique_pairs // 1000}k"] = unique_pair_lengths(args.data, args.unique_pairs)
        print(f"tokenized {args.unique_pairs:,} unique pairs in {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for name, lengths in datasets.items():
        rows += quality(name, lengths, (None, *CAPS))
    print("\n" + markdown(rows, scale(args.scale, tuple(args.scale_lengths)) if args.scale else []))


if __name__ == "__main__":
    main()
