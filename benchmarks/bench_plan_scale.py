"""Internet-scale simulation: the planning and routing stages alone, on synthetic length
histograms of 10M, 100M and 1B examples.

    python -m benchmarks.bench_plan_scale --examples 10000000 100000000 1000000000 [--max-length 2048]

No tokens exist at this scale here, so the benchmark runs what depends on the example count
and nothing else: the histogram the job combines ((L, length, sub-bucket) -> count, lognormal
lengths like SFT data, the job's own sub-bucket count for that many examples), PlanFn's work
(`build_plan`, then every group's slice), and the sizes each kind of worker holds:

- the planner (one bundle in the whole job): time and peak RSS of build_plan + slicing;
- every worker: the side input, the plan without slots (bytes pickled), against the slots
  the job used to broadcast (8 bytes per example per L);
- a routing worker: its largest group (examples, slice bytes, payload bytes at ~5 bytes per
  token), what the keyed join sends it;
- a writing worker: the window, WINDOW_TOKENS row slots per L, a constant.

Each size runs in its own process (peak RSS is per process); a size that does not fit in the
memory left on the machine is reported as such.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BYTES_PER_TOKEN_ON_THE_WIRE = 5  # int32 id + uint8 mask


def synthetic_histogram(num_examples: int, max_length: int, sub_buckets: int) -> dict[tuple[int, int, int], int]:
    """Lognormal lengths (median 80 tokens, sigma 1, as benchmarks/bench_packer.py), counts spread
    evenly over the sub-buckets, examples longer than L left out (dropped by the job)."""
    import numpy as np

    lengths = np.arange(1, max_length + 1)
    edges = np.log(np.concatenate([lengths - 0.5, [max_length + 0.5]]))
    cdf = 0.5 * (1 + np.vectorize(math.erf)((edges - math.log(80)) / math.sqrt(2)))
    counts = np.floor(np.diff(cdf) / (cdf[-1] - cdf[0]) * num_examples).astype(np.int64)
    counts[79] += num_examples - int(counts.sum())  # the rounding remainder at the median
    hist = {}
    for n, c in zip(lengths.tolist(), counts.tolist()):
        base, extra = divmod(c, sub_buckets)
        for b in range(sub_buckets):
            k = base + (1 if b < extra else 0)
            if k:
                hist[(max_length, n, b)] = k
    return hist


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one_size(num_examples: int, max_length: int) -> dict:
    from pipelines.planning import WINDOW_TOKENS, build_plan, choose_sub_buckets

    sub_buckets = choose_sub_buckets(num_examples, True)
    started = time.process_time()
    hist = synthetic_histogram(num_examples, max_length, sub_buckets)
    hist_s = time.process_time() - started
    rss_hist = peak_rss_mb()
    started = time.process_time()
    plan = build_plan(hist, max_length, True)
    plan_s = time.process_time() - started
    rss_plan = peak_rss_mb()
    started = time.process_time()
    largest = (0, 0, 0)  # (examples, slice bytes, payload bytes) of the largest routing group
    total_slice_bytes = 0
    for (key, _), rows, positions in plan.group_slices():
        size = rows.nbytes + positions.nbytes
        total_slice_bytes += size
        if len(rows) > largest[0]:
            largest = (len(rows), size, len(rows) * key * BYTES_PER_TOKEN_ON_THE_WIRE)
    slice_s = time.process_time() - started
    return {
        "examples": num_examples, "max_length": max_length, "sub_buckets": sub_buckets, "histogram_entries": len(hist),
        "rows": plan.num_rows, "shards": plan.num_shards,
        "histogram_cpu_s": hist_s, "plan_cpu_s": plan_s, "slices_cpu_s": slice_s,
        "planner_peak_rss_mb": rss_plan, "rss_after_histogram_mb": rss_hist,
        "side_input_bytes": len(pickle.dumps(plan.without_slots())),
        "old_broadcast_bytes": 8 * plan.num_examples,
        "slice_bytes_total": total_slice_bytes,
        "largest_group_examples": largest[0], "largest_group_slice_bytes": largest[1],
        "largest_group_payload_bytes": largest[2],
        "window_slots_per_L": WINDOW_TOKENS, "window_payload_bytes_per_L": WINDOW_TOKENS * BYTES_PER_TOKEN_ON_THE_WIRE,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", nargs="+", type=int, default=[10_000_000, 100_000_000, 1_000_000_000])
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child: one size, JSON on stdout
    ap.add_argument("--timeout-s", type=float, default=1800)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_size(args.one, args.max_length)))
        return 0
    results = []
    for n in args.examples:
        cmd = [sys.executable, __file__, "--one", str(n), "--max-length", str(args.max_length)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s,
                                  env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
        except subprocess.TimeoutExpired:
            print(f"{n:>13,} examples: did not finish in {args.timeout_s:.0f} s", flush=True)
            continue
        if done.returncode != 0:
            print(f"{n:>13,} examples: failed (rc {done.returncode}): {(done.stderr.strip().splitlines() or [''])[-1]}",
                  flush=True)
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(r)
        print(json.dumps(r), flush=True)
    mb = 2**20
    print(f"\nL = {args.max_length}; lognormal lengths (median 80); one plan (the job builds one per L)\n")
    print("| examples | sub-buckets | rows | plan + slices CPU s | planner peak RSS MB | side input per worker (now) | "
          "slots broadcast per worker (before) | largest routing group: examples / slice / payload | write window per L |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['examples']:,} | {r['sub_buckets']} | {r['rows']:,} | {r['plan_cpu_s'] + r['slices_cpu_s']:,.1f} | "
              f"{r['planner_peak_rss_mb']:,.0f} | {r['side_input_bytes'] / 1024:,.0f} KB | {r['old_broadcast_bytes'] / mb:,.0f} MB | "
              f"{r['largest_group_examples']:,} / {r['largest_group_slice_bytes'] / mb:,.1f} MB / "
              f"{r['largest_group_payload_bytes'] / mb:,.0f} MB | {r['window_payload_bytes_per_L'] / mb:,.0f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
