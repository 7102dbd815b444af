"""The two figures a backend's parity tolerance is set from: the noise of correct rows and the miss of a one-key leak.

`prepack verify --model` fails a segment whose targets' log p differ, packed against alone, by
more than its dtype's tolerance on this backend (train/parity.py `tolerance_for`), each segment's
differences summarized by its dtype's statistic (`statistic_for`: float32 the largest, bfloat16
the mean over the segment's targets). A tolerance is right when it lies between two measured
figures of the same model, rows and attention, each a segment statistic:

Each segment's figure is its score: its statistic, a short segment's mean divided by parity's
`widening` (the tolerance is held against the scores).

- noise: the largest over the segments of the rows as stored (correct rows: the same tokens in
  two layouts, differing by rounding alone);
- leak: the smallest over the segments after a row's first (the ones a leak can reach) when
  every later segment sees one key of the segment before it (testkit/layout_bugs.py
  `one_key_leak`, through parity's `packed_layout` seam).

Both statistics are measured and kept (`by_statistic`); the table leads with the dtype's.

It prints both per dtype, their ratio, and whether the backend's current tolerance separates
them (noise < tolerance < leak), and writes them as JSON. One process: it loads the model once
per dtype and holds the device alone (run it on a TPU as any single command).

    python -m benchmarks.bench_verify_tolerance --shards OUT/L2048 --model gemma3-270m --weights random \
        --attention flash --rows 2 --dtypes bfloat16 float32 [--out DIR]

--shards is a shard set packed beforehand (`prepack pack`, which needs Beam: pack here, carry
it to the device); without it the embedded sample is packed at --max-length (needs Beam).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Sequence
from typing import Any


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", default=None, help="a packed shard set (OUT/L2048); default: pack the embedded sample")
    p.add_argument("--max-length", type=int, default=512, help="without --shards: the sample's max length")
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--weights", default=None, help="as `prepack verify --weights` (default: the model's offline weights)")
    p.add_argument("--attention", default=None, help="as `prepack verify --attention` (default: the backend's)")
    p.add_argument("--attention-tile", type=int, default=None)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--rows", type=int, default=4, help="rows sampled by parity's fixed seed")
    p.add_argument("--out", default=None, help="folder for verify_tolerance.json (default: $OUT when set)")
    return p.parse_args(argv)


def measure(model: Any, cfg: Any, view: Any) -> dict[str, Any]:
    """noise (rows as stored) and leak (one key across each boundary) for one loaded model."""
    from testkit.layout_bugs import one_key_leak
    from train import parity

    stored = parity.check_view(model, cfg, view)
    leaked = parity.check_view(model, cfg, view, packed_layout=one_key_leak)
    later = [s for s in leaked.segments if s.segment > 1]
    figures = {}
    for statistic in ("max", "mean"):  # both, whichever the dtype's check holds
        figures[statistic] = {"noise": max((s.score(statistic) for s in stored.segments), default=0.0),
                              "leak_min_later": min((s.score(statistic) for s in later), default=float("nan")),
                              "leak_max": max((s.score(statistic) for s in leaked.segments), default=0.0)}
    held = figures[stored.statistic]
    return {"statistic": stored.statistic, **held, "by_statistic": figures,
            "later_segments": len(later), "segments": len(stored.segments), "targets": stored.targets,
            "tolerance": stored.tolerance, "separates": held["noise"] < stored.tolerance < held["leak_min_later"],
            "leak_failed_segments": len(leaked.failures), "attention": stored.attention,
            "seconds": stored.seconds + leaked.seconds}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from benchmarks.device_machine import line, machine
    from loaders import open_shards
    from train import parity

    path = args.shards
    if path is None:
        from apps import cli

        out = os.path.join(tempfile.mkdtemp(prefix="bench_verify_tolerance_"), "out")
        assert cli.main(["pack", "--sample", "--max-length", str(args.max_length), "--output", out, "--no-progress"]) == 0
        path = os.path.join(out, f"L{args.max_length}")
    info = machine()
    print(f"machine: {line(info)}", flush=True)
    results = []
    print("| model | dtype | attention | rows | later segments | statistic | noise (largest, as stored) | leak (smallest "
          "over later) | leak / noise | tolerance | separates | the other statistic: noise, leak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        cfg = parity.ParityConfig(model=args.model, weights=args.weights, rows=args.rows, dtype=dtype,
                                  attention=args.attention, attention_tile=args.attention_tile)
        with open_shards(path) as view:
            started = time.perf_counter()
            built = parity.build_model(cfg, dict(view.manifest.tokenizer), path)
            r = {"model": args.model, "weights": built.weights, "dtype": dtype, "rows": args.rows, "max_length": view.max_length,
                 "load_s": time.perf_counter() - started, **measure(built.model, cfg, view)}
        results.append(r)
        ratio = r["leak_min_later"] / r["noise"] if r["noise"] else float("inf")
        other = r["by_statistic"]["mean" if r["statistic"] == "max" else "max"]
        print(f"| {args.model} ({r['weights']}) | {dtype} | {r['attention']} | {args.rows} x L{r['max_length']} | "
              f"{r['later_segments']} | {r['statistic']} | {r['noise']:.2e} | {r['leak_min_later']:.2e} | {ratio:.1f}x | "
              f"{r['tolerance']:.1e} | {'yes' if r['separates'] else 'NO'} | {other['noise']:.2e}, {other['leak_min_later']:.2e} |",
              flush=True)
    out = args.out or os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        target = os.path.join(out, "verify_tolerance.json")
        with open(target, "w") as f:
            json.dump({"machine": info, "shards": path, "results": results}, f, indent=1)
        print(f"-> {target}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
