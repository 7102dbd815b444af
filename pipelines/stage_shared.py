"""What every stage of the job shares: its Beam counter namespace, the tags of its side
outputs, the worker context, the CPU clock per stage, progress lines and the counter merge.

Batching: after reading, records travel in batches of `batch_size` (one
element per batch); tokenized examples stay columnar (one TokenizedBatch per
batch), and the examples bound for the routing GroupByKey are buffered for the
bundle and grouped by key when flushed. Per-element overhead in Beam's local
runner is tens of microseconds, far more than the tokenizer spends on a short
example, so moving batches rather than examples is what keeps the job near the
raw tokenizer's speed.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import apache_beam as beam
from apache_beam.metrics.metric import Metrics
from apache_beam.transforms.window import GlobalWindows

from pipelines import progress
from pipelines.configs import PackConfig, RowSpec
from pipelines.wire.records import TaskMeta
from prepack.packing.accounting import Tally
from prepack.packing.mixture import Mixture

if TYPE_CHECKING:  # for the annotation only: the prepare stage builds the formats
    from prepack.text.formats import ResolvedFormat

NAMESPACE = "prepack"
TAG_BAD = "bad"
TAG_TALLY = "tally"
TAG_HIST = "hist"
TAG_DEAD = "dead"
TAG_FINGERPRINT = "fingerprint"
TAG_PLAN = "plan"
TAG_WEIGHTS = "weights"  # a mixture's kept weight per (L, source, rank bucket), from the fit stage


FLUSH_EXAMPLES = 20_000  # buffered examples per bundle before an early flush (memory bound)


@dataclasses.dataclass(frozen=True)
class JobContext:
    """What every worker needs (small and picklable): the job's config, and what the launcher
    derived from it and the inputs before the pipeline started."""

    config: PackConfig
    tasks: tuple[TaskMeta, ...]
    sub_buckets: int  # resolved: config.rows.sub_buckets, or chosen from the input size
    run_id: str
    pad_id: int
    # The source (1..N) of each input index (example ids start with the input index, so every
    # example knows its source): Mixture.source_of_input(); empty: each input is source 1's.
    source_of_input: tuple[int, ...] = ()
    # Each source's format (sources 1..N in order), resolved once by the launcher (`auto` from the
    # records): what the prepare stage builds its formats from. Empty: a --from-tokens run, which
    # templates nothing.
    formats: tuple[ResolvedFormat, ...] = ()

    # What the stages read per batch, derived once here: plain attributes, not lookups, so the
    # config's walk enters this module once (when the launcher builds the context).
    rows: RowSpec = dataclasses.field(init=False, repr=False, compare=False)
    mixture: Mixture = dataclasses.field(init=False, repr=False, compare=False)
    task_sources: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)  # each task's source

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", self.config.rows)
        object.__setattr__(self, "mixture", self.config.rows.mixture)
        object.__setattr__(self, "task_sources", tuple(
            self.source_of_input[t.input_index] if self.source_of_input else 1 for t in self.tasks))


def in_global_window(value: Any) -> Any:
    return GlobalWindows.windowed_value(value)


class StageClock:
    """CPU time a worker spends in one stage, as a Beam counter `time_us_<stage>`.

    Summed over workers, these say where the job's time goes (benchmarks/bench_pack_job.py);
    what is left of the job's CPU time is Beam itself: coders, shuffles, scheduling.
    """

    def __init__(self, stage: str):
        self.counter = Metrics.counter(NAMESPACE, f"time_us_{stage}")

    def add(self, seconds: float) -> None:
        self.counter.inc(int(seconds * 1e6))

    @staticmethod
    def now() -> float:
        # CPU time, not wall time: on a shared machine wall time counts other jobs too. Process
        # time rather than thread time, because sentencepiece encodes batches on its own threads.
        return time.process_time()


# ----------------------------------------------------------------------------- progress


class Progress:
    """Rates for local runs: one line to stderr at most every EVERY_S per worker process and
    activity ("read" records, "tokenized" examples), by a tqdm counter each (pipelines/progress.py).
    Beam's local runner runs one stage after the other, so reading and tokenizing each report
    while they happen."""

    lock = threading.Lock()
    counters: dict[str, Any] = {}  # what -> its tqdm counter, in this process

    @classmethod
    def add(cls, what: str, unit: str, n: int) -> None:
        with cls.lock:
            bar = cls.counters.get(what)
            if bar is None:
                bar = cls.counters[what] = progress.counter(f"prepack pack [pid {os.getpid()}]: {what}", unit)
        bar.update(n)


class MergeCounters(beam.CombineFn):
    """Sums Counters: the (L, length_key, b) histograms from every bundle into one."""

    def create_accumulator(self) -> Counter:
        return Counter()

    def add_input(self, acc: Counter, value: Counter) -> Counter:
        acc.update(value)
        return acc

    def merge_accumulators(self, accs: Iterable[Counter]) -> Counter:
        out: Counter = Counter()
        for acc in accs:
            out.update(acc)
        return out

    def extract_output(self, acc: Counter) -> dict:
        return dict(acc)


class MergeTallies(beam.CombineFn):
    """Merges every bundle's Tally into the job's."""

    def create_accumulator(self) -> Tally:
        return Tally()

    def add_input(self, acc: Tally, value: Tally) -> Tally:
        return acc.merge(value)

    def merge_accumulators(self, accs: Iterable[Tally]) -> Tally:
        out = Tally()
        for acc in accs:
            out.merge(acc)
        return out

    def extract_output(self, acc: Tally) -> Tally:
        return acc
