"""Will this job fit in Beam's local runner? An estimate before the pipeline starts.

Beam's FnApiRunner keeps every shuffle in the launcher's memory, so the launcher grows
with the input: measured on unique EN-FR pairs (benchmarks/bench_worker_memory.py,
docs/benchmarks.md) at about LOCAL_RUNNER_BYTES_PER_EXAMPLE per example over a fixed
base. Dataflow's shuffle is a service, so nothing of this applies there; splitting the
input into parts (one job each) bounds it locally.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from pipelines.sources import COMPRESSED_SUFFIXES, ReadTask, ResolvedInput

# Launcher (FnApiRunner) peak RSS per example and at zero examples, from the measurements
# in docs/benchmarks.md ("Local runner memory").
LOCAL_RUNNER_BYTES_PER_EXAMPLE = 2300
LOCAL_RUNNER_BASE_BYTES = 400 << 20
# The SDK worker processes next to the launcher: each holds at most its bundle's window
# (pipelines/README.md, "Bounded worker memory").
SDK_WORKER_BYTES = 1536 << 20
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


def warning(examples: int, num_workers: int, available: int | None) -> str | None:
    """The warning to print before a local run that will not fit, else None."""
    if available is None:
        return None
    need = LOCAL_RUNNER_BASE_BYTES + examples * LOCAL_RUNNER_BYTES_PER_EXAMPLE + num_workers * SDK_WORKER_BYTES
    if need <= available * FIT_FRACTION:
        return None
    fits = max(0, int((available * FIT_FRACTION - LOCAL_RUNNER_BASE_BYTES - num_workers * SDK_WORKER_BYTES)
                      // LOCAL_RUNNER_BYTES_PER_EXAMPLE))
    return (f"this input holds about {examples:,} examples; Beam's local runner keeps every shuffle in memory "
            f"(~{LOCAL_RUNNER_BYTES_PER_EXAMPLE / 1000:.1f} KB per example), so this run needs about "
            f"{need / 2**30:.1f} GB but {available / 2**30:.1f} GB are available: it will likely run out of memory. "
            f"Run it on Dataflow (gcp/launch_dataflow.py), or split the input into parts of at most "
            f"{fits:,} examples and pack each part on its own")


def local_workers(beam_args: Sequence[str]) -> int:
    """SDK worker processes the local runner will start (--direct_num_workers, 0 = all cores)."""
    for i, arg in enumerate(beam_args):
        value = arg.split("=", 1)[1] if arg.startswith("--direct_num_workers=") else (
            beam_args[i + 1] if arg == "--direct_num_workers" and i + 1 < len(beam_args) else None)
        if value is not None:
            n = int(value)
            return n if n > 0 else (os.cpu_count() or 1)
    return 1
