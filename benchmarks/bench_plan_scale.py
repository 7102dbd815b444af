"""Internet-scale simulation: the planning and routing stages alone, on synthetic length
histograms of 10M, 100M and 1B examples.

    python -m benchmarks.bench_plan_scale --examples 10000000 100000000 1000000000 \
        [--max-length 2048] [--baseline-dir CHECKOUT [--baseline-max 100000000]]

No tokens exist at this scale here, so the benchmark runs what depends on the example count
and nothing else: the histogram the job combines ((L, length, sub-bucket) -> count, lognormal
lengths like SFT data, the job's own sub-bucket count for that many examples), PlanFn's work
(every group's slice of the plan, then the plan without slots), and the sizes each kind of
worker holds:

- the planner (one bundle in the whole job): CPU time and peak RSS of planning and slicing,
  and its own share (peak minus what the process held before planning) per row;
- every worker: the side input, the plan without slots (bytes pickled), against the slots
  the job used to broadcast (8 bytes per example per L);
- a routing worker: its largest group (examples, slice bytes, payload bytes at ~5 bytes per
  token), what the multimap side input sends it;
- a writing worker: the window, WINDOW_TOKENS row slots per L, a constant.

`--baseline-dir`: a checkout of the code before the streamed planner (e.g. `git worktree add
--detach /tmp/plan-base <commit>`); the sizes up to `--baseline-max` also run its planner
(build_plan: every slot of the L at once, then the slices), in the same run, for the ratios.
Each size and code runs in its own process (peak RSS is per process).
"""

from __future__ import annotations

import argparse
import hashlib
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


def plan_and_slice(hist: dict, max_length: int):
    """PlanFn's work: (the plan without slots, every group's slice in turn). Streamed where the
    code has LengthPlanner; the code before it (a --baseline-dir checkout) built the whole plan."""
    try:
        from pipelines.planning import LengthPlanner
    except ImportError:
        from testkit.plans import build_plan

        plan = build_plan(hist, max_length, True)
        return "whole", plan.without_slots(), plan.group_slices()
    planner = LengthPlanner(hist, max_length, True)
    return "streamed", planner.plan, planner.group_slices()


def one_size(num_examples: int, max_length: int) -> dict:
    from pipelines.planning import WINDOW_TOKENS, choose_sub_buckets

    sub_buckets = choose_sub_buckets(num_examples, True)
    started = time.process_time()
    hist = synthetic_histogram(num_examples, max_length, sub_buckets)
    hist_s = time.process_time() - started
    rss_hist = peak_rss_mb()
    started = time.process_time()
    planner, plan, slices = plan_and_slice(hist, max_length)
    largest = (0, 0, 0)  # (examples, slice bytes, payload bytes) of the largest routing group
    total_slice_bytes = num_slices = digest = 0
    check_s = 0.0  # the identity digest's time, left out of the planner's
    for (key, b), rows, positions in slices:
        check_started = time.process_time()
        blake = hashlib.blake2b(repr((key, b)).encode(), digest_size=8)
        blake.update(rows.astype("<i4").tobytes())
        blake.update(positions.astype("<i4").tobytes())
        digest = (digest + int.from_bytes(blake.digest(), "little")) % 2**64  # any slice order
        check_s += time.process_time() - check_started
        size = rows.nbytes + positions.nbytes
        total_slice_bytes += size
        num_slices += 1
        if len(rows) > largest[0]:
            largest = (len(rows), size, len(rows) * key * BYTES_PER_TOKEN_ON_THE_WIRE)
    if callable(plan):
        plan = plan()
    plan_s = time.process_time() - started - check_s
    rss_plan = peak_rss_mb()
    return {
        "planner": planner, "examples": num_examples, "max_length": max_length, "sub_buckets": sub_buckets,
        "histogram_entries": len(hist), "rows": plan.num_rows, "shards": plan.num_shards,
        "histogram_cpu_s": hist_s, "plan_and_slices_cpu_s": plan_s,
        "planner_peak_rss_mb": rss_plan, "rss_after_histogram_mb": rss_hist,
        "planner_own_bytes_per_row": (rss_plan - rss_hist) * 2**20 / max(plan.num_rows, 1),
        "side_input_bytes": len(pickle.dumps(plan.without_slots())),
        "old_broadcast_bytes": 8 * plan.num_examples,
        "slices": num_slices, "slice_bytes_total": total_slice_bytes, "slices_digest": f"{digest:016x}",
        "largest_group_examples": largest[0], "largest_group_slice_bytes": largest[1],
        "largest_group_payload_bytes": largest[2],
        "window_slots_per_L": WINDOW_TOKENS, "window_payload_bytes_per_L": WINDOW_TOKENS * BYTES_PER_TOKEN_ON_THE_WIRE,
    }


