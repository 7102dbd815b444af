"""The prepare stage's work without Beam: raw records -> decoded, parsed, templated and
tokenized examples (TokenizedBatch), with a dead letter and a tally entry for every bad record.
`Preparer` is what the prepare stage's DoFns (pipelines/stages/prepare.py) wrap with counters
and clocks, and what `prepack preflight` runs in its process, so an estimate reads and
tokenizes exactly as the job does, with no Beam imported.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pipelines.inputs import readers
from pipelines.wire.columns import IDS, LENS, MASK, Ragged, TokenizedBatch
from pipelines.planning import stable_hash
from pipelines.wire.records import DeadLetter, Loc, TaskMeta, dead_letter, example_id
from prepack.packing.accounting import Tally

if TYPE_CHECKING:  # for the annotation only: from_names loads the formats when it builds one
    from prepack.text.formats import Template

# oasst1 messages dropped for these reasons are a property of the data set (other
# languages, failed review, deleted threads), not bad input: counted, not failed on.
OASST1_FILTER_REASONS = frozenset({"deleted", "not_english", "review_failed", "orphaned", "assistant_root"})


@dataclasses.dataclass
class Templated:
    """A batch of examples after the template, before the tokenizer. On the single-turn fast
    path `convs` holds the prompts and `responses` the responses; otherwise Conversations."""

    convs: list = dataclasses.field(default_factory=list)
    responses: list[str] = dataclasses.field(default_factory=list)
    metas: list[tuple[Loc, str]] = dataclasses.field(default_factory=list)  # (loc, example_id)

    def __len__(self) -> int:
        return len(self.metas)

    def items(self) -> Iterator[tuple[Any, str | None, tuple[Loc, str]]]:
        responses = self.responses or [None] * len(self.metas)
        return zip(self.convs, responses, self.metas)

    @classmethod
    def of(cls, items: Sequence[tuple[Any, str | None, tuple[Loc, str]]]) -> "Templated":
        out = cls()
        for conv, response, meta in items:
            out.convs.append(conv)
            if response is not None:
                out.responses.append(response)
            out.metas.append(meta)
        return out


def key_table_records(tasks: Sequence[TaskMeta], task_index: int, items: list, group_key: str, tally: Tally,
                      bad: list[DeadLetter]) -> list[tuple[str, tuple[Loc, dict]]]:
    """(tree id, (loc, message)) for every valid message of a batch of raw records."""
    tally.records_read += len(items)
    keyed = []
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
            tally.bad_records[error[0]] += 1
            raw = payload[2] if kind == readers.RAW_ERROR else readers.snippet(payload if record is None else record)
            bad.append(dead_letter(tasks, loc, error[0], "", error[1], raw))
            continue
        group = record.get(group_key)
        keyed.append((group if isinstance(group, str) else "", (loc, record)))
    return keyed


class Preparer:
    """The prepare stage for one template, tokenizer and chat format, without Beam.

    Contract: every raw record read becomes either examples (one per conversation the template
    yields) or exactly one dead letter with its reason, counted in the Tally's bad_records
    (record-level) or bad_examples (the chat format refused a conversation); oasst1 messages
    left out by design count in its `filtered`. Example ids
    and hashes depend on the record's source only, so any split of the work gives the same
    examples. `on_batch` sees every TokenizedBatch made (the DoFns count it).
    """

    def __init__(self, tasks: Sequence[TaskMeta], template: Template, tokenizer: Any, chat_format: Any,
                 on_batch: Callable[[TokenizedBatch], None] | None = None, expand_turns: bool = False):
        self.tasks = tasks
        self.template = template
        self.tokenizer = tokenizer
        self.format = chat_format
        self.on_batch = on_batch
        # --expand-turns: one example per target reply, ids <id>#<i> (prepack.text.conversation.expand_turns)
        self.expand_turns = expand_turns
        # Single-turn templates under a format with a fixed layout skip the Conversation
        # objects: (prompt, response) texts go straight to tokenize_prompt_responses_flat.
        self.read_prompt_response = template.prompt_response_reader()
        self.prompt_response_fast = self.read_prompt_response is not None and chat_format.prompt_response_layout() is not None
        # A preference format yields PreferencePairs, each tokenized as one example of two sides.
        self.preference = template.yields_preference
        from prepack.text.stop_check import StopTokenCheck

        self.stop_check = StopTokenCheck.for_format(chat_format)

    @classmethod
    def from_names(cls, tasks: Sequence[TaskMeta], template: str, template_options: Iterable[tuple[str, str]],
                   tokenizer: str, chat_format: str, train_reasoning: bool = True, expand_turns: bool = False,
                   **kwargs: Any) -> "Preparer":
        from prepack.text.chat import get_chat_format
        from prepack.text.formats import ResolvedFormat
        from prepack.text.tokenizer import load_tokenizer

        loaded = load_tokenizer(tokenizer)
        return cls(tasks, ResolvedFormat(template, tuple(template_options)).build(), loaded,
                   get_chat_format(chat_format, loaded, train_reasoning), expand_turns=expand_turns, **kwargs)

    # ------------------------------------------------------------------ per-record formats

    def template_records(self, task_index: int, items: list, tally: Tally, bad: list[DeadLetter]) -> Templated:
        """Decodes, parses and templates a batch of raw records of one task."""
        from prepack.text.conversation import RecordError

        meta = self.tasks[task_index]
        out = Templated()
        fast = self.prompt_response_fast
        to_conversations = self.read_prompt_response if fast else self.template.to_conversations
        for record_index, line, kind, payload in items:
            loc = (task_index, record_index, line, 0)
            if kind == readers.RAW_TEXT:
                record, error = readers.parse_text(payload)
                if error is not None:
                    tally.bad_records[error[0]] += 1
                    bad.append(dead_letter(self.tasks, loc, error[0], "", error[1], readers.snippet(payload)))
                    continue
            elif kind == readers.RAW_ERROR:
                reason, message, raw = payload
                tally.bad_records[reason] += 1
                bad.append(dead_letter(self.tasks, loc, reason, "", message, raw))
                continue
            else:
                record = payload
            try:
                conversations = to_conversations(record)
            except RecordError as e:
                tally.bad_records[e.reason] += 1
                bad.append(dead_letter(self.tasks, loc, e.reason, e.field, e.message, readers.snippet(record)))
                continue
            except RecursionError:  # a record nested too deeply for the template: its problem, not the job's
                tally[("bad_record", "too_deeply_nested")] += 1
                bad.append(dead_letter(self.tasks, loc, "too_deeply_nested", "", "record nested too deeply to read",
                                       readers.snippet(payload if kind == readers.RAW_TEXT else "")))
                continue
            if fast:
                out.convs.append(conversations[0])
                out.responses.append(conversations[1])
                out.metas.append((loc, example_id(meta, record_index) + ("#0" if self.expand_turns else "")))
                continue
            for sub, conv in enumerate(conversations):
                if self.expand_turns:
                    self._add_expanded(out, conv, (task_index, record_index, line, sub), example_id(meta, record_index, sub))
                    continue
                out.convs.append(conv)
                out.metas.append(((task_index, record_index, line, sub), example_id(meta, record_index, sub)))
        tally.records_read += len(items)
        tally.examples += len(out)
        return out

    def tokenize(self, templated: Templated, tally: Tally, bad: list[DeadLetter]) -> list[TokenizedBatch]:
        if self.prompt_response_fast:
            out = self._tokenize_prompt_responses(templated.convs, templated.responses, templated.metas, tally, bad)
        else:
            out = self._tokenize(templated.convs, templated.metas, tally, bad)
        for batch in out:  # the stop-token check (prepack/text/stop_check.py), on every example made
            found = self.stop_check.findings(batch.examples.lens, batch.examples.ids, batch.examples.mask)
            tally.add_stop_findings(found.turns_without_trained_eot, found.trained_empty_think, batch.example_ids)
        return out

    # ------------------------------------------------------------------ table-level formats (oasst1): see also key_table_records

    def template_table(self, messages: Iterable[tuple[Loc, dict]], tally: Tally, bad: list[DeadLetter]) -> Templated:
        """One tree's messages -> its conversations."""
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
                tally.filtered[dropped.reason] += 1
                continue
            tally.bad_records[dropped.reason] += 1
            raw = readers.snippet(msgs_by_id.get(dropped.message_id or ""))
            bad.append(dead_letter(self.tasks, loc, dropped.reason, "", dropped.detail, raw, message_id=dropped.message_id))
        out = Templated()
        for conv, mid in result.examples:
            loc = locs_by_id[mid][0]
            meta = self.tasks[loc[0]]
            if self.expand_turns:
                self._add_expanded(out, conv, loc, f"{meta.input_index}/oasst1/{mid}")
                continue
            out.convs.append(conv)
            out.metas.append((loc, f"{meta.input_index}/oasst1/{mid}"))
        tally.examples += len(out)
        return out

    @staticmethod
    def _add_expanded(out: Templated, conv: Any, loc: Loc, eid: str) -> None:
        from prepack.text.conversation import expand_turns

        for i, part in enumerate(expand_turns(conv)):
            out.convs.append(part)
            out.metas.append((loc, f"{eid}#{i}"))

    # ------------------------------------------------------------------ tokenizing

    def _tokenize(self, convs: list, metas: list[tuple[Loc, str]], tally: Tally, bad: list[DeadLetter]) -> list[TokenizedBatch]:
        """Examples for convs (metas[i] = (loc, example_id)); a conversation the chat format
        rejects becomes a dead letter and the rest of the batch goes on."""
        from prepack.text.chat import ChatFormatError

        encode = self._encode
        out: list[TokenizedBatch] = []
        start = 0
        while start < len(convs):
            try:
                tokenized = encode(convs[start:])
            except TEXT_ERRORS as e:
                bad_at = start + _first_unencodable(convs[start:], encode, e)
                if bad_at > start:
                    self._emit(encode(convs[start:bad_at]), metas[start:bad_at], out)
                self._bad_text(metas[bad_at], e, tally, bad)
                start = bad_at + 1
                continue
            except ChatFormatError as e:
                if e.index is None:
                    raise
                bad_at = start + e.index
                if e.index:
                    tokenized = encode(convs[start:bad_at])
                    self._emit(tokenized, metas[start:bad_at], out)
                loc, eid = metas[bad_at]
                tally.bad_examples[e.reason] += 1
                bad.append(dead_letter(self.tasks, loc, e.reason, "", e.message, example_id=eid))
                start = bad_at + 1
                continue
            self._emit(tokenized, metas[start:], out)
            break
        return out

    def _tokenize_prompt_responses(self, prompts: list[str], responses: list[str], metas: list[tuple[Loc, str]], tally: Tally,
                        bad: list[DeadLetter]) -> list[TokenizedBatch]:
        """Examples for single-turn (prompt, response) texts; a fixed layout has no per-conversation errors, but the
        tokenizer may refuse a text (bad_text)."""
        from prepack.text.chat import tokenize_prompt_responses_flat

        out: list[TokenizedBatch] = []
        texts = list(zip(prompts, responses))

        def encode(items: list) -> tuple | None:
            return tokenize_prompt_responses_flat([p for p, _ in items], [r for _, r in items], self.tokenizer, self.format)

        start = 0
        while start < len(texts):
            try:
                self._emit(encode(texts[start:]), metas[start:], out)
                break
            except TEXT_ERRORS as e:
                bad_at = start + _first_unencodable(texts[start:], encode, e)
                if bad_at > start:
                    self._emit(encode(texts[start:bad_at]), metas[start:bad_at], out)
                self._bad_text(metas[bad_at], e, tally, bad)
                start = bad_at + 1
        return out

    def _bad_text(self, meta: tuple[Loc, str], error: Exception, tally: Tally, bad: list[DeadLetter]) -> None:
        loc, eid = meta
        tally.bad_examples["bad_text"] += 1
        bad.append(dead_letter(self.tasks, loc, "bad_text", "", f"the tokenizer cannot encode this text "
                               f"({type(error).__name__}: {error})", example_id=eid))

    def _encode(self, examples: list) -> tuple | None:
        """A batch of examples through the chat format: (input_ids, loss_mask, ends), and a
        preference set's pair bounds after them (prepack/packing/pairs.py)."""
        from prepack.text.chat import tokenize_conversations_flat, tokenize_preference_pairs

        if self.preference:
            return tokenize_preference_pairs(examples, self.tokenizer, self.format)
        return tokenize_conversations_flat(examples, self.tokenizer, self.format)

    def _emit(self, tokenized: tuple | None, metas: list[tuple[Loc, str]], out: list[TokenizedBatch]) -> None:
        """tokenized: (input_ids, loss_mask, ends[, pair bounds]) of a batch, from _encode or
        tokenize_prompt_responses_flat; appends one TokenizedBatch to `out`."""
        if tokenized is None:
            return
        input_ids, loss_mask, ends = tokenized[:3]
        pair_bounds = tokenized[3] if len(tokenized) > 3 else None
        if not ends:
            return
        lens = np.diff(np.asarray(ends, dtype=np.int64), prepend=0)
        eids = [eid for _, eid in metas]
        hashes = np.fromiter(map(stable_hash, eids), dtype=np.uint64, count=len(eids))
        batch = TokenizedBatch(hashes, eids, [loc for loc, _ in metas],
                               Ragged(lens.astype(LENS), np.asarray(input_ids, IDS), np.asarray(loss_mask, MASK), pair_bounds))
        out.append(batch)
        if self.on_batch is not None:
            self.on_batch(batch)


# What tokenizers raise on a text they cannot encode (sentencepiece: TypeError for a lone
# surrogate). Caught around a batch only: the batch is then retried example by example.
TEXT_ERRORS = (TypeError, UnicodeError)


def _first_unencodable(items: list, encode: Callable[[list], Any], error: Exception) -> int:
    """The index of the first item that fails to encode alone; re-raises `error` when each
    encodes alone (the batch failed for another reason, not one record's text)."""
    for i, item in enumerate(items):
        try:
            encode([item])
        except TEXT_ERRORS:
            return i
    raise error
