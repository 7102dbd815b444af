"""Prepare stage: raw records -> decoded, parsed, templated and tokenized examples
(TokenizedBatch), with a dead letter and a tally entry for every bad record.
Table-level formats (oasst1) key their messages by tree first and template whole trees.

The work itself is `Preparer` (pipelines/preparer.py, no Beam): the DoFns here wrap it with
counters and clocks, and `prepack preflight` runs it in its process.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics.metric import Metrics
from apache_beam.pvalue import TaggedOutput

from pipelines.preparer import Preparer, Templated, key_table_records
from pipelines.wire.columns import TokenizedBatch
from pipelines.wire.records import DeadLetter
from prepack.packing.accounting import Tally
from pipelines.stage_shared import NAMESPACE, TAG_BAD, TAG_TALLY, JobContext, Progress, StageClock, in_global_window

class _Counting:
    """Loads the Preparer once per worker and counts what it tokenizes as Beam metrics."""

    ctx: JobContext

    def _setup_preparer(self) -> None:
        from prepack.text.chat import get_chat_format
        from prepack.text.tokenizer import load_tokenizer

        ctx = self.ctx
        loaded = load_tokenizer(ctx.rows.tokenizer)
        chat_format = get_chat_format(ctx.rows.chat_format, loaded, ctx.rows.train_reasoning)
        # One tokenizer and chat format; each source with its own format, as the launcher resolved
        # it (a plain run has one).
        self.preparers = {index: Preparer(ctx.tasks, fmt.build(), loaded, chat_format,
                                          on_batch=self._count_batch, expand_turns=ctx.rows.expand_turns)
                          for index, fmt in enumerate(ctx.formats, start=1)}
        self.preparer = self.preparers[1]
        self.m_examples = Metrics.counter(NAMESPACE, "examples_tokenized")
        self.m_tokens = Metrics.counter(NAMESPACE, "tokens_tokenized")
        self.m_lengths = Metrics.distribution(NAMESPACE, "example_tokens")
        self.m_bad = Metrics.counter(NAMESPACE, "bad_records")
        self.clock_template = StageClock("template")
        self.clock_tokenize = StageClock("tokenize")

    def _count_batch(self, batch: TokenizedBatch) -> None:
        lens = batch.examples.lens
        update_length = self.m_lengths.update
        for n in lens.tolist():
            update_length(n)
        self.m_examples.inc(len(lens))
        self.m_tokens.inc(int(lens.sum()))
        if self.ctx.config.run.progress:
            Progress.add("tokenized", "examples", len(lens))

    def _tokenize(self, templated: Templated, tally: Tally, bad: list[DeadLetter],
                  preparer: "Preparer | None" = None) -> list[TokenizedBatch]:
        started = StageClock.now()
        before = len(bad)
        out = (preparer or self.preparer).tokenize(templated, tally, bad)
        self.m_bad.inc(len(bad) - before)
        self.clock_tokenize.add(StageClock.now() - started)
        return out


class PrepareFn(beam.DoFn, _Counting):
    """(task_index, raw records) -> TokenizedBatches (one per stretch of the batch between
    conversations the chat format rejects, usually one); tagged: dead letters, tallies.

    Decodes, parses and templates each record, then tokenizes the whole batch at once
    (Preparer.template_records, Preparer.tokenize).
    """

    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    def setup(self) -> None:
        self._setup_preparer()

    def process(self, element: tuple[int, list]) -> Iterator[Any]:
        started = StageClock.now()
        task_index, items = element
        tally = Tally()
        bad: list[DeadLetter] = []
        source = self.ctx.task_sources[task_index]
        preparer = self.preparers[source]
        templated = preparer.template_records(task_index, items, tally, bad)
        self.m_bad.inc(len(bad))
        self.clock_template.add(StageClock.now() - started)
        yield from self._tokenize(templated, tally, bad, preparer)
        for entry in bad:
            yield TaggedOutput(TAG_BAD, entry)
        yield TaggedOutput(TAG_TALLY, tally.for_source(source) if self.ctx.mixture.recorded else tally)


class KeyTableRecordsFn(beam.DoFn):
    """Table-level formats (oasst1): (task_index, raw records) -> (tree id, (loc, message));
    tagged: a dead letter per record that is not a message object with a message_id, tallies."""

    def __init__(self, ctx: JobContext, group_key: str):
        self.ctx = ctx
        self.group_key = group_key

    def process(self, element: tuple[int, list]) -> Iterator[Any]:
        task_index, items = element
        tally = Tally()
        bad: list[DeadLetter] = []
        keyed = key_table_records(self.ctx.tasks, task_index, items, self.group_key, tally, bad)
        for entry in bad:
            yield TaggedOutput(TAG_BAD, entry)
        yield from keyed
        yield TaggedOutput(TAG_TALLY, tally)


class TableToExamplesFn(beam.DoFn, _Counting):
    """(tree id, messages) -> TokenizedBatches; tagged: dead letters, tallies. Conversations
    are buffered across trees and tokenized `batch_size` at a time; the bundle's rest is
    flushed at its end."""

    def __init__(self, ctx: JobContext):
        self.ctx = ctx

    def setup(self) -> None:
        self._setup_preparer()

    def start_bundle(self) -> None:
        self.pending = Templated()
        self.tally = Tally()

    def process(self, element: tuple[str, Iterable]) -> Iterator[Any]:
        started = StageClock.now()
        _, messages = element
        bad: list[DeadLetter] = []
        templated = self.preparer.template_table(messages, self.tally, bad)
        self.m_bad.inc(len(bad))
        for entry in bad:
            yield TaggedOutput(TAG_BAD, entry)
        self.pending.convs += templated.convs
        self.pending.metas += templated.metas
        self.clock_template.add(StageClock.now() - started)
        if len(self.pending) >= self.ctx.config.run.batch_size:
            yield from self._flush(windowed=False)

    def _flush(self, windowed: bool) -> Iterator[Any]:
        bad: list[DeadLetter] = []
        examples = self._tokenize(self.pending, self.tally, bad) if len(self.pending) else []
        self.pending = Templated()
        wrap = in_global_window if windowed else (lambda v: v)
        for batch in examples:
            yield wrap(batch)
        for entry in bad:
            yield TaggedOutput(TAG_BAD, wrap(entry))

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._flush(windowed=True)
        if self.tally:
            yield TaggedOutput(TAG_TALLY, in_global_window(self.tally))


class PrepareExamples(beam.PTransform):
    """The prepare stage as one transform: batches of raw records -> {"examples":
    TokenizedBatches, "bad": dead letters of bad records, "tally": per-bundle Tallies}.
    A table-level template (oasst1) first groups each table's records by its key."""

    def __init__(self, ctx: JobContext, table_level: bool, group_key: str | None):
        super().__init__()
        self.ctx, self.table_level, self.group_key = ctx, table_level, group_key

    def expand(self, records: Any) -> dict[str, Any]:
        if not self.table_level:
            prepared = records | "TemplateTokenize" >> beam.ParDo(PrepareFn(self.ctx)).with_outputs(
                TAG_BAD, TAG_TALLY, main="examples")
            return {"examples": prepared.examples, "bad": prepared[TAG_BAD], "tally": prepared[TAG_TALLY]}
        keyed = records | "KeyByTable" >> beam.ParDo(KeyTableRecordsFn(self.ctx, self.group_key)).with_outputs(
            TAG_BAD, TAG_TALLY, main="messages")
        prepared = (
            keyed.messages
            | "GroupTables" >> beam.GroupByKey()
            | "TemplateTokenize" >> beam.ParDo(TableToExamplesFn(self.ctx)).with_outputs(TAG_BAD, TAG_TALLY, main="examples")
        )
        return {
            "examples": prepared.examples,
            "bad": (keyed[TAG_BAD], prepared[TAG_BAD]) | "FlattenBad" >> beam.Flatten(),
            "tally": (keyed[TAG_TALLY], prepared[TAG_TALLY]) | "FlattenTally" >> beam.Flatten(),
        }
