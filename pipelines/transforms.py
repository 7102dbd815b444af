"""The job's DoFns: read, template + tokenize, fit per max length, route to rows.

Writing shards and dead letters is in writer.py; the graph is wired in job.py.

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
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.metrics.metric import Metrics
from apache_beam.pvalue import TaggedOutput
from apache_beam.transforms.window import GlobalWindows

from pipelines import readers
from pipelines.failures import InputFileError, ShardCheckError
from pipelines.columns import IDS, LENS, MASK, PayloadBatch, Ragged, ShardWork, TokenizedBatch, concat_wire
from pipelines.planning import LengthPlan, stable_hash, sub_buckets_of
from pipelines.records import (
    DeadLetter,
    TaskMeta,
    dead_letter,
    example_id,
)
from pipelines.sources import ReadTask
from prepack.packer import DropReason, OverlongPolicy

NAMESPACE = "prepack"
TAG_BAD = "bad"
TAG_TALLY = "tally"
TAG_HIST = "hist"
TAG_DEAD = "dead"
TAG_FINGERPRINT = "fingerprint"
TAG_PLAN = "plan"

# oasst1 messages dropped for these reasons are a property of the data set (other
# languages, failed review, deleted threads), not bad input: counted, not failed on.
OASST1_FILTER_REASONS = frozenset({"deleted", "not_english", "review_failed", "orphaned", "assistant_root"})

FLUSH_EXAMPLES = 20_000  # buffered examples per bundle before an early flush (memory bound)


@dataclasses.dataclass(frozen=True)
class JobContext:
    """The parts of the config every worker needs (small and picklable)."""

    tasks: tuple[TaskMeta, ...]
    template: str
    template_options: tuple[tuple[str, str], ...]
    tokenizer: str
    chat_format: str
    max_lengths: tuple[int, ...]
    overlong: OverlongPolicy
    pack: bool
    sub_buckets: int
    batch_size: int
    progress: bool
    output: str
    run_id: str
    pad_id: int


def _windowed(value: Any) -> Any:
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


class _Progress:
    """Rates for local runs: one line to stderr every `every_s` per worker process and
    activity ("read" records, "tokenized" examples). Beam's local runner runs one stage
    after the other, so reading and tokenizing each report while they happen."""

    lock = threading.Lock()
    state: dict[str, list[float]] = {}  # what -> [count, started, last printed]

    @classmethod
    def add(cls, what: str, unit: str, n: int, every_s: float = 10.0) -> None:
        now = time.monotonic()
        with cls.lock:
            entry = cls.state.setdefault(what, [0, now, now])
            entry[0] += n
            if now - entry[2] < every_s:
                return
            entry[2] = now
            count, elapsed = int(entry[0]), now - entry[1]
        print(f"prepack pack [pid {os.getpid()}]: {what} {count:,} {unit} in {elapsed:,.0f} s "
              f"({count / max(elapsed, 1e-9):,.0f} {unit}/s)", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- read


class ReadTaskFn(beam.DoFn):
    """ReadTask -> (task_index, [raw record, ...]) batches; tagged: the task's fingerprint."""

    def __init__(self, batch_size: int, progress: bool):
        self.batch_size = batch_size
        self.progress = progress

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
            for record in readers.iter_task(task, digest, self.batch_size):
                batch.append(record)
                if len(batch) >= self.batch_size:
                    count += len(batch)
                    self.records.inc(len(batch))
                    if self.progress:
                        _Progress.add("read", "records", len(batch))
                    # Downstream steps of the same stage run inside the yield: not reading time.
                    self.clock.add(StageClock.now() - started)
                    yield (task.task_index, batch)
                    started = StageClock.now()
                    batch = []
        except InputFileError:
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
                _Progress.add("read", "records", len(batch))
            yield (task.task_index, batch)
        self.files.inc()
        self.bytes.inc(digest.num_bytes)
        fingerprint = digest.hexdigest() if task.kind in ("jsonl", "json", "parquet", "arrow") else None
        yield TaggedOutput(TAG_FINGERPRINT, (task.task_index, fingerprint, digest.num_bytes, count, digest.lines))


# ----------------------------------------------------------------------------- template + tokenize