def run_child(num_examples: int, max_length: int, code_dir: Path, timeout_s: float) -> dict | None:
    cmd = [sys.executable, __file__, "--one", str(num_examples), "--max-length", str(max_length)]
    label = f"{num_examples:>13,} examples ({code_dir})"
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env={"PYTHONPATH": str(code_dir), "PATH": "/usr/bin:/bin"})
    except subprocess.TimeoutExpired:
        print(f"{label}: did not finish in {timeout_s:.0f} s", flush=True)
        return None
    if done.returncode != 0:
        print(f"{label}: failed (rc {done.returncode}): {(done.stderr.strip().splitlines() or [''])[-1]}", flush=True)
        return None
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", nargs="+", type=int, default=[10_000_000, 100_000_000, 1_000_000_000])
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--baseline-dir", type=Path, help="a checkout of the code before the streamed planner")
    ap.add_argument("--baseline-max", type=int, default=100_000_000,
                    help="the largest size the baseline runs (its planner holds ~32 bytes per example)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # child: one size, JSON on stdout
    ap.add_argument("--timeout-s", type=float, default=1800)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_size(args.one, args.max_length)))
        return 0
    results, before = [], {}
    for n in args.examples:
        if args.baseline_dir and n <= args.baseline_max:
            before[n] = run_child(n, args.max_length, args.baseline_dir.resolve(), args.timeout_s)
        if (r := run_child(n, args.max_length, REPO, args.timeout_s)) is not None:
            results.append(r)
    mb = 2**20
    print(f"\nL = {args.max_length}; lognormal lengths (median 80); one plan (the job builds one per L)\n")
    print("| examples | sub-buckets | rows | plan + slices CPU s | planner peak RSS MB | planner's own bytes per row | "
          "side input per worker | slots broadcast per worker (before issue 14) | largest routing group: examples / "
          "slice / payload | write window per L |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['examples']:,} | {r['sub_buckets']} | {r['rows']:,} | {r['plan_and_slices_cpu_s']:,.1f} | "
              f"{r['planner_peak_rss_mb']:,.0f} | {r['planner_own_bytes_per_row']:,.1f} | "
              f"{r['side_input_bytes']:,} B | {r['old_broadcast_bytes'] / mb:,.0f} MB | "
              f"{r['largest_group_examples']:,} / {r['largest_group_slice_bytes'] / mb:,.1f} MB / "
              f"{r['largest_group_payload_bytes'] / mb:,.0f} MB | {r['window_payload_bytes_per_L'] / mb:,.0f} MB |")
    if before:
        print("\nStreamed planner against the whole plan in memory (the baseline checkout), same run:\n")
        print("| examples | CPU s before | CPU s now | ratio | peak RSS MB before | peak RSS MB now | ratio | "
              "planner's own bytes per row before / now | same slices (digest) |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in results:
            b = before.get(r["examples"])
            if b is None:
                continue
            print(f"| {r['examples']:,} | {b['plan_and_slices_cpu_s']:,.1f} | {r['plan_and_slices_cpu_s']:,.1f} | "
                  f"{r['plan_and_slices_cpu_s'] / b['plan_and_slices_cpu_s']:.2f} | {b['planner_peak_rss_mb']:,.0f} | "
                  f"{r['planner_peak_rss_mb']:,.0f} | {r['planner_peak_rss_mb'] / b['planner_peak_rss_mb']:.2f} | "
                  f"{b['planner_own_bytes_per_row']:,.0f} / {r['planner_own_bytes_per_row']:,.1f} | "
                  f"{'yes' if (b['slices_digest'], b['rows']) == (r['slices_digest'], r['rows']) else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
