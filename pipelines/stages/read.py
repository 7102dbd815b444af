"""Read stage: one ReadTask -> batches of raw records (pipelines/inputs/readers.py reads each kind)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics.metric import Metrics
from apache_beam.pvalue import TaggedOutput

from pipelines.inputs import readers
from pipelines.faults.failures import InputFileError
from pipelines.faults.failpoints import InjectedFault
from pipelines.inputs.limits import InputLimits
from pipelines.inputs.sources import ReadTask
from pipelines.stage_shared import NAMESPACE, TAG_FINGERPRINT, Progress, StageClock


class ReadTaskFn(beam.DoFn):
    """ReadTask -> (task_index, [raw record, ...]) batches of at most batch_size (a raw record is
    described in pipelines/inputs/readers.py); tagged TAG_FINGERPRINT: one (task_index, sha256 or None,
    bytes read, records, lines) per task.

    Contract: every record of the task is emitted exactly once, in the task's order; a read
    that fails fails the job with the file named.
    """

    def __init__(self, batch_size: int, progress: bool, limits: InputLimits | None = None):
        self.batch_size = batch_size
        self.progress = progress
        self.limits = limits or InputLimits()

    def setup(self) -> None:
        self.records = Metrics.counter(NAMESPACE, "records_read")
        self.bytes = Metrics.counter(NAMESPACE, "bytes_read")
        self.files = Metrics.counter(NAMESPACE, "tasks_read")
        self.clock = StageClock("read")

    def process(self, task: ReadTask) -> Iterator[Any]:
        digest = readers.FileDigest()
        batch: list = []
        count = 0
        started = StageClock.now()
        try:
            for record in readers.iter_task(task, digest, self.batch_size, self.limits):
                batch.append(record)
                if len(batch) >= self.batch_size:
                    count += len(batch)
                    self.records.inc(len(batch))
                    if self.progress:
                        Progress.add("read", "records", len(batch))
                    # Downstream steps of the same stage run inside the yield: not reading time.
                    self.clock.add(StageClock.now() - started)
                    yield (task.task_index, batch)
                    started = StageClock.now()
                    batch = []
        except (InputFileError, InjectedFault):  # an injected error is not the file's fault
            raise
        except Exception as e:
            # Name the file: a corrupt Parquet footer deep in pyarrow says nothing about which input it was.
            raise InputFileError(f"reading {task.path} ({task.kind}) failed after {count + len(batch)} records: "
                                 f"{type(e).__name__}: {e}; check or replace the file") from e
        self.clock.add(StageClock.now() - started)
        if batch:
            count += len(batch)
            self.records.inc(len(batch))
            if self.progress:
                Progress.add("read", "records", len(batch))
            yield (task.task_index, batch)
        self.files.inc()
        self.bytes.inc(digest.num_bytes)
        fingerprint = digest.hexdigest() if task.kind in ("jsonl", "json", "parquet", "arrow") else None
        yield TaggedOutput(TAG_FINGERPRINT, (task.task_index, fingerprint, digest.num_bytes, count, digest.lines))


class ReadInputs(beam.PTransform):
    """The read stage as one transform: the job's read tasks -> {"records": batches of raw
    records, "fingerprints": one (task_index, sha256, bytes, records, lines) per task}.

    Records cross a shuffle only when some task is big and unsplittable (a large compressed or
    non-JSONL file); byte ranges and dataset row ranges already spread the reading evenly."""

    def __init__(self, tasks: list[ReadTask], batch_size: int, progress: bool, limits: InputLimits | None = None):
        super().__init__()
        self.tasks, self.batch_size, self.progress, self.limits = tasks, batch_size, progress, limits

    def expand(self, pbegin: Any) -> dict[str, Any]:
        from pipelines.inputs.sources import SPREAD_TASK_BYTES

        read = (
            pbegin
            | "ListInputs" >> beam.Create(self.tasks)
            | "SpreadTasks" >> beam.Reshuffle()
            | "Read" >> beam.ParDo(ReadTaskFn(self.batch_size, self.progress, self.limits)).with_outputs(TAG_FINGERPRINT, main="records")
        )
        spread = any(t.may_exceed(SPREAD_TASK_BYTES) for t in self.tasks)
        records = read.records | "SpreadRecords" >> beam.Reshuffle() if spread else read.records
        return {"records": records, "fingerprints": read[TAG_FINGERPRINT]}