class _Tokenizing:
    """Shared by the per-record and the table-level (oasst1) paths: loads the tokenizer
    and chat format once per worker, encodes a batch with one encode_batch call."""

    ctx: JobContext

    def _setup_tokenizer(self) -> None:
        from prepack.chat_formats import get_chat_format
        from prepack.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.ctx.tokenizer)
        self.format = get_chat_format(self.ctx.chat_format, self.tokenizer)
        self.m_examples = Metrics.counter(NAMESPACE, "examples_tokenized")
        self.m_tokens = Metrics.counter(NAMESPACE, "tokens_tokenized")
        self.m_lengths = Metrics.distribution(NAMESPACE, "example_tokens")
        self.m_bad = Metrics.counter(NAMESPACE, "bad_records")
        self.clock_template = StageClock("template")
        self.clock_tokenize = StageClock("tokenize")

    def _tokenize(
        self, convs: list, metas: list[tuple[Any, str]], tally: Counter, bad: list[DeadLetter]
    ) -> list[TokenizedBatch]:
        """Examples for convs (metas[i] = (loc, example_id)); a conversation the chat format
        rejects becomes a dead letter and the rest of the batch goes on."""
        from prepack.chat_formats import ChatFormatError, tokenize_conversations_flat

        started = StageClock.now()
        out: list[TokenizedBatch] = []
        start = 0
        while start < len(convs):
            try:
                tokenized = tokenize_conversations_flat(convs[start:], self.tokenizer, self.format)
            except ChatFormatError as e:
                if e.index is None:
                    raise
                bad_at = start + e.index
                if e.index:
                    tokenized = tokenize_conversations_flat(convs[start:bad_at], self.tokenizer, self.format)
                    self._emit(tokenized, metas[start:bad_at], out)
                loc, eid = metas[bad_at]
                tally[("bad_example", e.reason)] += 1
                self.m_bad.inc()
                bad.append(dead_letter(self.ctx.tasks, loc, e.reason, "", e.message, example_id=eid))
                start = bad_at + 1
                continue
            self._emit(tokenized, metas[start:], out)
            break
        self.clock_tokenize.add(StageClock.now() - started)
        return out

    def _tokenize_pairs(self, prompts: list[str], responses: list[str], metas: list[tuple[Any, str]]) -> list[TokenizedBatch]:
        """Examples for single-turn pairs; a fixed layout has no per-conversation errors."""
        from prepack.chat_formats import tokenize_pairs_flat

        started = StageClock.now()
        out: list[TokenizedBatch] = []
        self._emit(tokenize_pairs_flat(prompts, responses, self.tokenizer, self.format), metas, out)
        self.clock_tokenize.add(StageClock.now() - started)
        return out

    def _emit(self, tokenized: tuple | None, metas: list[tuple[Any, str]], out: list[TokenizedBatch]) -> None:
        """tokenized: (input_ids, loss_mask, ends) of a batch, from tokenize_conversations_flat
        or tokenize_pairs_flat; appends one TokenizedBatch to `out`."""
        if tokenized is None:
            return
        input_ids, loss_mask, ends = tokenized
        if not ends:
            return
        lens = np.diff(np.asarray(ends, dtype=np.int64), prepend=0)
        eids = [eid for _, eid in metas]
        hashes = np.fromiter(map(stable_hash, eids), dtype=np.uint64, count=len(eids))
        update_length = self.m_lengths.update
        for n in lens.tolist():
            update_length(n)
        out.append(TokenizedBatch(hashes, eids, [loc for loc, _ in metas],
                                  Ragged(lens.astype(LENS), np.asarray(input_ids, IDS), np.asarray(loss_mask, MASK))))
        self.m_examples.inc(len(ends))
        self.m_tokens.inc(ends[-1])
        if self.ctx.progress:
            _Progress.add("tokenized", "examples", len(ends))


