"""Packer quality and speed: rows against the lower bound, global BFD, and Grain's online first-fit.

Real samples ($PREPACK_BENCH_DATA, benchmarks/data.py) tokenized by both families on the same records: Gemma3
(gemma chat format) and Qwen3 (the embedded qwen3 tokenizer, Qwen3 ChatML with its think
block); other lengths, so other densities. And 1M synthetic lengths. Grain's FirstFitPackIterDataset is run for real on the
real-sample lengths (pool of 16 rows, how MaxText packs online).

    python -m benchmarks.bench_packer --synthetic 1000000
    python -m benchmarks.bench_packer --plan-only   # just the job's planning step (build_plans)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from benchmarks.data import DATA_DIR
from testkit import plans

DATASETS = {"alpaca": ("alpaca.jsonl", "alpaca"), "oasst1": ("oasst1.jsonl", "prompt_response"),
            "opus_en_fr": ("opus_en_fr.jsonl", "translation")}


# Tokenizer spec -> its chat format.
FAMILIES = {"gemma3": "gemma", "qwen3": "qwen3"}


def real_lengths(data_dir: Path, tokenizer_spec: str = "gemma3") -> dict[str, list[int]]:
    from prepack.text.chat import get_chat_format, tokenize_conversations
    from prepack.text.formats import get_template
    from prepack.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_spec)
    chat = get_chat_format(FAMILIES[tokenizer_spec], tokenizer)
    out = {}
    for name, (file, template_name) in DATASETS.items():
        template = get_template(template_name)
        convs = [c for line in (data_dir / file).open() for c in template.to_conversations(json.loads(line))]
        out[f"{name} ({tokenizer_spec})"] = [len(e.input_ids) for e in tokenize_conversations(convs, tokenizer, chat)]
    return out


def grain_first_fit_rows(lengths: list[int], max_length: int, pool_rows: int) -> int:
    import grain

    items = [{"inputs": np.ones(n, np.int32)} for n in lengths]
    ds = grain.MapDataset.source(items).to_iter_dataset()
    packed = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"inputs": max_length}, num_packing_bins=pool_rows, shuffle_bins=False)
    return sum(1 for _ in packed)


def quality_table(name: str, lengths: list[int], max_lengths: list[int], pool_rows: int, run_grain: bool) -> list[str]:
    lines = []
    for L in max_lengths:
        kept = [n for n in lengths if n <= L]
        bound = math.ceil(sum(kept) / L)
        t0 = time.perf_counter()
        bfd = len(plans.pack_best_fit_decreasing(kept, L))
        dt = time.perf_counter() - t0
        sim = plans.first_fit_in_pools(kept, L, pool_rows)
        grain_rows = grain_first_fit_rows(kept, L, pool_rows) if run_grain else None
        grain_cell = f"{grain_rows} ({grain_rows / bound:.4f})" if grain_rows else "-"
        lines.append(
            f"| {name} | {L} | {len(kept):,} | {len(lengths) - len(kept)} | {bound:,} | {bfd:,} ({bfd / bound:.4f}) "
            f"| {grain_cell} | {sim:,} ({sim / bound:.4f}) | {sum(kept) / (bfd * L):.4f} | {sum(kept) / (len(kept) * L):.4f} "
            f"| {len(kept) / dt:,.0f} |")
    return lines


def job_histogram(num_examples: int, max_lengths: list[int], seed: int = 0) -> dict[tuple[int, int, int], int]:
    """The (L, length_key, b) histogram the packing job plans from: SFT-like lognormal
    lengths (median ~80 tokens, clipped to 1..2048), --overlong drop, hash sub-buckets."""
    from pipelines.planning import choose_sub_buckets

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(math.log(80), 1.0, num_examples).astype(np.int64), 1, 2048)
    buckets = rng.integers(0, choose_sub_buckets(num_examples, pack=True), num_examples)
    hist: dict[tuple[int, int, int], int] = {}
    for L in max_lengths:
        keep = lengths <= L
        keys, counts = np.unique(np.stack([lengths[keep], buckets[keep]]), axis=1, return_counts=True)
        hist.update({(L, int(n), int(b)): int(c) for (n, b), c in zip(keys.T, counts)})
    return hist


def plan_timing(num_examples: int, max_lengths: list[int], repeats: int = 3) -> str:
    """Wall time of build_plans (the job's single-process planning step), best of `repeats`."""
    from testkit.plans import build_plans

    hist = job_histogram(num_examples, max_lengths)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        plans = build_plans(hist, tuple(max_lengths), True, None, 256.0)
        best = min(best, time.perf_counter() - t0)
    rows = ", ".join(f"L={L}: {p.num_rows:,} rows" for L, p in plans.items())
    return (f"build_plans on {num_examples:,} lognormal examples ({len(hist):,} histogram entries), "
            f"L in {max_lengths}: {best:.3f} s ({rows})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path(DATA_DIR))
    ap.add_argument("--synthetic", type=int, default=1_000_000)
    ap.add_argument("--max-length", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--pool-rows", type=int, default=16)
    ap.add_argument("--plan-examples", type=int, nargs="+", default=[200_000, 1_000_000],
                    help="example counts for the build_plans timing")
    ap.add_argument("--plan-only", action="store_true", help="only time build_plans")
    ap.add_argument("--tokenizers", nargs="+", default=list(FAMILIES), choices=list(FAMILIES),
                    help="tokenizer families for the real samples (default: both)")
    args = ap.parse_args()

    if args.plan_only:
        for n in args.plan_examples:
            print(plan_timing(n, args.max_length), flush=True)
        return

    header = ("| data | L | examples | dropped (> L) | lower bound rows | global BFD rows (÷ bound) | Grain first-fit, "
              f"pool {args.pool_rows} (÷ bound) | pool first-fit sim (÷ bound) | BFD density | unpacked density | BFD examples/s |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    if args.data.exists():
        for spec in args.tokenizers:
            for name, lengths in real_lengths(args.data, spec).items():
                print("\n".join(quality_table(name, lengths, args.max_length, args.pool_rows, run_grain=True)), flush=True)
    rng = np.random.default_rng(0)
    synthetic = np.clip(rng.lognormal(4.6, 1.0, args.synthetic).astype(int), 4, 4096).tolist()
    print("\n".join(quality_table(f"synthetic lognormal ({args.synthetic:,})", synthetic, args.max_length,
                                  args.pool_rows, run_grain=False)), flush=True)

    # Planning from a histogram is what the distributed job does.
    L = 2048
    kept = [n for n in synthetic if n <= L]
    t0 = time.perf_counter()
    hist: dict[int, int] = {}
    for n in kept:
        hist[n] = hist.get(n, 0) + 1
    plan = plans.plan_from_histogram(hist, L)
    dt = time.perf_counter() - t0
    print(f"\nplan_from_histogram on {len(kept):,} synthetic lengths at L={L}: {len(plan):,} rows in {dt:.2f} s "
          f"({len(kept) / dt:,.0f} examples/s, including the histogram)")
    for n in args.plan_examples:
        print(plan_timing(n, args.max_length), flush=True)


if __name__ == "__main__":
    main()
