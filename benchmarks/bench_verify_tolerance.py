"""The two figures a backend's parity tolerance is set from: the noise of correct rows and the miss of a one-key leak.

`prepack verify --model` fails a segment whose targets' log p differ, packed against alone, by
more than its dtype's tolerance on this backend (train/verification/parity.py `tolerance_for`), each segment's
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

Both statistics are measured and kept (`by_statistic`); the table leads with the dtype's. So is
every target's |packed - alone| log p, per segment, as stored and under the leak (`per_segment`:
the segment's number in its row, the first target's offset from the segment's start, then the
targets in order), so that another
summary can be tried on a device's figures without the device.

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
    p.add_argument("--rescore", metavar="JSON", default=None,
                   help="no model: a verify_tolerance.json's per_segment figures summarized by candidate statistics")
    return p.parse_args(argv)


# Candidates to a segment's mean for long rows, tried offline on saved figures: the mean over a segment's
# first K targets (a one-key leak sits before a segment's first token, so it moves the first targets most,
# while its share of a long segment's mean shrinks), widened as parity widens a short segment's mean.
HEAD_TARGETS = (8, 16, 32)


def rescore(path: str) -> int:
    """The noise and leak of each candidate statistic on a saved run's per-target differences."""
    import numpy as np

    from train.verification import parity

    with open(path) as f:
        saved = json.load(f)
    print("| dtype | attention | rows | statistic | noise (largest) | leak (smallest over later) | leak / noise |")
    print("|---|---|---|---|---|---|---|")
    for r in saved["results"]:
        segments = r.get("per_segment")
        if not segments:
            print(f"| {r['dtype']} | {r['attention']} | | no per_segment figures (an older run) | | | |")
            continue
        later = [s for s in segments if s["segment"] > 1 and s["leak"]]  # as measure's: the ones a leak can reach

        def score(diffs: list[float], head: int | None) -> float:
            kept = np.asarray(diffs[:head] if head else diffs, np.float64)
            return float(kept.mean()) / parity.widening("mean", kept.size) if kept.size else 0.0

        for name, head in [("mean", None)] + [(f"first {k} targets' mean", k) for k in HEAD_TARGETS]:
            noise = max(score(s["noise"], head) for s in segments)
            leak = min((score(s["leak"], head) for s in later), default=float("nan"))
            print(f"| {r['dtype']} | {r['attention']} | {r['rows']} x L{r['max_length']} | {name} | {noise:.2e} | "
                  f"{leak:.2e} | {leak / noise if noise else float('inf'):.1f}x |")
    return 0


def measure(model: Any, cfg: Any, view: Any) -> dict[str, Any]:
    """noise (rows as stored) and leak (one key across each boundary) for one loaded model."""
    from testkit.layout_bugs import one_key_leak
    from train.verification import parity

    stored = parity.check_view(model, cfg, view)
    leaked = parity.check_view(model, cfg, view, packed_layout=one_key_leak)
    later = [s for s in leaked.segments if s.segment > 1]
    figures = {}
    for statistic in ("max", "mean"):  # both, whichever the dtype's check holds
        figures[statistic] = {"noise": max((s.score(statistic) for s in stored.segments), default=0.0),
                              "leak_min_later": min((s.score(statistic) for s in later), default=float("nan")),
                              "leak_max": max((s.score(statistic) for s in leaked.segments), default=0.0)}
    held = figures[stored.statistic]
    per_segment = [{"where": s.where, "segment": s.segment, "first_target": s.first_target, "noise": _rounded(s.abs_diffs),
                    "leak": _rounded(l.abs_diffs)} for s, l in zip(stored.segments, leaked.segments)]
    return {"statistic": stored.statistic, **held, "by_statistic": figures, "per_segment": per_segment,
            "later_segments": len(later), "segments": len(stored.segments), "targets": stored.targets,
            "tolerance": stored.tolerance, "separates": held["noise"] < stored.tolerance < held["leak_min_later"],
            "leak_failed_segments": len(leaked.failures), "attention": stored.attention,
            "seconds": stored.seconds + leaked.seconds}


def _rounded(diffs: Any) -> list[float]:
    """Every target's |packed - alone| log p, to 4 significant digits (what a new summary is tried on)."""
    return [float(f"{d:.4g}") for d in diffs.tolist()]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.rescore:
        return rescore(args.rescore)
    from benchmarks.device_machine import line, machine
    from loaders import open_shards
    from train.verification import parity

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