class PrepareFn(beam.DoFn, _Tokenizing):
    """(task_index, raw records) -> TokenizedBatches (one per stretch of the batch between
    conversations the chat format rejects, usually one); tagged: dead letters, tallies.

    Decodes, parses and templates each record, then tokenizes the whole batch at once.
    """

    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    def setup(self) -> None:
        from prepack.templates import get_template

        self.template = get_template(self.ctx.template, **dict(self.ctx.template_options))
        self._setup_tokenizer()
        # Single-turn templates under a format with a fixed layout skip the Conversation
        # objects: (prompt, response) texts go straight to tokenize_pairs_flat.
        self.pairs = hasattr(self.template, "to_pair") and self.format.pair_layout() is not None

    def process(self, element: tuple[int, list]) -> Iterator[Any]:
        from prepack.templates import RecordError

        started = StageClock.now()
        task_index, items = element
        meta = self.ctx.tasks[task_index]
        tally: Counter = Counter()
        bad: list[DeadLetter] = []
        convs: list = []  # Conversations, or on the fast path the prompts
        responses: list[str] = []
        metas: list[tuple[Any, str]] = []
        pairs = self.pairs
        to_conversations = self.template.to_pair if pairs else self.template.to_conversations
        for record_index, line, kind, payload in items:
            loc = (task_index, record_index, line, 0)
            if kind == readers.RAW_TEXT:
                record, error = readers.parse_text(payload)
                if error is not None:
                    tally[("bad_record", error[0])] += 1
                    bad.append(dead_letter(self.ctx.tasks, loc, error[0], "", error[1], readers.snippet(payload)))
                    continue
            elif kind == readers.RAW_ERROR:
                reason, message, raw = payload
                tally[("bad_record", reason)] += 1
                bad.append(dead_letter(self.ctx.tasks, loc, reason, "", message, raw))
                continue
            else:
                record = payload
            try:
                conversations = to_conversations(record)
            except RecordError as e:
                tally[("bad_record", e.reason)] += 1
                bad.append(dead_letter(self.ctx.tasks, loc, e.reason, e.field, e.message, readers.snippet(record)))
                continue
            except RecursionError:  # a record nested too deeply for the template: its problem, not the job's
                tally[("bad_record", "too_deeply_nested")] += 1
                bad.append(dead_letter(self.ctx.tasks, loc, "too_deeply_nested", "", "record nested too deeply to read",
                                       readers.snippet(payload if kind == readers.RAW_TEXT else "")))
                continue
            if pairs:
                convs.append(conversations[0])
                responses.append(conversations[1])
                metas.append((loc, example_id(meta, record_index)))
                continue
            for sub, conv in enumerate(conversations):
                convs.append(conv)
                metas.append(((task_index, record_index, line, sub), example_id(meta, record_index, sub)))
        tally[("records_read",)] += len(items)
        tally[("examples",)] += len(convs)
        self.clock_template.add(StageClock.now() - started)
        if pairs:
            examples = self._tokenize_pairs(convs, responses, metas)
        else:
            examples = self._tokenize(convs, metas, tally, bad)
        self.m_bad.inc(sum(v for k, v in tally.items() if k[0] == "bad_record"))
        yield from examples
        for entry in bad:
            yield TaggedOutput(TAG_BAD, entry)
        yield TaggedOutput(TAG_TALLY, tally)


class KeyTableRecordsFn(beam.DoFn):
    """Table-level formats (oasst1): parse each message and key it by its tree."""

    def __init__(self, ctx: JobContext, group_key: str):
        self.ctx = ctx
        self.group_key = group_key

    def process(self, element: tuple[int, list]) -> Iterator[Any]:
        task_index, items = element
        tally: Counter = Counter({("records_read",): len(items)})
        for record_index, line, kind, payload in items:
            loc = (task_index, record_index, line, 0)
            if kind == readers.RAW_TEXT:
                record, error = readers.parse_text(payload)
            elif kind == readers.RAW_ERROR:
                record, error = None, payload[:2]
            else:
                record, error = payload, None
            if error is None and not isinstance(record, dict):
                error = ("invalid", "expected a message object")
            if error is None and not (isinstance(record.get("message_id"), str) and record["message_id"]):
                error = ("invalid", f"message_id: expected a non-empty string, got {record.get('message_id')!r}")
            if error is not None:
                tally[("bad_record", error[0])] += 1
                raw = payload[2] if kind == readers.RAW_ERROR else readers.snippet(payload if record is None else record)
                yield TaggedOutput(TAG_BAD, dead_letter(self.ctx.tasks, loc, error[0], "", error[1], raw))
                continue
            group = record.get(self.group_key)
            yield (group if isinstance(group, str) else "", (loc, record))
        yield TaggedOutput(TAG_TALLY, tally)


