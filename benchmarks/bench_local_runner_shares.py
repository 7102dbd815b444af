"""Why a local SDK worker's memory follows its share of a step: a Beam-only measurement.

    python -m benchmarks.bench_local_runner_shares --elements 200000 400000 800000 [--payload 500] [--share 100000]

No project code: Create -> Reshuffle -> FlatMap (payloads of --payload random bytes, 2,000
keys) -> GroupByKey -> a DoFn that only sums the value sizes, on Beam's FnApiRunner in
multi_processing mode. For each size it runs the pipeline three ways:

- `no shuffle, 2 workers`: the payloads are made and consumed inside one fused step
  (FlatMap -> Map, no GroupByKey): the control;
- `GroupByKey, 2 workers`: the fixed worker count (what `prepack pack` used before);
- `GroupByKey, 1 worker per --share`: workers = elements / share, as `prepack pack` now
  chooses them (pipelines/launch/local_memory.py).

and reports the peak RSS (VmHWM) of the largest SDK worker, and that worker's RSS when the
grouped step's first element reached the DoFn. If the runner streamed a bundle's input,
the second figure would be near the worker's idle size; FnApiRunner writes a bundle's whole
input to the worker before it starts the bundle (`BundleManager._run_bundle`,
fn_api_runner/fn_runner.py), so it is already the worker's whole share.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile
import threading
import time


def _rss_kb(field: str, pid: str = "self") -> int:
    """A numeric field of /proc/PID/status (kB for the memory fields)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class _SumValues:
    """The grouped step: writes the worker's RSS at its first element to a file per process."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.first = True

    def __call__(self, kv):
        if self.first:
            self.first = False
            with open(os.path.join(self.out_dir, f"first-{os.getpid()}"), "w") as f:
                f.write(str(_rss_kb("VmRSS")))
        return sum(len(v) for v in kv[1])


def _payloads(seed: int, per_seed: int, payload: int):
    for i in range(seed * per_seed, (seed + 1) * per_seed):
        yield i % 2000, os.urandom(payload)


def _descendants(root: int) -> list[int]:
    """Processes below root (this run's SDK workers, never another job's)."""
    parents: dict[int, int] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                parents[int(pid)] = _rss_kb("PPid", pid)
            except OSError:
                pass
    out, todo = [], [root]
    while todo:
        parent = todo.pop()
        kids = [p for p, pp in parents.items() if pp == parent]
        out += kids
        todo += kids
    return out


def _sample_workers(peaks: dict[int, int], stop: threading.Event) -> None:
    while not stop.is_set():
        for pid in _descendants(os.getpid()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"sdk_worker_main" not in f.read():
                        continue
                peaks[pid] = max(peaks.get(pid, 0), _rss_kb("VmHWM", str(pid)))
            except OSError:
                pass
        time.sleep(0.1)


def run_once(elements: int, workers: int, payload: int, shuffle: bool) -> dict:
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    per_seed = 1000
    out_dir = tempfile.mkdtemp(prefix="bench-shares-")
    peaks: dict[int, int] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_workers, args=(peaks, stop), daemon=True)
    sampler.start()
    options = PipelineOptions(["--runner=FnApiRunner", "--direct_running_mode=multi_processing",
                               f"--direct_num_workers={workers}"])
    started = time.monotonic()
    with beam.Pipeline(options=options) as p:
        made = (p | beam.Create(range(elements // per_seed)) | beam.Reshuffle()
                | beam.FlatMap(_payloads, per_seed, payload))
        if shuffle:
            made | beam.GroupByKey() | beam.Map(_SumValues(out_dir))
        else:
            made | beam.Map(lambda kv: len(kv[1]))
    wall = time.monotonic() - started
    stop.set()
    sampler.join()
    firsts = []
    for path in glob.glob(os.path.join(out_dir, "first-*")):
        with open(path) as f:
            firsts.append(int(f.read()) / 1024)
        os.unlink(path)
    os.rmdir(out_dir)
    workers_mb = sorted((kb / 1024 for kb in peaks.values() if kb > 10 << 10), reverse=True)
    return {"workers": len(workers_mb), "peak_mb": workers_mb[0] if workers_mb else 0,
            "first_mb": max(firsts) if firsts else None, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", nargs="+", type=int, default=[200_000, 400_000, 800_000])
    ap.add_argument("--payload", type=int, default=500, help="bytes per element")
    ap.add_argument("--share", type=int, default=100_000, help="elements per worker in the scaled mode")
    args = ap.parse_args()
    print("| elements | step | workers | share per worker (MB of payload) | largest worker peak MB "
          "| its RSS at the grouped step's first element, MB | wall s |")
    print("|---|---|---|---|---|---|---|")
    for n in args.elements:
        scaled = max(2, -(-n // args.share))
        for label, workers, shuffle in (("no shuffle", 2, False), ("GroupByKey", 2, True),
                                        (f"GroupByKey, 1 worker per {args.share:,}", scaled, True)):
            r = run_once(n, workers, args.payload, shuffle)
            share = f"{n * args.payload / workers / 2**20:,.0f}" if shuffle else "-"
            first = f"{r['first_mb']:,.0f}" if r["first_mb"] is not None else "-"
            print(f"| {n:,} | {label} | {r['workers']} | {share} | {r['peak_mb']:,.0f} | {first} | {r['wall_s']:.0f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
