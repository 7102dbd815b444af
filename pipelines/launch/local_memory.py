"""Beam's local runner and memory: how many SDK workers, and will the job fit?

Two facts of Beam's FnApiRunner (multi_processing), both measured
(benchmarks/bench_local_runner_shares.py, benchmarks/bench_worker_memory.py, docs/benchmarks.md):
- It keeps every shuffle in the launcher's memory, so the launcher grows with the input,
  about LOCAL_RUNNER_BYTES_PER_EXAMPLE per example over a fixed base.
- A step's input is cut into one part per SDK worker, each part is one bundle, and the
  runner writes a bundle's whole input to its worker before it starts the bundle
  (`BundleManager._run_bundle` in apache_beam/runners/portability/fn_api_runner/fn_runner.py,
  Beam 2.77). So a worker holds its whole share of every step, whatever the job's own code
  holds, and the only bound is the share: the job starts one worker per
  EXAMPLES_PER_LOCAL_WORKER examples (at least one per core).
Dataflow streams a bundle's input and its shuffle is a service, so neither applies there;
splitting the input into parts (one job each) bounds the launcher locally.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from pipelines.options import flag_value
from pipelines.inputs.sources import COMPRESSED_SUFFIXES, ReadTask, ResolvedInput

# Launcher (FnApiRunner) peak RSS per example and at zero examples, from the measurements
# in docs/benchmarks.md ("Local runner memory").
LOCAL_RUNNER_BYTES_PER_EXAMPLE = 2300
LOCAL_RUNNER_BASE_BYTES = 400 << 20
# Examples whose payloads one local SDK worker may hold at once: its share of a step.
EXAMPLES_PER_LOCAL_WORKER = 250_000
# An SDK worker's peak RSS: its base (Beam and the tokenizer) plus its share of a step, about
# 1.5 KB per example of the share (docs/benchmarks.md, "Worker memory": under 1 GB at a 200k-250k share).
SDK_WORKER_BASE_BYTES = 400 << 20
SDK_WORKER_BYTES_PER_EXAMPLE = 1500
# glibc malloc arenas per SDK worker: the worker's gRPC threads receive a step's input and its
# bundle thread frees it, and with glibc's default (8 arenas per core) what one arena freed is
# not reused by the next, so a worker's RSS adds up over the steps (measured: 1,103 -> 1,027 MB
# for the largest worker at 3M examples, docs/benchmarks.md). Workers inherit the launcher's
# environment; a value the user set is kept.
WORKER_MALLOC_ARENAS = "2"
# Overrides EXAMPLES_PER_LOCAL_WORKER (tests start several workers on a small input).
EXAMPLES_PER_LOCAL_WORKER_ENV = "PREPACK_EXAMPLES_PER_LOCAL_WORKER"
SAMPLE_BYTES = 1 << 20  # read from the first local JSONL file to learn its bytes per record
FIT_FRACTION = 0.8  # of the available memory; the rest is the page cache and the machine's others


def is_local_runner(beam_args: Sequence[str]) -> bool:
    args = " ".join(beam_args)
    return not any(remote in args for remote in ("DataflowRunner", "PortableRunner", "FlinkRunner", "SparkRunner"))


def available_bytes() -> int | None:
    """MemAvailable of this machine (Linux), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _bytes_per_record(path: str) -> float | None:
    """Bytes per line in the first SAMPLE_BYTES of a local, uncompressed JSONL file."""
    if "://" in path or path.lower().endswith(COMPRESSED_SUFFIXES):
        return None
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None  # a named pipe or device: reading would take records from the job
        with open(path, "rb") as f:
            head = f.read(SAMPLE_BYTES)
    except OSError:
        return None
    lines = head.count(b"\n")
    return len(head) / lines if lines else None


def estimate_examples(inputs: Sequence[ResolvedInput], tasks: Sequence[ReadTask]) -> int:
    """Examples in the inputs: dataset row counts are exact; plain JSONL files are sized from
    the bytes per line of a sample of their first file; other files by the sources' estimate."""
    total = 0
    for resolved in inputs:
        info = dict(resolved.info)
        first = next((t for t in tasks if t.input_index == resolved.index and t.kind == "jsonl"), None)
        per = _bytes_per_record(first.path) if first is not None and resolved.kind == "files" else None
        total += int(info.get("bytes", 0) / per) if per else resolved.est_records
    return total


