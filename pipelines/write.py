"""Write stage: shards, dead letters and the run summary, all to staging.

Nothing here touches the final location. Every file lands under a staging
prefix named by the run id (OUTPUT/L<L>/.staging-<run>/, OUTPUT/.staging-<run>/);
publish.py moves shards into place and writes manifest.json last, after the
whole pipeline succeeded and the accounting checks passed.

ArrayRecordWriter can only open local paths, so a shard is written to a local
temp file (with group_size:1 spelled out) and then streamed to its staging
path through Beam's FileSystems, which also handles gs://.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.metrics.metric import Metrics

from pipelines.planning import LengthPlan
from pipelines.columns import FragmentBatch, ShardWork, concat_wire
from pipelines.records import DeadLetter, TaskMeta, place_in_file, range_offsets
from pipelines.stage import StageClock
from pipelines.rows import encode_rows_flat
from prepack.accounting import Tally
from prepack.manifest import DEAD_LETTER_NAME
from prepack.shardfile import DEFAULT_WRITER_OPTIONS, shard_name, write_shard

NAMESPACE = "prepack"
SUMMARY_NAME = "summary.json"
COPY_BLOCK = 8 << 20


def length_dir(output: str, max_length: int) -> str:
    return f"{output}/L{max_length}"


def staging_dir(output: str, max_length: int, run_id: str) -> str:
    return f"{length_dir(output, max_length)}/.staging-{run_id}"


def run_staging_dir(output: str, run_id: str) -> str:
    return f"{output}/.staging-{run_id}"


def create_file(path: str):
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    return FileSystems.create(path, mime_type="application/octet-stream", compression_type=CompressionTypes.UNCOMPRESSED)


def write_bytes(path: str, data: bytes) -> None:
    with create_file(path) as f:
        f.write(data)


def copy_local_to(local_path: str, dest: str) -> None:
    with open(local_path, "rb") as src, create_file(dest) as dst:
        shutil.copyfileobj(src, dst, COPY_BLOCK)


class ShardCheckError(AssertionError):
    """The rows that reached a shard are not the rows the plan put there."""


def _rows_from_fragments(
    batch: FragmentBatch, expected_rows: range, max_length: int, pad_id: int, stats: dict[str, int]
) -> Iterator[bytes]:
    """Encoded rows in row order; checks that the rows are exactly the plan's rows for this
    shard and that each comes with segment positions 0..k-1."""
    order = np.lexsort((batch.positions, batch.rows))
    rows = batch.rows[order]
    positions = batch.positions[order].astype(np.int64)
    row_ids, first, seg_counts = np.unique(rows, return_index=True, return_counts=True)
    expected = np.arange(expected_rows.start, expected_rows.stop, expected_rows.step, dtype=np.int64)
    if len(row_ids) != len(expected) or not np.array_equal(row_ids, expected):
        missing = np.setdiff1d(expected, row_ids)[:5].tolist()
        extra = np.setdiff1d(row_ids, expected)[:5].tolist()
        raise ShardCheckError(f"L={max_length}: rows missing from this shard {missing}, rows that do not belong {extra}")
    want = np.arange(len(rows)) - np.repeat(first, seg_counts)
    if not np.array_equal(positions, want):
        bad = int(rows[np.flatnonzero(positions != want)[0]])
        raise ShardCheckError(f"L={max_length}: row {bad} does not have segment positions 0..k-1")
    if len(seg_counts):
        stats["segments"] += int(seg_counts.sum())
        stats["min_segments"] = min(stats["min_segments"], int(seg_counts.min()))
        stats["max_segments"] = max(stats["max_segments"], int(seg_counts.max()))
    examples = batch.examples.take(order)
    for record, tokens, targets in encode_rows_flat(seg_counts, examples.lens, examples.ids, examples.mask, max_length, pad_id):
        stats["rows"] += 1
        stats["tokens"] += tokens
        stats["target_tokens"] += targets
        yield record


class WriteShardFn(beam.DoFn):
    """(shard index, ShardWork) -> that shard's file of every L that has one, in staging, and
    each file's figures."""

    def __init__(self, output: str, run_id: str, pad_id: int):
        self.output = output
        self.run_id = run_id
        self.pad_id = pad_id

    def setup(self) -> None:
        self.m_rows = Metrics.counter(NAMESPACE, "rows_written")
        self.m_shards = Metrics.counter(NAMESPACE, "shards_written")
        self.m_bytes = Metrics.counter(NAMESPACE, "shard_bytes_written")
        self.m_segments = Metrics.distribution(NAMESPACE, "segments_per_row")
        self.clock_write = StageClock("write")
        self.clock_copy = StageClock("copy")

    def process(self, element: tuple[int, Iterable[tuple]], plans: dict[int, LengthPlan]) -> Iterator[dict]:
        shard, wires = element
        started = StageClock.now()
        work = concat_wire(ShardWork, wires)
        self.clock_write.add(StageClock.now() - started)
        for max_length in work.max_lengths():
            yield self._write(max_length, shard, work.fragments(max_length), plans[max_length])

    def _write(self, max_length: int, shard: int, fragments: FragmentBatch, plan: LengthPlan) -> dict:
        started = StageClock.now()
        stats = {"rows": 0, "segments": 0, "tokens": 0, "target_tokens": 0, "min_segments": 1 << 30, "max_segments": 0}
        name = shard_name(shard, plan.num_shards)
        tmp = tempfile.mkdtemp(prefix="prepack-shard-")
        try:
            local = os.path.join(tmp, name)
            rows = _rows_from_fragments(fragments, plan.rows_in_shard(shard), max_length, self.pad_id, stats)
            info = write_shard(local, rows, DEFAULT_WRITER_OPTIONS)
            written = StageClock.now()
            self.clock_write.add(written - started)
            copy_local_to(local, f"{staging_dir(self.output, max_length, self.run_id)}/{name}")
            self.clock_copy.add(StageClock.now() - written)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.m_rows.inc(info.num_rows)
        self.m_shards.inc()
        self.m_bytes.inc(info.num_bytes)
        if stats["rows"]:
            self.m_segments.update(stats["segments"] // stats["rows"])
        return {
            "max_length": max_length,
            "index": shard,
            "path": info.path,
            "num_rows": info.num_rows,
            "num_bytes": info.num_bytes,
            "sha256": info.sha256,
            **stats,
        }


class WriteDeadLetterFn(beam.DoFn):
    """(L, dead letters) -> dead_letter.jsonl in L's staging folder, sorted by source; records
    and lines of byte-range tasks are numbered from the start of their file."""

    def __init__(self, output: str, run_id: str, tasks: tuple[TaskMeta, ...]):
        self.output = output
        self.run_id = run_id
        self.tasks = tasks

    def process(self, element: tuple[int, Iterable[DeadLetter]], fingerprints: list) -> Iterator[tuple[int, int]]:
        max_length, entries = element
        offsets = range_offsets(self.tasks, fingerprints)
        ordered = sorted(entries, key=lambda e: e[0])
        lines = [json.dumps(place_in_file(entry, key[0], offsets), ensure_ascii=False, sort_keys=True) + "\n"
                 for key, entry in ordered]
        write_bytes(f"{staging_dir(self.output, max_length, self.run_id)}/{DEAD_LETTER_NAME}", "".join(lines).encode("utf-8"))
        yield (max_length, len(lines))


class WriteSummaryFn(beam.DoFn):
    """Collects the run's figures into OUTPUT/.staging-<run>/summary.json for the launcher."""

    def __init__(self, output: str, run_id: str):
        self.output = output
        self.run_id = run_id

    def process(
        self, _: Any, tally: Tally, plans: dict[int, LengthPlan], shards: list[dict], dead: list, fingerprints: list
    ) -> Iterator[str]:
        summary: dict[str, Any] = {
            "tally": tally.to_json(),
            "fingerprints": sorted([list(f) for f in fingerprints], key=lambda f: f[0]),
            "lengths": {},
        }
        dead_counts = dict(dead)
        for max_length, plan in sorted(plans.items()):
            summary["lengths"][str(max_length)] = {
                "plan": {
                    "num_rows": plan.num_rows,
                    "num_shards": plan.num_shards,
                    "num_examples": plan.num_examples,
                    "tokens": plan.tokens,
                    "min_segments": plan.min_segments,
                    "max_segments": plan.max_segments,
                },
                "shards": sorted((s for s in shards if s["max_length"] == max_length), key=lambda s: s["index"]),
                "dead_letter_entries": dead_counts.get(max_length, 0),
            }
        path = f"{run_staging_dir(self.output, self.run_id)}/{SUMMARY_NAME}"
        write_bytes(path, json.dumps(summary, sort_keys=True).encode("utf-8"))
        yield path
