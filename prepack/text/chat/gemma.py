"""Chat format `gemma`: Gemma's own chat template, laid out by id."""
from __future__ import annotations

from typing import TYPE_CHECKING

from prepack.text.chat.base import ChatFormat, ChatFormatError, PromptResponseLayout, Segment
from prepack.text.conversation import Conversation

if TYPE_CHECKING:
    from prepack.text.tokenizer import Tokenizer

__all__ = ["GemmaFormat"]


class GemmaFormat(ChatFormat):
    """<bos><start_of_turn>user\\n{user}<end_of_turn>\\n<start_of_turn>model\\n{reply}<end_of_turn>\\n...

    Mirrors Gemma's official chat template: BOS once at the start; a leading system turn is
    prepended to the first user turn followed by "\\n\\n"; user and assistant content is
    trimmed (the official template applies `| trim`), the system text is not. Gemma 3 has no
    tool tokens: a conversation with tools, tool calls or tool results is refused
    (`tools_not_supported`), pointing at `--chat-format hf` with the model's own tokenizer.
    """

    name = "gemma"

    def __init__(self, tokenizer: "Tokenizer") -> None:
        super().__init__(tokenizer)
        # Turn markers first: a missing one says "wrong tokenizer for this format" most clearly.
        self.sot = self._special("<start_of_turn>")
        self.eot = self._special("<end_of_turn>")
        if tokenizer.bos_id is None:
            raise ChatFormatError("no_bos", f"chat format 'gemma' needs a BOS token, but tokenizer {getattr(tokenizer, 'name', '?')!r} has none")
        self.bos = int(tokenizer.bos_id)
        nl = self._const("\n")
        model_hdr = self._const("model\n")
        eot_nl = (self.eot, *nl)
        # Literal ids that open a turn, by what came before: start of the example (BOS),
        # a closed turn (<end_of_turn>\n), or a closed *target* turn whose <end_of_turn> was
        # already emitted with loss 1 (so only "\n" remains, with loss 0).
        self._open_user = {"start": (self.bos, self.sot), "closed": (*eot_nl, self.sot), "target": (*nl, self.sot)}
        self._open_model = {k: v + model_hdr for k, v in self._open_user.items()}
        self._close = {"start": (), "closed": eot_nl, "target": nl}
        self._eot_only = (self.eot,)

    def prompt_response_layout(self) -> "PromptResponseLayout":
        return PromptResponseLayout(self._open_user["start"], "user\n", self._open_model["closed"], self._eot_only,
                          self._close["target"], strip=True)

    def segments(self, conv: Conversation) -> list[Segment]:
        self._refuse_reasoning(conv)
        if conv.has_tools:
            raise ChatFormatError(
                "tools_not_supported",
                "the conversation has tools, tool calls or tool results, and chat format 'gemma' has no markup for them "
                "(Gemma 3 has no tool tokens); use --chat-format hf with the model's own tokenizer and its template "
                "(e.g. FunctionGemma's: --tokenizer hf:google/functiongemma-270m-it)")
        turns = conv.turns
        loss = conv.loss_turns
        segs: list[Segment] = []
        append = segs.append
        state = "start"
        prefix = ""
        first = 0
        if turns and turns[0].role == "system":
            prefix = turns[0].content + "\n\n"
            first = 1
        for i in range(first, len(turns)):
            turn = turns[i]
            role = turn.role
            if role == "user":
                append((self._open_user[state], 0))
                append(("user\n" + prefix + turn.content.strip(), 0))
                prefix = ""
                state = "closed"
            elif role == "assistant":
                if prefix:
                    raise ChatFormatError("system_without_user", "gemma: the system turn must be followed by a user turn (it is prepended to it)")
                append((self._open_model[state], 0))
                if i in loss:
                    append((turn.content.strip(), 1))
                    append((self._eot_only, 1))
                    state = "target"
                else:
                    append((turn.content.strip(), 0))
                    state = "closed"
            else:
                raise ChatFormatError("system_not_first", f"gemma: a system turn is only supported as the first turn, found at turn {i}")
        if prefix:
            raise ChatFormatError("system_without_user", "gemma: the system turn must be followed by a user turn (it is prepended to it)")
        append((self._close[state], 0))
        return segs