class TableToExamplesFn(beam.DoFn, _Tokenizing):
    """(tree id, messages) -> TokenizedBatches. Conversations are buffered across trees and
    tokenized `batch_size` at a time; the bundle's rest is flushed at its end."""

    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    def setup(self) -> None:
        from prepack.templates import get_template

        self.template = get_template(self.ctx.template, **dict(self.ctx.template_options))
        self._setup_tokenizer()

    def start_bundle(self) -> None:
        self.convs: list = []
        self.metas: list = []
        self.tally: Counter = Counter()

    def process(self, element: tuple[str, Iterable]) -> Iterator[Any]:
        started = StageClock.now()
        _, messages = element
        located = sorted(messages, key=lambda lm: lm[0])  # input order decides duplicate_id
        locs_by_id: dict[str, list] = defaultdict(list)
        for loc, msg in located:
            locs_by_id[msg["message_id"]].append(loc)
        result = self.template.conversations_from_table([msg for _, msg in located])
        msgs_by_id = {msg["message_id"]: msg for _, msg in reversed(located)}  # the first of duplicates
        seen_dupes: Counter = Counter()
        for dropped in result.dropped:
            locs = locs_by_id.get(dropped.message_id or "", [])
            if dropped.reason == "duplicate_id":
                seen_dupes[dropped.message_id] += 1
                loc = locs[min(seen_dupes[dropped.message_id], len(locs) - 1)]
            else:
                loc = locs[0] if locs else (0, -1, 0, 0)
            if dropped.reason in OASST1_FILTER_REASONS:
                self.tally[("filtered", dropped.reason)] += 1
                continue
            self.tally[("bad_record", dropped.reason)] += 1
            self.m_bad.inc()
            raw = readers.snippet(msgs_by_id.get(dropped.message_id or ""))
            yield TaggedOutput(TAG_BAD, dead_letter(self.ctx.tasks, loc, dropped.reason, "", dropped.detail, raw,
                                                    message_id=dropped.message_id))
        for conv, mid in result.examples:
            loc = locs_by_id[mid][0]
            meta = self.ctx.tasks[loc[0]]
            self.convs.append(conv)
            self.metas.append((loc, f"{meta.input_index}/oasst1/{mid}"))
        self.tally[("examples",)] += len(result.examples)
        self.clock_template.add(StageClock.now() - started)
        if len(self.convs) >= self.ctx.batch_size:
            yield from self._flush(windowed=False)

    def _flush(self, windowed: bool) -> Iterator[Any]:
        bad: list[DeadLetter] = []
        examples = self._tokenize(self.convs, self.metas, self.tally, bad) if self.convs else []
        self.convs, self.metas = [], []
        wrap = _windowed if windowed else (lambda v: v)
        for batch in examples:
            yield wrap(batch)
        for entry in bad:
            yield TaggedOutput(TAG_BAD, wrap(entry))

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._flush(windowed=True)
        if self.tally:
            yield TaggedOutput(TAG_TALLY, _windowed(self.tally))


# ----------------------------------------------------------------------------- fit and key