def local_run_bytes(examples: int, num_workers: int) -> int:
    """Peak memory of a local run: the launcher, and the workers with their shares."""
    return (LOCAL_RUNNER_BASE_BYTES + examples * LOCAL_RUNNER_BYTES_PER_EXAMPLE
            + num_workers * SDK_WORKER_BASE_BYTES + examples * SDK_WORKER_BYTES_PER_EXAMPLE)


def examples_that_fit(budget: int, cores: int) -> int:
    """The most examples a local run with the job's own worker count fits in `budget` bytes."""
    low, high = 0, max(1, budget // (LOCAL_RUNNER_BYTES_PER_EXAMPLE + SDK_WORKER_BYTES_PER_EXAMPLE))
    while low < high:
        mid = (low + high + 1) // 2
        if local_run_bytes(mid, local_worker_count(mid, cores)) <= budget:
            low = mid
        else:
            high = mid - 1
    return low


def warning(examples: int, num_workers: int, available: int | None, cores: int | None = None) -> str | None:
    """The warning to print before a local run that will not fit, else None."""
    if available is None:
        return None
    need = local_run_bytes(examples, num_workers)
    budget = int(available * FIT_FRACTION)
    if need <= budget:
        return None
    fits = examples_that_fit(budget, cores or os.cpu_count() or 1)
    per_example = (LOCAL_RUNNER_BYTES_PER_EXAMPLE + SDK_WORKER_BYTES_PER_EXAMPLE) / 1000
    return (f"this input holds about {examples:,} examples; Beam's local runner keeps every shuffle in memory and "
            f"hands each of its {num_workers} SDK workers its whole share of a step (~{per_example:.1f} KB per example "
            f"in all), so this run needs about {need / 2**30:.1f} GB but {available / 2**30:.1f} GB are available: it "
            f"will likely run out of memory. Run it on Dataflow (gcp/launch_dataflow.py), or split the input into "
            f"parts of at most {fits:,} examples and pack each part on its own")


def examples_per_local_worker() -> int:
    return max(1, int(os.environ.get(EXAMPLES_PER_LOCAL_WORKER_ENV, EXAMPLES_PER_LOCAL_WORKER)))


def local_worker_count(examples: int, cores: int) -> int:
    """One SDK worker per EXAMPLES_PER_LOCAL_WORKER examples, at least one per core."""
    return max(cores, -(-examples // examples_per_local_worker()))


def _multi_processing(beam_args: Sequence[str]) -> bool:
    return flag_value(beam_args, "--direct_running_mode") == "multi_processing"


def with_local_workers(beam_args: Sequence[str], examples: int, cores: int | None = None) -> list[str]:
    """beam_args with `--direct_num_workers` from the input size (local_worker_count), for the
    local runner in multi_processing mode when the user did not choose a worker count."""
    args = list(beam_args)
    if not is_local_runner(args) or not _multi_processing(args):
        return args
    if flag_value(args, "--direct_num_workers") is not None:
        return args
    return [*args, f"--direct_num_workers={local_worker_count(examples, cores or os.cpu_count() or 1)}"]


def bound_worker_arenas(beam_args: Sequence[str]) -> None:
    """Sets MALLOC_ARENA_MAX for the SDK worker processes a local multi_processing run starts."""
    if is_local_runner(beam_args) and _multi_processing(beam_args):
        os.environ.setdefault("MALLOC_ARENA_MAX", WORKER_MALLOC_ARENAS)


def local_workers(beam_args: Sequence[str]) -> int:
    """SDK worker processes the local runner will start (--direct_num_workers, 0 = all cores)."""
    value = flag_value(beam_args, "--direct_num_workers")
    if value is None:
        return 1
    n = int(value)
    return n if n > 0 else (os.cpu_count() or 1)
