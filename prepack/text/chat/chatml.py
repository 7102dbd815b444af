"""Chat format `chatml`: <|im_start|>{role}\\n{content}<|im_end|>\\n per turn, with tools, calls and
results laid out as Qwen3's official chat template writes them (the Hermes layout).

Tools (Qwen/Qwen3-0.6B tokenizer_config.json `chat_template`):
- the system turn holds a `# Tools` block: the instructions, each tool schema as one line of JSON
  between `<tools>` and `</tools>` (key order kept, non-ASCII kept: Hugging Face's `tojson`), and
  the call syntax; the record's system prompt, if any, comes first, followed by a blank line;
- an assistant turn writes each call after its text (a newline between them) as
  `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`, calls separated by a newline;
- a run of tool results is one user turn of `\\n<tool_response>\\nRESULT\\n</tool_response>` blocks.
`<tool_call>`, `</tool_call>`, `<tool_response>` and `</tool_response>` are added tokens of Qwen's
vocabulary: they go in by id, also where the template's instructions spell them, and are never
parsed from data. What the model writes (the reply's text, its calls and the closing <|im_end|>)
is the target; the tools block and the results are not.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from prepack.text.chat.base import ChatFormat, PromptResponseLayout, Segment
from prepack.text.conversation import Conversation, ToolCall, Turn, json_text
from prepack.text.tool_markup import HERMES_CALL, HERMES_RESPONSE

if TYPE_CHECKING:
    from prepack.text.tokenizer import Tokenizer

__all__ = ["ChatMLFormat", "TOOLS_INTRO", "TOOLS_SYNTAX"]

# The template's fixed text around the tool schemas (Qwen3-0.6B chat_template, verbatim; the
# `<tool_call>` tags inside it become the added tokens).
TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
TOOLS_SYNTAX = '\n{"name": <function-name>, "arguments": <args-json-object>}\n'
_RESPONSE_WRAPPED = HERMES_RESPONSE


class ChatMLFormat(ChatFormat):
    """<|im_start|>{role}\\n{content}<|im_end|>\\n per turn, no BOS (Qwen has none), content
    verbatim. No default system prompt is injected. Target = reply (and its tool calls) +
    <|im_end|>. Tools as the module docstring says."""

    name = "chatml"

    def __init__(self, tokenizer: "Tokenizer") -> None:
        super().__init__(tokenizer)
        self.ims = self._special("<|im_start|>")
        self.ime = self._special("<|im_end|>")
        nl = self._const("\n")
        asst_hdr = self._const("assistant\n")
        ime_nl = (self.ime, *nl)
        self._open = {"start": (self.ims,), "closed": (*ime_nl, self.ims), "target": (*nl, self.ims)}
        self._open_asst = {k: v + asst_hdr for k, v in self._open.items()}
        # The opener of the one assistant turn that _think_turn() picks (none in plain ChatML).
        self._open_think = self._open_asst
        self._close = {"start": (), "closed": ime_nl, "target": nl}
        self._ime_only = (self.ime,)
        self._tool_ids: tuple[int, int, int, int] | None = None  # looked up when a conversation has tools

    def _think_turn(self, turns: Sequence[Any]) -> int:
        """Index of the assistant turn opened with self._open_think (-1: none)."""
        return -1

    def prompt_response_layout(self) -> "PromptResponseLayout":
        return PromptResponseLayout(self._open["start"], "user\n", self._open_asst["closed"], self._ime_only,
                          self._close["target"], strip=False)

    def segments(self, conv: Conversation) -> list[Segment]:
        turns, loss = conv.turns, conv.loss_turns
        segs: list[Segment] = []
        append = segs.append
        state = "start"
        think_at = self._think_turn(turns)
        i, n = 0, len(turns)
        if conv.tools:
            system = turns[0].content if n and turns[0].role == "system" else None
            self._tools_system(system, conv.tools, segs)
            state, i = "closed", (1 if system is not None else 0)
        while i < n:
            turn = turns[i]
            role = turn.role
            if role == "assistant":
                target = int(i in loss)  # type: ignore[operator]
                if turn.reasoning is not None:
                    content = self._reasoning_segments(conv, i, state, bool(target), segs)
                elif i == think_at:
                    append((self._open_think[state], 0))
                    content = turn.content.lstrip("\n")
                else:
                    append((self._open_asst[state], 0))
                    content = turn.content
                if turn.tool_calls:
                    self._calls(turn, content, target, segs)
                else:
                    append((content, target))
                if target:
                    append((self._ime_only, 1))
                    state = "target"
                else:
                    state = "closed"
            elif role == "tool":
                i = self._results(turns, i, state, segs)
                state = "closed"
                continue
            else:
                append((self._open[state], 0))
                append((role + "\n" + turn.content, 0))
                state = "closed"
            i += 1
        append((self._close[state], 0))
        return segs

    # -- tools ----------------------------------------------------------------------------

    def _tools(self) -> tuple[int, int, int, int]:
        """<tool_call>, </tool_call>, <tool_response>, </tool_response>: a tokenizer without them
        can still lay out plain chat; a conversation with tools then names the missing token."""
        if self._tool_ids is None:
            self._tool_ids = (self._special(HERMES_CALL[0]), self._special(HERMES_CALL[1]),
                              self._special(HERMES_RESPONSE[0]), self._special(HERMES_RESPONSE[1]))
        return self._tool_ids

    def _tools_system(self, system: str | None, tools: Sequence[Any], segs: list[Segment]) -> None:
        call, end_call, _, _ = self._tools()
        head = "system\n" + (system + "\n\n" if system is not None else "") + TOOLS_INTRO
        schemas = "".join("\n" + json_text(tool) for tool in tools)
        segs.append((self._open["start"], 0))
        segs.append((head + schemas + TOOLS_OUTRO, 0))
        segs.append(((call, end_call), 0))
        segs.append((" XML tags:\n", 0))
        segs.append(((call,), 0))
        segs.append((TOOLS_SYNTAX, 0))
        segs.append(((end_call,), 0))

    def _calls(self, turn: Turn, content: str, target: int, segs: list[Segment]) -> None:
        """The reply's text, then each call; `content` is the text as laid out after the opener,
        and a newline follows it when the message has text (the template tests the message's own
        content, before any think block trims it)."""
        call, end_call, _, _ = self._tools()
        text = content + "\n" if turn.content else content
        for k, tool_call in enumerate(turn.tool_calls):
            if k:
                text = "\n"
            if text:
                segs.append((text, target))
            segs.append(((call,), target))
            segs.append((call_json(tool_call), target))
            segs.append(((end_call,), target))

    def _results(self, turns: Sequence[Turn], i: int, state: str, segs: list[Segment]) -> int:
        """A run of tool results from turn i: one user turn. Returns the index after the run."""
        _, _, response, end_response = self._tools()
        segs.append((self._open[state], 0))
        text = "user\n"
        while i < len(turns) and turns[i].role == "tool":
            segs.append((text, 0))
            segs.append(((response,), 0))
            segs.append(("\n" + turns[i].content + "\n", 0))
            segs.append(((end_response,), 0))
            text = "\n"
            i += 1
        return i

    # -- reasoning (qwen3 lays traces out; plain ChatML refuses them) ---------------------

    def _reasoning_segments(self, conv: Conversation, i: int, state: str, target: bool, segs: list[Segment]) -> str:
        """Appends the opener of assistant turn i, which carries a reasoning trace, to `segs`
        and returns the content that follows it (plain ChatML refuses the trace)."""
        self._refuse_reasoning(conv)
        raise AssertionError("unreachable")


def call_json(call: ToolCall) -> str:
    """A call as Qwen3's template writes it between <tool_call> and </tool_call>."""
    return '\n{"name": "' + call.name + '", "arguments": ' + call.arguments_text + '}\n'


def last_query(turns: Sequence[Turn]) -> int:
    """Qwen3's `last_query_index`: the last user turn that is not a wrapped tool response, or the
    last turn when there is none."""
    for i in range(len(turns) - 1, -1, -1):
        turn = turns[i]
        if turn.role == "user" and not (turn.content.startswith(_RESPONSE_WRAPPED[0])
                                        and turn.content.endswith(_RESPONSE_WRAPPED[1])):
            return i
    return len(turns) - 1
