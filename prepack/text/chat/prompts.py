"""Generation prompts cut from training examples: what `prepack generate` feeds the model.

A model is prompted the way it was trained only if the prompt is the training rendering, id for
id: BOS or not, the role headers, the tools block, the generation prompt (Gemma's
`<start_of_turn>model\\n`, Qwen3's `<|im_start|>assistant\\n` and its empty think block, a jinja
template's own). No second renderer: a prompt is the packed example's ids (what the chat format's
segments give, prepack/text/chat/batch.py) up to the first trained token of a target turn, and
the reference is that turn's trained tokens (its reply, its tool calls and the end-of-turn token
closing it). A target turn is one run of trained tokens: every chat format puts untrained tokens
(the next turn's header, a tool result) between two target turns; an example where two runs meet
cannot be cut into turns and is refused (`turns_not_separable`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from prepack.text.chat.base import ChatFormat
from prepack.text.chat.batch import tokenize_conversations
from prepack.text.conversation import Conversation, Document

if TYPE_CHECKING:
    from prepack.text.tokenizer import Tokenizer

__all__ = ["TurnPrompt", "PromptError", "target_runs", "turn_prompts", "conversation_prompts"]


@dataclass(frozen=True)
class TurnPrompt:
    """One target turn of an example as a generation task.

    turn: the turn's index among the example's target turns (0-based; --expand-turns names its
    examples `<id>#<turn>` the same way); prompt_ids: the example's ids before the turn's first
    trained token; reference_ids: the turn's trained tokens, end-of-turn included."""

    turn: int
    prompt_ids: np.ndarray
    reference_ids: np.ndarray


class PromptError(ValueError):
    """An example that cannot be cut into generation prompts; `reason` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def target_runs(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of trained tokens, in order."""
    mask = np.asarray(loss_mask).astype(bool).astype(np.int8)
    edges = np.diff(np.concatenate([[0], mask, [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def turn_prompts(input_ids: np.ndarray, loss_mask: np.ndarray, target_turns: int, all_turns: bool = False) -> list[TurnPrompt]:
    """The prompts of one packed example holding `target_turns` target turns: its last target
    turn, or every one with `all_turns`."""
    runs = target_runs(loss_mask)
    if len(runs) != target_turns:
        raise PromptError("turns_not_separable",
                          f"the example trains {target_turns} turn{'s' if target_turns != 1 else ''} but its trained tokens "
                          f"form {len(runs)} run{'s' if len(runs) != 1 else ''}: the chat format writes nothing untrained "
                          "between two target turns, so no turn's prompt can be cut from it")
    ids = np.asarray(input_ids)
    chosen = range(len(runs)) if all_turns else range(len(runs) - 1, len(runs))
    return [TurnPrompt(k, ids[:runs[k][0]].copy(), ids[runs[k][0]:runs[k][1]].copy()) for k in chosen]


def conversation_prompts(example: Conversation, tokenizer: "Tokenizer", chat_format: ChatFormat | str,
                         all_turns: bool = False) -> list[TurnPrompt]:
    """turn_prompts of one conversation, laid out by `chat_format` as `prepack pack` lays it out."""
    if isinstance(example, Document):
        raise PromptError("no_turns", "a plain text (format text) has no assistant turn to prompt for")
    (tokenized,) = tokenize_conversations([example], tokenizer, chat_format)
    return turn_prompts(tokenized.input_ids, tokenized.loss_mask, len(example.loss_turns), all_turns)  # type: ignore[arg-type]
