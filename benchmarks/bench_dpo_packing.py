"""Packed DPO against Tunix's padded DPO batches, on a real public preference sample (issue 48).

One run packs the sample with `prepack pack --format preference` (Gemma 3's tokenizer and chat
format) at each max length L and compares, at the same (B, L):

- packed: B rows of L tokens, each holding whole pairs (both sides adjacent segments), as
  `prepack train --objective dpo` reads them;
- Tunix 0.1.7's DPOTrainer: B pairs per step, each side a row of L = P + C tokens (the prompt
  left-padded to `max_prompt_length` P, the completion right-padded to `max_response_length` C;
  tunix/sft/dpo/dpo_trainer.py), chosen and rejected concatenated to [2B, L]. Its split of L is
  given its best: the P that keeps the most of the pairs whole (Tunix cuts the rest).

Both count the same pairs (those the job packed at L) tokenized once; the step compute is the
token slots the model runs (packed B·L, Tunix 2·B·L: its chosen and rejected rectangles). It
reports pairs and completion tokens per step, completion tokens per slot, and their ratio; the
pair rows' real-token density and their count against the lower bound ceil(tokens / L) and
Martello and Toth's L2 bound (benchmarks/bench_planner.py), which any packer must reach. Then
the DPO step's planned memory against the SFT step's at one shape (`prepack train --plan-memory`,
Gemma3 270M, random bf16 weights: the plan needs shapes, not values; SFT on the shipped Alpaca
sample packed at the same L).

The sample: LLaMA-Factory's `data/dpo_zh_demo.json` (hiyouga/LLaMA-Factory, Apache-2.0; a ranking
file `{conversations: [{from, value}], chosen: {from, value}, rejected: {from, value}}`), one
record a line, in `$PREPACK_BENCH_DATA/dpo_zh_sharegpt.jsonl` (benchmarks/data.py).

    python -m benchmarks.bench_dpo_packing                       # L 1024 2048 4096, B 8; plan at (4, 1024)
    python -m benchmarks.bench_dpo_packing --no-plan             # the packing comparison alone (a minute)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from benchmarks.bench_planner import martello_toth_bound
from benchmarks.data import DATA_DIR

RANKING_COLUMNS = ["--columns", "prompt=conversations,role=from,content=value", "--roles", "user=human,assistant=gpt"]
SAMPLE_SFT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "prepack", "sample_data", "sample_sft.jsonl")


def pack(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "apps.cli", "pack", *args, "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")


def pair_sizes(segment_ids: np.ndarray) -> np.ndarray:
    """Each pair's tokens in the rows: its two adjacent segments (chosen, then rejected)."""
    sizes = []
    for row in segment_ids:
        ids, counts = np.unique(row[row != 0], return_counts=True)
        counts = counts[np.argsort(ids)]
        sizes += (counts[0::2] + counts[1::2]).tolist()
    return np.asarray(sizes)


