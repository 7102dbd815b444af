"""Chat format `qwen3`: ChatML as Qwen3's own chat template renders it for non-thinking SFT."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from prepack.text.chat.base import PromptResponseLayout, Segment
from prepack.text.chat.chatml import ChatMLFormat, last_query
from prepack.text.conversation import Conversation

if TYPE_CHECKING:
    from prepack.text.tokenizer import Tokenizer

__all__ = ["Qwen3Format"]


class Qwen3Format(ChatMLFormat):
    """ChatML as Qwen3's own chat template renders it for non-thinking SFT.

    Qwen3's template (Qwen/Qwen3-0.6B tokenizer_config.json) writes an assistant turn that
    comes after the last user query and is the last message as
    `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n` + content.lstrip("\\n"), and every
    earlier assistant turn without a think block (it drops reasoning from history). With
    enable_thinking=False its generation prompt is exactly `<|im_start|>assistant\\n` followed
    by that empty think block, so the block is prompt (loss 0) here: the model never learns to
    emit it, only the reply and <|im_end|>. <think> and </think> go in by id, so a reply that
    spells them stays plain text (the template would split such a reply into reasoning; here
    content is never reinterpreted). The last query is the last user turn that is not a
    `<tool_response>` block (the template's multi-step rule); tool results are not queries.
    Tools, calls and results as in `chatml` (prepack/text/chat/chatml.py).
    """

    name = "qwen3"

    def __init__(self, tokenizer: "Tokenizer", train_reasoning: bool = True) -> None:
        super().__init__(tokenizer)
        think, end_think = self._special("<think>"), self._special("</think>")
        self.think, self.end_think, self.train_reasoning = think, end_think, train_reasoning
        nl2 = self._const("\n\n")
        self._nl2 = nl2
        block = (think, *nl2, end_think, *nl2)
        self._open_think = {k: v + block for k, v in self._open_asst.items()}

    def _think_turn(self, turns: Sequence[Any]) -> int:
        last = len(turns) - 1
        if last < 0 or turns[last].role != "assistant":
            return -1
        # After the last query: the last message itself when there is none (no think block).
        return last if last_query(turns) < last else -1

    def prompt_response_layout(self) -> "PromptResponseLayout":
        return PromptResponseLayout(self._open["start"], "user\n", self._open_think["closed"], self._ime_only,
                          self._close["target"], strip=False, response_lstrip="\n")

    # -- reasoning traces: as Qwen3's template writes an assistant message with reasoning_content:
    # after the last query, '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' +
    # content.lstrip('\n'); before it (history), the content alone: the trace is dropped.

    def _reasoning_segments(self, conv: Conversation, i: int, state: str, target: bool, segs: list[Segment]) -> str:
        turn = conv.turns[i]
        segs.append((self._open_asst[state], 0))
        if i <= last_query(conv.turns):
            return turn.content
        trained = int(target and self.train_reasoning)
        segs.append(((self.think,), trained))
        segs.append(("\n" + turn.reasoning.strip("\n") + "\n", trained))  # type: ignore[union-attr]
        segs.append(((self.end_think,), trained))
        content = turn.content.lstrip("\n")
        if trained:
            # The model writes the block and the reply in one go: "\n\n" + reply is one text, as
            # the tokenizer sees the rendered string. Returned as the target piece.
            return "\n\n" + content
        segs.append((self._nl2, 0))
        return content
