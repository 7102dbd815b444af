"""From a format's examples to scored completions: what `prepack generate` and `prepack train
--eval-generate` share.

`example_prompts` is their one path from records to prompts: the examples a source format makes
of the records (pipelines/preparer.py's Preparer, as `prepack pack` makes them) are tokenized as
pack tokenizes them, and `prompt_items` cuts each packed example into generation tasks (prepack/text/chat/prompts.py:
the ids up to a target turn's first trained token, the turn's trained tokens as the reference)
with the calls the record's reply makes; `run_items` generates every prompt (train/generation/generate.py),
decodes completion and reference with the chat format, and with `score` adds each line's score
(train/generation/score.py) and the reference NLL. A line of the generations JSONL:

    {"id", "prompt_tokens", "completion", "completion_tokens", "reference", "stop_reason"[, "score"]}

in input order, without timings: a greedy rerun writes the same bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from prepack.text.chat import tool_calls
from prepack.text.chat.prompts import turn_prompts
from prepack.text.conversation import Conversation
from train.generation import score as score_lib

__all__ = ["PromptItem", "example_prompts", "prompt_items", "run_items", "jsonl_bytes"]

EXAMPLES_PER_BATCH = 512  # examples tokenized together, as `prepack preflight` reads them


@dataclasses.dataclass(frozen=True)
class PromptItem:
    id: str
    prompt_ids: np.ndarray
    reference_ids: np.ndarray
    reference_calls: tuple[tool_calls.Call, ...] = ()


def prompt_items(example_id: str, input_ids: np.ndarray, loss_mask: np.ndarray, conversation: Any,
                 all_turns: bool = False, expanded: bool = False) -> list[PromptItem]:
    """The generation tasks of one packed example. `conversation` is the example's Conversation,
    or None for a single-turn pair (prepack/text/chat/batch.py's fast path: one turn, no calls).
    Ids: the example's own; with `all_turns`, `<id>#<k>` for its k-th target turn, as
    `--expand-turns` names the examples it makes (`expanded`: the ids already are)."""
    if isinstance(conversation, Conversation):
        loss_turns = conversation.loss_turns or ()
        calls = [tool_calls.reference_calls(conversation.turns[i].tool_calls) for i in loss_turns]
    else:
        calls = [()]
    prompts = turn_prompts(input_ids, loss_mask, len(calls), all_turns)
    suffix = all_turns and not expanded
    return [PromptItem(f"{example_id}#{p.turn}" if suffix else example_id, p.prompt_ids, p.reference_ids, calls[p.turn])
            for p in prompts]


def example_prompts(preparer: Any, examples: Iterable[tuple[Any, str | None, tuple[Any, str]]], tally: Any,
                    bad: list[Any], all_turns: bool = False) -> tuple[list[PromptItem], bool]:
    """The generation prompts of a format's examples, in input order, and whether any example
    has tools. `examples`: what the Preparer's template_records or template_table yield (conv,
    response, (loc, example id)); they are tokenized by the same Preparer, as the job tokenizes
    them, and each cut at its last target turn (each, with `all_turns`). An example the chat
    format, the cut or left padding refuses is a dead letter in `bad`, counted in the Tally's
    bad_examples, as pack counts its bad examples."""
    from pipelines.preparer import Templated

    items: list[PromptItem] = []
    has_tools = False
    examples = iter(examples)
    while chunk := list(itertools.islice(examples, EXAMPLES_PER_BATCH)):
        conversations = {eid: (conv, loc) for conv, _, (loc, eid) in chunk}
        for batch in preparer.tokenize(Templated.of(chunk), tally, bad):
            starts = np.concatenate([[0], np.cumsum(batch.examples.lens)])
            for k, eid in enumerate(batch.example_ids):
                conv, loc = conversations[eid]
                span = slice(int(starts[k]), int(starts[k + 1]))
                made = _cut_example(preparer, eid, loc, batch.examples.ids[span], batch.examples.mask[span], conv,
                                    all_turns, tally, bad)
                items += made
                has_tools = has_tools or bool(made and isinstance(conv, Conversation) and conv.has_tools)
    return items, has_tools


def _cut_example(preparer: Any, eid: str, loc: Any, ids: np.ndarray, mask: np.ndarray, conv: Any, all_turns: bool,
                 tally: Any, bad: list[Any]) -> list[PromptItem]:
    """The prompts of one tokenized example, or [] and its dead letter (counted as a bad example)."""
    from pipelines.wire.records import dead_letter
    from prepack.text.chat.prompts import PromptError

    pad_id = preparer.tokenizer.pad_id
    try:
        made = prompt_items(eid, ids, mask, conv if isinstance(conv, Conversation) else None, all_turns,
                            preparer.expand_turns)
        if any(np.any(item.prompt_ids == pad_id) for item in made):
            raise PromptError("pad_in_prompt", f"the prompt holds the pad id {pad_id}, which left-padded "
                                               "generation cannot tell from padding")
    except PromptError as e:
        tally.bad_examples[e.reason] += 1
        bad.append(dead_letter(preparer.tasks, loc, e.reason, "", e.message, example_id=eid))
        return []
    return made


def _body(ids: np.ndarray, stop_ids: frozenset[int]) -> np.ndarray:
    """A reference's tokens without the end-of-turn token that closes it (what generation stops at)."""
    return ids[:-1] if len(ids) and int(ids[-1]) in stop_ids else ids


def run_items(items: Sequence[PromptItem], generator: Any, chat_format: Any, *, score: bool = False,
              parser: str | None = None, nll: Callable[[Sequence[tuple[np.ndarray, np.ndarray]]], list[tuple[float, int]]] | None = None,
              progress: Callable[[int, int, float], None] | None = None) -> list[dict[str, Any]]:
    """One JSONL line (a dict) per item, in the items' order. With `score`: each line's `score`
    (exact match, reference NLL through `nll`, calls through `parser` unless it is None)."""
    stop_ids = frozenset(generator.stop_ids)
    completions = generator.generate([item.prompt_ids for item in items], progress)
    parse = tool_calls.get_parser(parser) if score and parser else None
    nlls = nll([(item.prompt_ids, item.reference_ids) for item in items]) if score and nll is not None else None
    lines = []
    for k, (item, completion) in enumerate(zip(items, completions)):
        text = chat_format.decode(completion.tokens)
        reference = chat_format.decode(_body(item.reference_ids, stop_ids))
        line: dict[str, Any] = {
            "id": item.id,
            "prompt_tokens": int(len(item.prompt_ids)),
            "completion": text,
            "completion_tokens": int(len(completion.tokens)),
            "reference": reference,
            "stop_reason": completion.stop_reason,
        }
        if score:
            calls = score_lib.score_calls(item.reference_calls, parse(text)) if parse is not None else None
            nll_sum, tokens = nlls[k] if nlls is not None else (None, len(item.reference_ids))
            line["score"] = score_lib.record_score(text, reference, nll_sum, tokens, calls, parser if calls is not None else None)
        lines.append(line)
    return lines


def jsonl_bytes(lines: Sequence[dict[str, Any]]) -> bytes:
    """The generations file: one JSON object per line, keys in the order written, non-ASCII kept."""
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode("utf-8")