class FitAndKeyFn(beam.DoFn):
    """TokenizedBatches -> ((length_key, b), PayloadBatch wire) for the routing GroupByKey.

    Applies the overlong policy for every max length (counting drops by reason and
    writing their dead letters) and builds this bundle's share of the
    (L, length_key, b) histogram the plan is made from. The common case, an example with
    a target that fits every max length, is decided for the whole batch with array
    operations; the others go one by one.
    """

    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    def setup(self) -> None:
        self.m_dropped = {L: Metrics.counter(NAMESPACE, f"L{L}_dropped") for L in self.ctx.max_lengths}
        self.m_truncated = {L: Metrics.counter(NAMESPACE, f"L{L}_truncated") for L in self.ctx.max_lengths}
        self.clock = StageClock("fit")

    def start_bundle(self) -> None:
        # Kept examples wait here until a flush: (batch of kept examples, group code of each).
        self.pending: list[tuple[TokenizedBatch, np.ndarray]] = []
        self.buffered = 0
        self.hist: Counter = Counter()
        # (length_key, b) of examples that fit every max length: expanded into hist at the
        # end of the bundle (one Counter update per group instead of one per example and L).
        self.hist_fits_all: Counter = Counter()
        self.tally: Counter = Counter()

    def process(self, batch: TokenizedBatch) -> Iterator[Any]:
        started = StageClock.now()
        ctx = self.ctx
        buckets = ctx.sub_buckets
        lens = batch.examples.lens.astype(np.int64)
        has_targets = batch.targets_after_first() > 0
        fits_all = has_targets & (lens <= min(ctx.max_lengths))
        length_keys = lens if ctx.pack else np.zeros_like(lens)
        # One int per (length_key, b) group: code = length_key * B + b.
        codes = length_keys * buckets + sub_buckets_of(batch.hashes, buckets)
        groups, counts = np.unique(codes[fits_all], return_counts=True)
        for code, count in zip(groups.tolist(), counts.tolist()):
            self.hist_fits_all[divmod(code, buckets)] += count
        kept = fits_all.copy()
        others = np.flatnonzero(~fits_all).tolist()
        if others:
            yield from self._fit_one_by_one(batch, others, has_targets, codes, kept)
        index = np.flatnonzero(kept)
        if len(index):
            # Only kept examples wait for the flush, so FLUSH_EXAMPLES bounds what a bundle holds.
            if len(index) < len(batch):
                batch = batch.take(index)
            self.pending.append((batch, codes[index]))
            self.buffered += len(index)
        self.clock.add(StageClock.now() - started)
        if self.buffered >= FLUSH_EXAMPLES:
            yield from self._flush(windowed=False)

    def _fit_one_by_one(self, batch: TokenizedBatch, others: list[int], has_targets: np.ndarray,
                        codes: np.ndarray, kept: np.ndarray) -> Iterator[Any]:
        """Examples without a target, or longer than the shortest max length."""
        ctx = self.ctx
        truncate = ctx.overlong is OverlongPolicy.TRUNCATE
        hist, tally = self.hist, self.tally
        lens = batch.examples.lens
        targets_within: dict[int, np.ndarray] = {}  # L -> targets after the first within L tokens
        for i in others:
            n, eid, loc = int(lens[i]), batch.example_ids[i], batch.locs[i]
            if not has_targets[i]:
                tally[("no_targets",)] += 1
                entry = dead_letter(ctx.tasks, loc, "no_targets", "", "no target token after the first, so the example "
                                    "trains nothing", None, example_id=eid, tokens=n)
                for L in ctx.max_lengths:
                    yield TaggedOutput(TAG_DEAD, (L, entry))
                continue
            key, b = divmod(int(codes[i]), ctx.sub_buckets)
            for L in ctx.max_lengths:
                if n <= L:
                    hist[(L, key, b)] += 1
                    kept[i] = True
                    continue
                if truncate:
                    if L not in targets_within:
                        targets_within[L] = batch.targets_after_first(L)
                    if targets_within[L][i] > 0:
                        hist[(L, key, b)] += 1
                        tally[("L", L, "truncated")] += 1
                        self.m_truncated[L].inc()
                        kept[i] = True
                        continue
                reason = DropReason.NO_TARGETS_AFTER_TRUNCATION if truncate else DropReason.TOO_LONG
                tally[("L", L, "dropped", reason.value)] += 1
                self.m_dropped[L].inc()
                message = (f"no target token left after truncating {n} tokens to {L}" if truncate
                           else f"{n} tokens, more than max_length {L}")
                yield TaggedOutput(TAG_DEAD, (L, dead_letter(ctx.tasks, loc, reason.value, "", message, None,
                                                             example_id=eid, tokens=n)))

    def _flush(self, windowed: bool) -> Iterator[Any]:
        wrap = _windowed if windowed else (lambda v: v)
        if self.pending:
            merged = TokenizedBatch.concat([batch for batch, _ in self.pending])
            codes = np.concatenate([c for _, c in self.pending])
            for code, payloads in merged.grouped_payloads(codes):
                yield wrap((divmod(code, self.ctx.sub_buckets), payloads.to_wire()))
        self.pending = []
        self.buffered = 0

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._flush(windowed=True)
        for (key, b), count in self.hist_fits_all.items():
            for L in self.ctx.max_lengths:
                self.hist[(L, key, b)] += count
        yield TaggedOutput(TAG_HIST, _windowed(self.hist))
        yield TaggedOutput(TAG_TALLY, _windowed(self.tally))


# ----------------------------------------------------------------------------- route to rows


class PlanFn(beam.DoFn):
    """The global histogram -> one BFD plan per L.

    Main output: each (length_key, b) group's slice of the plan's slots,
    ((length_key, b), (L, rows, positions)), a multimap side input of RouteToRowsFn that a
    worker reads one group's key at a time (Beam's multimap side inputs are fetched per key
    through the state API), so no worker holds more of the plan than its groups' slots.
    Tagged `plan`: (L, the plan without slots), O(groups), the side input every worker gets.
    """

    def __init__(self, max_lengths: tuple[int, ...], pack: bool, num_shards: int | None, target_shard_mb: float):
        self.max_lengths = max_lengths
        self.pack = pack
        self.num_shards = num_shards
        self.target_shard_mb = target_shard_mb

    def process(self, histogram: dict) -> Iterator[Any]:
        from pipelines.planning import build_plan

        for L in self.max_lengths:
            plan = build_plan(histogram, L, self.pack, self.num_shards, self.target_shard_mb)
            if self.pack:
                for key, rows, positions in plan.group_slices():
                    yield (key, (L, rows.astype("<i4").tobytes(), positions.astype("<i4").tobytes()))
            yield TaggedOutput(TAG_PLAN, (L, plan.without_slots()))


