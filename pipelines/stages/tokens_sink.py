"""Writing the tokenized set (OUTPUT/tokens/) during a full run, and publishing it.

The tokenized examples are written where they are made: the writer runs in the same
fused stage as the tokenizer, one ArrayRecord file per bundle (split at TARGET_FILE_BYTES),
named by its content, so the examples never cross a shuffle on their way to disk. Which
examples share a file therefore depends on the runner's bundles; the records, the
manifest's figures and any shard set packed from them do not (the job ranks examples by
hash and id, never by file order).

Published with the shard sets through the same commit (pipelines/output/commit.py):
files staged under OUTPUT/tokens/.staging-<run>/, moved into place, the manifest switched
after the shard sets' and before the run record.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.metrics.metric import Metrics
from apache_beam.transforms.window import GlobalWindows

from pipelines.wire.columns import TokenizedBatch
from pipelines.wire.records import DeadLetter
from pipelines.stage_shared import StageClock
from pipelines.summary import TokenFile, TokenIndex
from pipelines.stages.write import copy_local_to, write_bytes
from prepack.format.layout import tokens_staging_dir
from prepack.format.tokenset import (
    TOKENS_WRITER_OPTIONS,
    dropped_name,
    encode_batch,
    shard_name,
)

NAMESPACE = "prepack"
INDEX_NAME = "index.json"
TARGET_FILE_BYTES = 256 << 20  # encoded bytes per file before it is split (compressed: ~half)


class WriteTokensFn(beam.DoFn):
    """TokenizedBatch -> this bundle's tokenized-set files in staging; yields each file's figures.
    Examples without a target after their first token are left out (dropped at any max length)."""

    def __init__(self, output: str, run_id: str):
        self.output = output
        self.run_id = run_id

    def setup(self) -> None:
        self.m_examples = Metrics.counter(NAMESPACE, "tokens_set_examples")
        self.m_bytes = Metrics.counter(NAMESPACE, "tokens_set_bytes")
        self.clock = StageClock("tokens")

    def start_bundle(self) -> None:
        self.writer = None

    def _open(self) -> None:
        from array_record.python.array_record_module import ArrayRecordWriter

        self.tmp = tempfile.mkdtemp(prefix="prepack-tokens-")
        self.local = os.path.join(self.tmp, "tokens.array_record")
        self.writer = ArrayRecordWriter(self.local, TOKENS_WRITER_OPTIONS)
        self.figures = Counter()

    def process(self, batch: TokenizedBatch) -> Iterator[TokenFile]:
        started = StageClock.now()
        keep = np.flatnonzero(batch.targets_after_first() > 0)
        if len(keep) < len(batch):
            batch = batch.take(keep)
        if not len(batch):
            return
        if self.writer is None:
            self._open()
        e = batch.examples
        for record in encode_batch(batch.example_ids, batch.locs, e.lens, e.ids, e.mask, e.pair_bounds):
            self.writer.write(record)
            self.figures["encoded_bytes"] += len(record)
        self.figures["num_rows"] += len(batch)
        self.figures["tokens"] += int(e.lens.sum())
        self.figures["target_tokens"] += int(e.mask.sum())
        self.clock.add(StageClock.now() - started)
        if self.figures["encoded_bytes"] >= TARGET_FILE_BYTES:
            yield self._close()

    def _close(self) -> TokenFile:
        started = StageClock.now()
        self.writer.close()
        self.writer = None
        try:
            digest = hashlib.sha256()
            with open(self.local, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            sha = digest.hexdigest()
            name = shard_name(sha)
            size = os.path.getsize(self.local)
            copy_local_to(self.local, f"{tokens_staging_dir(self.output, self.run_id)}/{name}")
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
        self.m_examples.inc(self.figures["num_rows"])
        self.m_bytes.inc(size)
        self.clock.add(StageClock.now() - started)
        return TokenFile(path=name, num_rows=self.figures["num_rows"], num_bytes=size, sha256=sha,
                         tokens=self.figures["tokens"], target_tokens=self.figures["target_tokens"])

    def finish_bundle(self) -> Iterator[Any]:
        if self.writer is not None:
            yield GlobalWindows.windowed_value(self._close())


class WriteTokenIndexFn(beam.DoFn):
    """Once per run: dropped-<sha>.jsonl (the examples dropped before fitting, with the keys that
    order dead letters) and index.json (the files written) in the tokenized set's staging."""

    def __init__(self, output: str, run_id: str):
        self.output = output
        self.run_id = run_id

    def process(self, _: Any, files: list[TokenFile], dropped: list[DeadLetter]) -> Iterator[str]:
        staging = tokens_staging_dir(self.output, self.run_id)
        lines = [json.dumps([list(key), entry], ensure_ascii=False, sort_keys=True) + "\n"
                 for key, entry in sorted(dropped, key=lambda d: d[0])]
        data = "".join(lines).encode("utf-8")
        name = dropped_name(hashlib.sha256(data).hexdigest())
        if lines:
            write_bytes(f"{staging}/{name}", data)
        index = TokenIndex(tuple(sorted(files, key=lambda f: f.path)), len(lines), name)
        path = f"{staging}/{INDEX_NAME}"
        write_bytes(path, index.to_json().encode("utf-8"))
        yield path


class WriteTokenSet(beam.PTransform):
    """{"examples": TokenizedBatches as the tokenizer made them, "bad": bad records' dead letters,
    "dead": (L, dead letter) from fitting} -> the tokenized set staged under OUTPUT/tokens/
    (a PCollection of its index.json path). Examples with no target are dropped at every
    length: their dead letters are taken once, from the first length."""

    def __init__(self, output: str, run_id: str, first_length: int):
        super().__init__()
        self.output, self.run_id, self.first_length = output, run_id, first_length

    def expand(self, inputs: dict[str, Any]) -> Any:
        from apache_beam.pvalue import AsList

        from prepack.packing.accounting import NO_TARGETS

        first = self.first_length
        no_targets = inputs["dead"] | "NoTargetsOnce" >> beam.FlatMap(
            lambda le: [le[1]] if le[0] == first and le[1][1]["reason"] == NO_TARGETS else [])
        dropped = (inputs["bad"], no_targets) | "FlattenDropped" >> beam.Flatten()
        files = inputs["examples"] | "WriteTokens" >> beam.ParDo(WriteTokensFn(self.output, self.run_id))
        return (
            inputs["examples"].pipeline
            | "OnceTokens" >> beam.Create([None])
            | "WriteTokenIndex" >> beam.ParDo(WriteTokenIndexFn(self.output, self.run_id), files=AsList(files),
                                              dropped=AsList(dropped))
        )
