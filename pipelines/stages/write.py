"""Write stage: shards, dead letters and the run summary, all to staging.

Nothing here touches the final location. Every file lands under a staging
prefix named by the run id (OUTPUT/L<L>/.staging-<run>/, OUTPUT/.staging-<run>/);
the output layer (pipelines/output/commit.py) moves shards into place and switches manifest.json, after the
whole pipeline succeeded and the accounting checks passed. A shard's published
name carries its sha256, so it never overwrites another set's file.

ArrayRecordWriter can only open local paths, so a shard is written to a local
temp file (with group_size:1 spelled out) and then streamed to its staging
path through the storage interface (prepack/storage: local or gs://).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.metrics.metric import Metrics

from pipelines.planning import LengthPlan
from pipelines.wire.columns import FragmentBatch, ShardWork, concat_wire
from pipelines.inputs.compressed import decompressed_blocks
from pipelines.faults.failures import InputFileError, ShardCheckError
from pipelines.wire.records import DeadLetter, TaskMeta, place_in_file, range_offsets
from pipelines.stage_shared import StageClock
from pipelines.summary import LengthSummary, PlanSummary, RunSummary, ShardSummary
from prepack.format.layout import run_staging_dir, staging_dir, summary_path
from prepack.format.rowformat import CHOSEN, REJECTED, encode_rows_flat
from prepack.packing.accounting import Tally
from prepack.format.manifest import DEAD_LETTER_NAME
from prepack.format.shardfile import DEFAULT_WRITER_OPTIONS, shard_name, write_shard
from prepack.storage import create_stream, open_stream

NAMESPACE = "prepack"
COPY_BLOCK = 8 << 20


def write_bytes(path: str, data: bytes) -> None:
    with create_stream(path) as f:
        f.write(data)


def copy_local_to(local_path: str, dest: str) -> None:
    with open(local_path, "rb") as src, create_stream(dest) as dst:
        shutil.copyfileobj(src, dst, COPY_BLOCK)


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
    sources = None if batch.sources is None else batch.sources[order]
    totals = None if batch.example_targets is None else batch.example_targets[order]
    lens, sides = examples.lens, None
    if examples.pair_bounds is not None:  # each slot a preference pair: its two sides, two adjacent segments
        lens = np.stack([examples.pair_bounds[:, 1], examples.lens - examples.pair_bounds[:, 1]], axis=1).ravel()
        seg_counts = seg_counts * 2
        sources = None if sources is None else np.repeat(sources, 2)
        sides = np.tile(np.array([CHOSEN, REJECTED], dtype=np.int32), len(examples.lens))
        side_targets = np.add.reduceat(examples.mask.astype(np.int64), np.cumsum(lens) - lens) if len(lens) else lens
        stats["rejected_tokens"] += int(lens[1::2].sum())
        stats["rejected_target_tokens"] += int(side_targets[1::2].sum())
    for record, tokens, targets in encode_rows_flat(seg_counts, lens, examples.ids, examples.mask, max_length, pad_id,
                                                    sources, totals, sides):
        stats["rows"] += 1
        stats["tokens"] += tokens
        stats["target_tokens"] += targets
        yield record


# Fault hook for tests: "SHARD:WINDOW" of a write window whose elements are dropped, as a runner
# that loses elements would (the assembler's check must then fail the job with one line).
FAULT_DROP_WINDOW_ENV = "PREPACK_FAULT_DROP_WINDOW"
PART_BLOCK = 8 << 20  # bytes of framed rows buffered before a write to a part file
PART_ZSTD_LEVEL = 1  # the fastest level: parts are read once, by the assembler
PART_READ_BLOCK = 256 << 10  # compressed bytes per read: what one read decompresses to stays small
_FRAME = struct.Struct("<I")


def part_path(output: str, run_id: str, max_length: int, shard: int, window: int) -> str:
    return f"{run_staging_dir(output, run_id)}/parts/L{max_length}/{shard:06d}-{window:06d}"


def _new_stats() -> dict[str, int]:
    return {"rows": 0, "segments": 0, "tokens": 0, "target_tokens": 0, "min_segments": 1 << 30, "max_segments": 0,
            "rejected_tokens": 0, "rejected_target_tokens": 0}


def _merge_stats(into: dict[str, int], part: dict[str, int]) -> None:
    for k in ("rows", "segments", "tokens", "target_tokens", "rejected_tokens", "rejected_target_tokens"):
        into[k] += part[k]
    into["min_segments"] = min(into["min_segments"], part["min_segments"])
    into["max_segments"] = max(into["max_segments"], part["max_segments"])


def write_part(path: str, records: Iterable[bytes]) -> None:
    """Length-framed records to a part file, zstd-compressed (level PART_ZSTD_LEVEL), in blocks
    of PART_BLOCK bytes. Compressed because a part holds rows before padding is squeezed out:
    written raw, the parts were the job's largest write (~2.6 KB per example for 3 L) and cost
    more CPU than compressing them (docs/benchmarks.md, "Packing-job CPU after the window writer")."""
    import zstandard

    with create_stream(path) as f, zstandard.ZstdCompressor(level=PART_ZSTD_LEVEL).stream_writer(f, closefd=False) as z:
        block: list[bytes] = []
        size = 0
        for record in records:
            block += (_FRAME.pack(len(record)), record)
            size += len(record) + 4
            if size >= PART_BLOCK:
                z.write(b"".join(block))
                block, size = [], 0
        if block:
            z.write(b"".join(block))


def read_part(path: str) -> Iterator[bytes]:
    """The records of a part file, one at a time; ShardCheckError if it is damaged or truncated."""
    buf = bytearray()
    with open_stream(path) as raw:
        try:
            for block in decompressed_blocks(raw, path, ".zst", read_block=PART_READ_BLOCK):
                buf += block
                pos = 0
                while len(buf) - pos >= 4:
                    (n,) = _FRAME.unpack_from(buf, pos)
                    if len(buf) - pos - 4 < n:
                        break
                    yield bytes(buf[pos + 4:pos + 4 + n])
                    pos += 4 + n
                del buf[:pos]
        except InputFileError as e:
            raise ShardCheckError(f"part file {path} is truncated or damaged (a storage fault)") from e
    if buf:
        raise ShardCheckError(f"part file {path} ends inside a row (a storage fault)")


class WriteWindowFn(beam.DoFn):
    """((shard index, window), ShardWork) -> one part file per L with rows in that window of
    that shard, rows checked against the plan and encoded in row order; emits
    ((L, shard), (window, part path, figures)) for AssembleShardFn.

    A window holds at most WINDOW_TOKENS row slots per L (planning.WINDOW_TOKENS), so what one
    writer holds does not grow with the shard size or the input.

    Contract: a part holds exactly the rows the plan put in that window of that shard, each
    with segment positions 0..k-1 (ShardCheckError otherwise), in (row, position) order, so its
    bytes do not depend on the order the slots arrived in; nothing is written outside staging.
    """

    def __init__(self, output: str, run_id: str, pad_id: int):
        self.output = output
        self.run_id = run_id
        self.pad_id = pad_id

    def setup(self) -> None:
        self.m_rows = Metrics.counter(NAMESPACE, "rows_written")
        self.m_segments = Metrics.distribution(NAMESPACE, "segments_per_row")
        self.clock_write = StageClock("write")
        self.drop = os.environ.get(FAULT_DROP_WINDOW_ENV)

    def process(self, element: tuple[tuple[int, int], Iterable[tuple]], plans: dict[int, LengthPlan]) -> Iterator[tuple]:
        (shard, window), wires = element
        if self.drop == f"{shard}:{window}":
            return
        started = StageClock.now()
        work = concat_wire(ShardWork, wires)
        for max_length in work.max_lengths():
            stats = _new_stats()
            plan = plans[max_length]
            rows = _rows_from_fragments(work.fragments(max_length), plan.rows_in_window(shard, window), max_length,
                                        self.pad_id, stats)
            path = part_path(self.output, self.run_id, max_length, shard, window)
            write_part(path, rows)
            self.m_rows.inc(stats["rows"])
            if stats["rows"]:
                self.m_segments.update(stats["segments"] // stats["rows"])
            yield ((max_length, shard), (window, path, stats))
        self.clock_write.add(StageClock.now() - started)


class AssembleShardFn(beam.DoFn):
    """((L, shard index), [(window, part path, figures)]) -> the shard file in staging, its rows
    streamed from the parts in window order (one row in memory at a time), and its figures
    (rows, segments, tokens, bytes, sha256) for the summary.

    Contract: every window of the shard has its part (ShardCheckError otherwise: lost rows), so
    the file holds exactly the shard's planned rows in row order; nothing is written outside
    staging."""

    def __init__(self, output: str, run_id: str):
        self.output = output
        self.run_id = run_id

    def setup(self) -> None:
        self.m_shards = Metrics.counter(NAMESPACE, "shards_written")
        self.m_bytes = Metrics.counter(NAMESPACE, "shard_bytes_written")
        self.clock_write = StageClock("write")
        self.clock_copy = StageClock("copy")

    def process(self, element: tuple[tuple[int, int], Iterable[tuple]], plans: dict[int, LengthPlan]) -> Iterator[dict]:
        (max_length, shard), parts = element
        plan = plans[max_length]
        parts = sorted(parts, key=lambda p: p[0])
        windows = [p[0] for p in parts]
        expected = list(range(plan.num_windows(shard)))
        if windows != expected:
            missing = sorted(set(expected) - set(windows))[:5]
            first_rows = [plan.rows_in_window(shard, w)[0] for w in missing]
            raise ShardCheckError(f"L={max_length}: shard {shard} lacks the rows of write windows {missing} "
                                  f"(starting at rows {first_rows})")
        stats = _new_stats()
        for _, _, part in parts:
            _merge_stats(stats, part)
        started = StageClock.now()
        tmp = tempfile.mkdtemp(prefix="prepack-shard-")
        try:
            local = os.path.join(tmp, shard_name(shard, plan.num_shards))
            info = write_shard(local, (record for _, path, _ in parts for record in read_part(path)), DEFAULT_WRITER_OPTIONS)
            if info.num_rows != stats["rows"]:
                raise ShardCheckError(f"L={max_length}: shard {shard} read {info.num_rows} rows back from its parts, "
                                      f"its windows wrote {stats['rows']}")
            written = StageClock.now()
            self.clock_write.add(written - started)
            # The published name carries the content's hash: a new set never overwrites a file
            # of the set readers may still be using (docs/manifest.md, "Publishing and readers").
            name = shard_name(shard, plan.num_shards, info.sha256)
            copy_local_to(local, f"{staging_dir(self.output, max_length, self.run_id)}/{name}")
            self.clock_copy.add(StageClock.now() - written)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        # Part files stay until the run's staging prefix is removed: a retried bundle may read them again.
        self.m_shards.inc()
        self.m_bytes.inc(info.num_bytes)
        yield ShardSummary(max_length=max_length, index=shard, path=name, num_rows=info.num_rows,
                           num_bytes=info.num_bytes, sha256=info.sha256, **stats)


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
    """Collects the run's figures (the job's Tally, plans, shard files, dead-letter counts,
    input fingerprints) into OUTPUT/.staging-<run>/summary.json, which the launcher checks
    and publishes from; keys and lists sorted, so equal runs write equal summaries."""

    def __init__(self, output: str, run_id: str):
        self.output = output
        self.run_id = run_id

    def process(
        self, _: Any, tally: Tally, plans: dict[int, LengthPlan], shards: list[ShardSummary], dead: list, fingerprints: list
    ) -> Iterator[str]:
        dead_counts = dict(dead)
        lengths = {
            max_length: LengthSummary(
                plan=PlanSummary(num_rows=plan.num_rows, num_shards=plan.num_shards, num_examples=plan.num_examples,
                                 tokens=plan.tokens, min_segments=plan.min_segments, max_segments=plan.max_segments,
                                 bfd_rows=plan.bfd_rows, method=plan.method,
                                 planner_fallback=plan.planner_fallback),
                shards=tuple(sorted((s for s in shards if s.max_length == max_length), key=lambda s: s.index)),
                dead_letter_entries=dead_counts.get(max_length, 0),
            )
            for max_length, plan in sorted(plans.items())
        }
        summary = RunSummary(tally.to_json(), tuple(sorted((tuple(f) for f in fingerprints), key=lambda f: f[0])), lengths)
        path = summary_path(self.output, self.run_id)
        write_bytes(path, summary.to_json().encode("utf-8"))
        yield path


class WriteShardSets(beam.PTransform):
    """The write stage as one transform: {"rows", "plans"} (PlanAndRoute's outputs), "bad" (bad
    records' dead letters, for every length), "dead" ((L, dead letter)), "tally_read" and
    "tally_fit" (Tallies), "fingerprints" -> the staged shard sets, their dead letters, and the
    run's summary.json (a PCollection of its one path).

    Rows go to their shard's windows (part files), then each shard is assembled from its parts
    in window order; everything is written under the run's staging folders (prepack.format.layout)."""

    def __init__(self, ctx: Any):
        super().__init__()
        self.ctx = ctx

    def expand(self, inputs: dict[str, Any]) -> Any:
        from apache_beam.pvalue import AsDict, AsList, AsSingleton

        from pipelines.stage_shared import MergeTallies

        ctx, config = self.ctx, self.ctx.config
        plans = AsDict(inputs["plans"])
        shards = (
            inputs["rows"]
            | "GroupByWindow" >> beam.GroupByKey()
            | "WriteWindows" >> beam.ParDo(WriteWindowFn(config.run.output, ctx.run_id, ctx.pad_id), plans=plans)
            | "GroupByShard" >> beam.GroupByKey()
            | "WriteShards" >> beam.ParDo(AssembleShardFn(config.run.output, ctx.run_id), plans=plans)
        )
        lengths = config.rows.max_lengths
        bad_per_length = inputs["bad"] | "BadToEveryLength" >> beam.FlatMap(lambda entry: [(L, entry) for L in lengths])
        fingerprints = AsList(inputs["fingerprints"])
        dead = (
            (bad_per_length, inputs["dead"]) | "FlattenDead" >> beam.Flatten()
            | "GroupDead" >> beam.GroupByKey()
            | "WriteDeadLetters" >> beam.ParDo(WriteDeadLetterFn(config.run.output, ctx.run_id, ctx.tasks),
                                               fingerprints=fingerprints)
        )
        tally = (
            (inputs["tally_read"], inputs["tally_fit"]) | "FlattenTally" >> beam.Flatten()
            | "Tally" >> beam.CombineGlobally(MergeTallies())
        )
        return (
            inputs["rows"].pipeline
            | "Once" >> beam.Create([None])
            | "WriteSummary" >> beam.ParDo(WriteSummaryFn(config.run.output, ctx.run_id), tally=AsSingleton(tally), plans=plans,
                                           shards=AsList(shards), dead=AsList(dead), fingerprints=fingerprints)
        )