class RouteToRowsFn(beam.DoFn):
    """((length_key, b), example batches) -> ((shard index, window), ShardWork wire).

    Ranks the group's examples by (hash, example_id) and gives the k-th survivor of
    each max length the k-th slot of the group's slice of that L's plan (looked up by the
    group's key in the `slices` multimap side input). Slots in the same
    write window of shards with the same index share one writer, which gets each example's
    tokens once for all of them.
    """

    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    def setup(self) -> None:
        self.m_routed = Metrics.counter(NAMESPACE, "examples_routed")
        self.clock = StageClock("route")

    def start_bundle(self) -> None:
        self.buffers: dict[tuple[int, int], list[ShardWork]] = defaultdict(list)
        self.buffered = 0

    def process(self, element: tuple[tuple[int, int], Iterable[tuple]], plans: dict[int, LengthPlan],
                slices: Any = None) -> Iterator[Any]:
        started = StageClock.now()
        (key, b), wires = element
        mine = {}
        if slices is not None:
            for L, rows, positions in slices[(key, b)]:
                mine[L] = (np.frombuffer(rows, "<i4").astype(np.int64), np.frombuffer(positions, "<i4"))
        self._route(key, b, list(wires), mine, plans)
        self.clock.add(StageClock.now() - started)
        if self.buffered >= FLUSH_EXAMPLES:
            yield from self._flush(windowed=False)

    def _route(self, key: int, b: int, wires: list, slices: dict, plans: dict[int, LengthPlan]) -> None:
        """Buffers the group's examples as ShardWork per (shard, window) target."""
        batch = concat_wire(PayloadBatch, wires)
        order = batch.rank_order()
        examples = batch.examples
        lens = examples.lens[order].astype(np.int64)
        truncate = self.ctx.overlong is OverlongPolicy.TRUNCATE
        slots: dict[tuple[int, int], list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = defaultdict(list)
        for L in self.ctx.max_lengths:
            plan = plans[L]
            keep = lens <= L
            if truncate and not keep.all():
                keep |= examples.targets_after_first(L)[order] > 0  # FitAndKeyFn's rule
            survivors = order[keep]
            if not len(survivors):
                continue
            if plan.pack:
                rows, positions = slices.get(L, (np.zeros(0, np.int64), np.zeros(0, np.int32)))
                if len(rows) != len(survivors):
                    raise ShardCheckError(f"L={L}: group {(key, b)} has {len(survivors)} examples, its plan slice "
                                          f"{len(rows)} slots")
            else:
                rows, positions = plan.route(key, b, len(survivors))
            # (shard, window) of each slot, as one sortable code; a group's slots are split by it.
            codes = (rows % plan.num_shards) << 32 | plan.windows_of(rows)
            by_code = np.argsort(codes, kind="stable")
            unique, starts = np.unique(codes[by_code], return_index=True)
            for code, sel in zip(unique.tolist(), np.split(by_code, starts[1:])):
                slots[(code >> 32, code & 0xFFFFFFFF)].append((L, rows[sel], positions[sel], survivors[sel]))
        for target, parts in slots.items():
            taken = np.concatenate([p[3] for p in parts])
            lengths = np.concatenate([np.full(len(p[1]), p[0], dtype=np.int32) for p in parts])
            unique, local = np.unique(taken, return_inverse=True)
            # Each example travels cut to the longest max length it serves in this window
            # (under --overlong truncate a long document would otherwise cross whole).
            longest = np.zeros(len(unique), dtype=np.int64)
            np.maximum.at(longest, local, lengths)
            self.buffers[target].append(ShardWork(
                lengths,
                np.concatenate([p[1] for p in parts]),
                np.concatenate([p[2] for p in parts]).astype(np.int32),
                local.astype(np.int32),
                examples.take(unique, cut_to=longest),
            ))
            self.buffered += len(taken)
        self.m_routed.inc(len(order))

    def _flush(self, windowed: bool) -> Iterator[Any]:
        wrap = _windowed if windowed else (lambda v: v)
        for target, parts in self.buffers.items():
            yield wrap((target, ShardWork.concat(parts).to_wire()))
        self.buffers = defaultdict(list)
        self.buffered = 0

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._flush(windowed=True)


# ----------------------------------------------------------------------------- counting


class MergeCounters(beam.CombineFn):
    """Sums Counters: tallies and histograms from every bundle into one."""

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
