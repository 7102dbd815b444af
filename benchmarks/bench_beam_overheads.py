"""What Beam's local runner costs the packing job regardless of the data: the floor under
`prepack pack`'s throughput ratio (docs/benchmarks.md, packing-job section).

Three measurements, CPU seconds of the launcher and of its SDK worker processes, on the
default runner (FnApiRunner, multi-processing, one worker per core):

1. fixed: `prepack pack` on the embedded 400-example sample (one L): starting the SDK workers, building and
   running the graph, publishing. Nothing here grows with the data.
2. per byte shuffled: a GroupByKey of N MB of bytes values against the same pipeline with
   empty values; every byte crosses the runner's data plane (worker -> runner -> worker).
3. the import of apache_beam in a fresh interpreter, which each SDK worker pays.

    python -m benchmarks.bench_beam_overheads
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _runner_args(workers: int) -> list[str]:
    return ["--runner=FnApiRunner", "--direct_running_mode=multi_processing", f"--direct_num_workers={workers}"]


def fixed_job_cost(work: str, workers: int) -> dict:
    from pipelines.launch.job import run
    from pipelines.options import parse_args

    out = os.path.join(work, "fixed")
    config, beam = parse_args(["--sample", "--output", out, "--overwrite", "--no-progress", "--max-length", "2048"]
                              + _runner_args(workers))
    run(config, beam)  # warm: bytecode and tokenizer caches
    before, started = _cpu(), time.perf_counter()
    result = run(config, beam)
    after = _cpu()
    return {"examples": result.stats[2048]["examples_read"], "wall": time.perf_counter() - started,
            "launcher_cpu": after[0] - before[0], "workers_cpu": after[1] - before[1]}


def shuffle_cost(mb: int, workers: int, elements: int = 64, keys: int = 8) -> dict:
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    chunk = b"\x5a" * (mb * (1 << 20) // elements)

    def run(payload: bytes) -> tuple[float, float]:
        before = _cpu()
        with beam.Pipeline(options=PipelineOptions(_runner_args(workers))) as p:
            (p | beam.Create(list(range(elements))) | beam.Reshuffle()
             | beam.Map(lambda i, data=payload: (i % keys, data)) | beam.GroupByKey()
             | beam.Map(lambda kv: sum(map(len, kv[1]))))
        after = _cpu()
        return after[0] - before[0], after[1] - before[1]

    run(b"")  # warm
    empty, full = run(b""), run(chunk)
    extra = (full[0] - empty[0]) + (full[1] - empty[1])
    return {"mb": mb, "empty_cpu": sum(empty), "full_cpu": sum(full), "ms_per_mb": 1e3 * extra / mb}


def import_cost() -> float:
    code = ("import resource, apache_beam.runners.worker.sdk_worker_main; r = resource.getrusage(resource.RUSAGE_SELF); "
            "print(r.ru_utime + r.ru_stime)")
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
            for _ in range(3)]
    return min(runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=0, help="SDK worker processes (0: all cores)")
    ap.add_argument("--shuffle-mb", type=int, default=128)
    args = ap.parse_args()
    import multiprocessing

    workers = args.workers or multiprocessing.cpu_count()
    work = tempfile.mkdtemp(prefix="prepack-overheads-")
    # As in bench_pack_job.py: a private bytecode cache, or every worker recompiles Beam.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = os.path.join(work, "pycache")
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
    sys.dont_write_bytecode = False

    fixed = fixed_job_cost(work, workers)
    shuffle = shuffle_cost(args.shuffle_mb, workers)
    imports = import_cost()
    print(f"Local runner, {workers} SDK worker processes.\n")
    print("| measurement | CPU s |")
    print("|---|---|")
    print(f"| `prepack pack` on {fixed['examples']} examples, launcher | {fixed['launcher_cpu']:.2f} |")
    print(f"| `prepack pack` on {fixed['examples']} examples, SDK workers | {fixed['workers_cpu']:.2f} |")
    print(f"| import of apache_beam's SDK worker module, per process | {imports:.2f} |")
    print(f"| GroupByKey of {shuffle['mb']} MB, minus the same with empty values | "
          f"{shuffle['full_cpu'] - shuffle['empty_cpu']:.2f} ({shuffle['ms_per_mb']:.1f} ms per MB) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
