"""Packer quality and speed: rows against the lower bound, global BFD, and Grain's online first-fit.

Real samples (../shared/data, Gemma3 tokenizer, Gemma chat template) and 1M
synthetic lengths. Grain's FirstFitPackIterDataset is run for real on the
real-sample lengths (pool of 16 rows, how MaxText packs online).

    python benchmarks/bench_packer.py --data ../shared/data --synthetic 1000000
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

from prepack import packer

DATASETS = {"alpaca": ("alpaca.jsonl", "alpaca"), "oasst1": ("oasst1.jsonl", "prompt_response"),
            "opus_en_fr": ("opus_en_fr.jsonl", "translation")}


def real_lengths(data_dir: Path) -> dict[str, list[int]]:
    from prepack.chat_formats import get_chat_format, tokenize_conversations
    from prepack.templates import get_template
    from prepack.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("gemma3")
    chat = get_chat_format("gemma", tokenizer)
    out = {}
    for name, (file, template_name) in DATASETS.items():
        template = get_template(template_name)
        convs = [c for line in (data_dir / file).open() for c in template.to_conversations(json.loads(line))]
        out[name] = [len(e.input_ids) for e in tokenize_conversations(convs, tokenizer, chat)]
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
        bfd = len(packer.pack_best_fit_decreasing(kept, L))
        dt = time.perf_counter() - t0
        sim = packer.first_fit_in_pools(kept, L, pool_rows)
        grain_rows = grain_first_fit_rows(kept, L, pool_rows) if run_grain else None
        grain_cell = f"{grain_rows} ({grain_rows / bound:.4f})" if grain_rows else "-"
        lines.append(
            f"| {name} | {L} | {len(kept):,} | {len(lengths) - len(kept)} | {bound:,} | {bfd:,} ({bfd / bound:.4f}) "
            f"| {grain_cell} | {sim:,} ({sim / bound:.4f}) | {sum(kept) / (bfd * L):.4f} | {sum(kept) / (len(kept) * L):.4f} "
            f"| {len(kept) / dt:,.0f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("../shared/data"))
    ap.add_argument("--synthetic", type=int, default=1_000_000)
    ap.add_argument("--max-length", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--pool-rows", type=int, default=16)
    args = ap.parse_args()

    header = ("| data | L | examples | dropped (> L) | lower bound rows | global BFD rows (÷ bound) | Grain first-fit, "
              f"pool {args.pool_rows} (÷ bound) | pool first-fit sim (÷ bound) | BFD density | unpacked density | BFD examples/s |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    if args.data.exists():
        for name, lengths in real_lengths(args.data).items():
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
    plan = packer.plan_from_histogram(hist, L)
    dt = time.perf_counter() - t0
    print(f"\nplan_from_histogram on {len(kept):,} synthetic lengths at L={L}: {len(plan):,} rows in {dt:.2f} s "
          f"({len(kept) / dt:,.0f} examples/s, including the histogram)")


if __name__ == "__main__":
    main()