def read_rows(path: str) -> tuple[Any, dict[str, np.ndarray]]:
    import loaders

    view = loaders.open_shards(path)
    rows = [view[i] for i in range(len(view))]
    return view.manifest, {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def tunix_split(prompts: np.ndarray, completions: np.ndarray, length: int) -> tuple[int, int]:
    """(P, pairs kept whole): Tunix's max_prompt_length P (C = L - P) that keeps the most pairs whole."""
    best = (0, -1)
    for p in range(1, length):
        kept = int(np.sum((prompts <= p) & (completions <= length - p)))
        if kept > best[1]:
            best = (p, kept)
    return best


def compare(path: str, batch: int) -> dict[str, Any]:
    from testkit import tunix_dpo as td

    manifest, rows = read_rows(path)
    length = int(manifest.max_length)
    pairs = td.pairs_of_rows(rows)
    n_rows = rows["segment_ids"].shape[0]
    real = int(np.sum(rows["segment_ids"] != 0))
    targets = int(np.sum(rows["loss_mask"]))
    completion = np.array([len(p.chosen) + len(p.rejected) for p in pairs])
    assert int(completion.sum()) == targets, "each side's targets are one contiguous completion"
    prompts = np.array([len(p.prompt) for p in pairs])
    longest_side = np.array([max(len(p.chosen), len(p.rejected)) for p in pairs])
    p_len, kept = tunix_split(prompts, longest_side, length)
    whole = (prompts <= p_len) & (longest_side <= length - p_len)
    lower = math.ceil(real / length)
    # A pair over half a row shares it with no other such pair: Martello and Toth's L2 bound says
    # how many rows any packer needs, where ceil(tokens / L) cannot be reached.
    sizes = pair_sizes(rows["segment_ids"])
    assert len(sizes) == len(pairs) and int(sizes.sum()) == real
    l2 = martello_toth_bound(dict(zip(*(x.tolist() for x in np.unique(sizes, return_counts=True)))), length)
    packed_per_step = batch * targets / n_rows
    tunix_per_step = batch * float(completion[whole].mean())
    out = {
        "L": length, "B": batch, "pairs": len(pairs), "rows": n_rows, "lower_bound_rows": lower,
        "l2_bound_rows": l2, "rows_over_l2_bound": n_rows - l2,
        "rows_over_lower_bound": n_rows / lower - 1, "density": real / (n_rows * length),
        "stats_pairs_written": manifest.stats.get("pairs_written"), "stats_pairs_dropped": manifest.stats.get("pairs_dropped"),
        "packed_pairs_per_step": batch * len(pairs) / n_rows, "packed_completion_tokens_per_step": packed_per_step,
        "packed_completion_per_slot": packed_per_step / (batch * length),
        "tunix_max_prompt_length": p_len, "tunix_max_response_length": length - p_len, "tunix_pairs_whole": kept,
        "tunix_pairs_per_step": batch, "tunix_completion_tokens_per_step": tunix_per_step,
        "tunix_completion_per_slot": tunix_per_step / (2 * batch * length),
    }
    out["pairs_per_step_ratio"] = out["packed_pairs_per_step"] / batch
    out["completion_per_compute_ratio"] = out["packed_completion_per_slot"] / out["tunix_completion_per_slot"]
    return out


def plan(shards: str, objective: str, batch: int) -> dict[str, Any]:
    from train import cli

    out = io.StringIO()
    args = ["--shards", shards, "--model", "gemma3-270m", "--weights", "random", "--lora-rank", "16",
            "--batch-size", str(batch), "--plan-memory", "--objective", objective]
    with contextlib.redirect_stdout(out):
        rc = cli.main(args)
    if rc != 0:
        raise SystemExit(f"prepack train {' '.join(args)} failed ({rc})")
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    return {"objective": objective, "B": batch, **{k: result[k] for k in ("argument_bytes", "temp_bytes", "peak_bytes", "flops")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", default=os.path.join(DATA_DIR, "dpo_zh_sharegpt.jsonl"))
    p.add_argument("--max-length", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--plan-shape", default="4x1024", help="BxL of the memory plans (L must be one of --max-length)")
    p.add_argument("--no-plan", action="store_true", help="skip the memory plans (two compiles of Gemma3 270M)")
    args = p.parse_args()
    if not os.path.exists(args.input):
        raise SystemExit(f"{args.input}: not found; see benchmarks/data.py for where the sample goes")
    started = time.perf_counter()
    lengths = [str(x) for x in args.max_length]
    with tempfile.TemporaryDirectory() as tmp:
        pack(["--input", args.input, "--format", "preference", *RANKING_COLUMNS, "--max-length", *lengths,
              "--output", os.path.join(tmp, "pairs")])
        results = [compare(os.path.join(tmp, "pairs", f"L{length}"), args.batch_size) for length in args.max_length]
        for r in results:
            print(json.dumps(r), flush=True)
        plans = []
        if not args.no_plan:
            b, length = (int(x) for x in args.plan_shape.split("x"))
            pack(["--input", SAMPLE_SFT, "--format", "alpaca", "--max-length", str(length), "--output", os.path.join(tmp, "sft")])
            plans = [plan(os.path.join(tmp, "sft", f"L{length}"), "sft", b),
                     plan(os.path.join(tmp, "pairs", f"L{length}"), "dpo", b)]
            for r in plans:
                print(json.dumps({**r, "L": length}), flush=True)
    print(f"\n{os.path.basename(args.input)}, Gemma 3 tokenizer and chat format, B={args.batch_size}; "
          f"{time.perf_counter() - started:.0f} s")
    print("| L | pairs | rows (lower bound; L2 bound) | density | pairs/step packed (Tunix) | completion tokens/step packed (Tunix) "
          "| completion tokens per slot packed / Tunix | Tunix P + C (pairs whole) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['L']} | {r['pairs']} | {r['rows']} ({r['lower_bound_rows']}, +{100 * r['rows_over_lower_bound']:.1f}%; {r['l2_bound_rows']}) | "
              f"{100 * r['density']:.1f}% | {r['packed_pairs_per_step']:.1f} ({r['tunix_pairs_per_step']}) | "
              f"{r['packed_completion_tokens_per_step']:,.0f} ({r['tunix_completion_tokens_per_step']:,.0f}) | "
              f"{r['packed_completion_per_slot']:.3f} / {r['tunix_completion_per_slot']:.3f} = "
              f"**{r['completion_per_compute_ratio']:.2f}x** | {r['tunix_max_prompt_length']} + "
              f"{r['tunix_max_response_length']} ({r['tunix_pairs_whole']}/{r['pairs']}) |")
    if plans:
        sft, dpo = plans
        gib = 1024**3
        print(f"\nPlanned memory, Gemma3 270M bf16, LoRA 16, ({args.plan_shape.replace('x', ', ')}), the defaults: "
              f"SFT peak {sft['peak_bytes'] / gib:.2f} GiB (temp {sft['temp_bytes'] / gib:.2f}), DPO peak "
              f"{dpo['peak_bytes'] / gib:.2f} GiB (temp {dpo['temp_bytes'] / gib:.2f}): DPO / SFT "
              f"{dpo['peak_bytes'] / sft['peak_bytes']:.2f}x peak; FLOPs DPO / SFT {dpo['flops'] / sft['flops']:.2f}x")


if __name__ == "__main__":
    main()
