"""Beam-only reproduction: the multi-threaded local runner loses grouped elements.

    python -m benchmarks.repro_multithreading_flush_race [--runs 3] [--elements 200000] [--workers 4]

Measured on the shared 2-core machine (Beam 2.77): with the defaults, 1 of 3 runs lost
elements (199,880 of 200,000 grouped); with 20,000 elements and 200 us per element, 0 of 3.

Create -> Reshuffle -> slow ParDo -> GroupByKey -> ParDo with a side input, on
FnApiRunner with --direct_running_mode=multi_threading. Nothing from this project runs.
Each run counts the elements that come out of the GroupByKey; the expected count is
--elements. A run "loses" when the count is short or the runner fails to decode a cut
element.

Why (Beam 2.77, apache_beam/runners/worker/data_plane.py): the embedded SDK worker's
output streams are TimeBasedBufferingClosableOutputStream, flushed every 1 s by a timer
thread: flush() sends get() and then _clear(). The timer holds _flush_lock; the bundle
thread writes into the same buffer without it, so what it writes between get() and
_clear() is dropped (and a flush may send half an element). The slow ParDo keeps a bundle
writing across timer ticks; more workers and CPU load widen the window. Dataflow's harness
turns the timed flush off by default; multi_processing runs its workers out of process.

Prints one line per run and a summary; exit status 1 when some run lost elements (the bug
reproduced), 0 when none did (it is timing-dependent: on an idle machine it may not).
"""

from __future__ import annotations

import argparse
import sys
import time


def run_once(elements: int, workers: int, keys: int, busy_us: int, payload_bytes: int = 0) -> tuple[int | None, str]:
    """(elements out of the GroupByKey, or None if the run failed; what happened)."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.pvalue import AsSingleton

    class SlowFn(beam.DoFn):
        def process(self, x):
            end = time.perf_counter() + busy_us / 1e6  # CPU, not sleep: the threads contend as under load
            while time.perf_counter() < end:
                pass
            yield (x % keys, b"x" * payload_bytes if payload_bytes else x)

    options = PipelineOptions(["--runner=FnApiRunner", "--direct_running_mode=multi_threading",
                               f"--direct_num_workers={workers}"])
    import os
    import tempfile

    result_path = os.path.join(tempfile.mkdtemp(prefix="repro-flush-race-"), "count")
    try:
        pipeline = beam.Pipeline(options=options)
        side = pipeline | "Side" >> beam.Create([1])
        sizes = (
            pipeline
            | "Create" >> beam.Create(range(elements))
            | "Reshuffle" >> beam.Reshuffle()
            | "Slow" >> beam.ParDo(SlowFn())
            | "Group" >> beam.GroupByKey()
            | "Count" >> beam.Map(lambda kv, one: len(list(kv[1])) * one, one=AsSingleton(side))
            | "Sum" >> beam.CombineGlobally(sum)
        )
        sizes | "Collect" >> beam.Map(lambda n: open(result_path, "w").write(str(n)))  # DoFns are pickled: no shared list
        pipeline.run().wait_until_finish()
    except Exception as e:  # a cut element fails to decode: also a loss
        return None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    got = int(open(result_path).read()) if os.path.exists(result_path) else 0
    return got, f"{got:,} of {elements:,} elements grouped"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--elements", type=int, default=200_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--keys", type=int, default=500)
    ap.add_argument("--busy-us", type=int, default=20, help="CPU time per element in the slow ParDo")
    ap.add_argument("--payload-bytes", type=int, default=300, help="bytes per grouped value (0: the int itself)")
    args = ap.parse_args()
    lost = 0
    for i in range(args.runs):
        started = time.monotonic()
        got, what = run_once(args.elements, args.workers, args.keys, args.busy_us, args.payload_bytes)
        bad = got != args.elements
        lost += bad
        print(f"run {i + 1}: {what} in {time.monotonic() - started:.1f} s{'  <- LOST' if bad else ''}", flush=True)
    print(f"{lost} of {args.runs} runs lost elements (multi_threading, {args.workers} workers)")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
