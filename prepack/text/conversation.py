"""What one training example says, before any tokenizer: a `Conversation` of turns (with tool
calls, tool results and the tools offered), or a plain-text `Document`.

Source formats (prepack/text/formats/) build these from records; chat formats
(prepack/text/chat/) lay them out as token ids and a loss mask. Neither side knows the other:
the same `sharegpt` record renders for Gemma, Qwen3 or a tokenizer's own jinja template.

A record that cannot become an example raises `RecordError` with a stable `reason` code (the
pipeline counts records by it; the list is `RECORD_ERROR_REASONS`) and the dotted `field` that is
wrong, named as the record spells it (after `--columns`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = [
    "Role",
    "ToolCall",
    "Turn",
    "Conversation",
    "Document",
    "PreferencePair",
    "Example",
    "RecordError",
    "RECORD_ERROR_REASONS",
    "expand_turns",
    "json_text",
    "trusted_turn",
    "trusted_conversation",
]

Role = Literal["system", "user", "assistant", "tool"]
_ROLES: frozenset[str] = frozenset(get_args(Role))


def json_text(value: Any) -> str:
    """A JSON value as Hugging Face's chat templates write it (`tojson`): key order kept,
    non-ASCII kept, default separators. jinja2's own tojson sorts keys and escapes HTML."""
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call an assistant turn makes.

    `arguments` is the parsed JSON value (an object for every well-formed call), what a jinja
    template is given; `arguments_text` is how the call's arguments are written when laid out as
    JSON: verbatim when the record gave them as a JSON string, else `json_text(arguments)`. Qwen3's
    template writes a string verbatim and an object through tojson, so both spellings survive.
    """

    name: str
    arguments: Any
    arguments_text: str
    id: str | None = None

    def message(self) -> dict[str, Any]:
        """The call in the OpenAI / Hugging Face message schema."""
        call: dict[str, Any] = {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if self.id is not None:
            call["id"] = self.id
        return call


@dataclass(frozen=True, slots=True)
class Turn:
    """One message. `content` is kept verbatim (chat formats decide about trimming: that is part
    of each model's markup). An assistant turn may carry a reasoning trace and tool calls (then
    its content may be empty); a tool turn is one tool's result, with the function's `name` and
    the `tool_call_id` it answers when the record gave them."""

    role: Role
    content: str
    # An assistant turn's reasoning trace (`reasoning_content`, or a reasoning/thinking content
    # part), None when it has none. Only chat formats with think tokens (qwen3) can lay it out.
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    name: str | None = None
    tool_call_id: str | None = None

    def __post_init__(self) -> None:
        # Programming errors, not data errors: source formats validate data before building Turns.
        if self.role not in _ROLES:
            raise ValueError(f"Turn.role must be one of {sorted(_ROLES)}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise TypeError(f"Turn.content must be str, got {type(self.content).__name__}")
        if self.reasoning is not None and (self.role != "assistant" or not isinstance(self.reasoning, str)):
            raise ValueError("Turn.reasoning must be a str, and only on an assistant turn")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("Turn.tool_calls only on an assistant turn")
        if (self.name is not None or self.tool_call_id is not None) and self.role != "tool":
            raise ValueError("Turn.name and Turn.tool_call_id only on a tool turn")

    def message(self) -> dict[str, Any]:
        """The turn in the Hugging Face message schema (what jinja chat templates read)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [call.message() for call in self.tool_calls]
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True, slots=True)
class Conversation:
    """Turns, which assistant turns are training targets, and the tools offered.

    `loss_turns` holds indices into `turns`, strictly increasing, each an assistant turn.
    Leaving it out (None) makes every assistant turn a target. One conversation is one
    training example, so e.g. oasst1 emits one conversation per assistant reply with only
    the last turn as target, while a `chat` record trains on all of its replies at once.
    `tools` are the function schemas the record offers, as it gave them (a chat format writes
    them where its model expects them); empty when it offers none.
    """

    turns: tuple[Turn, ...]
    loss_turns: tuple[int, ...] | None = None
    tools: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        turns = tuple(self.turns)
        object.__setattr__(self, "turns", turns)
        object.__setattr__(self, "tools", tuple(self.tools))
        if self.loss_turns is None:
            loss = tuple(i for i, t in enumerate(turns) if t.role == "assistant")
        else:
            loss = tuple(self.loss_turns)
        object.__setattr__(self, "loss_turns", loss)
        if not loss:
            raise ValueError("a Conversation needs at least one assistant turn as a loss target")
        prev = -1
        for i in loss:
            if not (isinstance(i, int) and 0 <= i < len(turns)):
                raise ValueError(f"loss_turns index {i!r} out of range for {len(turns)} turns")
            if i <= prev:
                raise ValueError(f"loss_turns must be strictly increasing, got {loss}")
            if turns[i].role != "assistant":
                raise ValueError(f"loss_turns[{i}] points at a {turns[i].role!r} turn; only assistant turns can be targets")
            prev = i

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The turns as Hugging Face messages (for jinja chat templates): role and content, and
        `reasoning_content`, `tool_calls`, `name`, `tool_call_id` where a turn has them."""
        return [t.message() for t in self.turns]

    @property
    def has_tools(self) -> bool:
        """Whether laying this out needs a chat format's tool markup."""
        return bool(self.tools) or any(t.tool_calls or t.role == "tool" for t in self.turns)


@dataclass(frozen=True, slots=True)
class Document:
    """A plain text (format `text`, continued pretraining): no chat markup; every token is a
    target except each segment's first (the row rule), closed by the tokenizer's eos."""

    text: str

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise TypeError(f"Document.text must be str, got {type(self.text).__name__}")


@dataclass(frozen=True, slots=True)
class PreferencePair:
    """Two replies to one prompt, the preferred one first (format `preference`, for DPO). Each side
    is a whole conversation: the same prompt turns, then that side's completion, whose assistant
    turns are the targets. A pair is packed as one unit: its two sides are adjacent segments of one
    row, never apart (docs/row_format.md)."""

    chosen: Conversation
    rejected: Conversation
    prompt_turns: int  # how many turns the two sides share at their start

    def __post_init__(self) -> None:
        k = self.prompt_turns
        if not (0 < k < min(len(self.chosen.turns), len(self.rejected.turns))):
            raise ValueError(f"PreferencePair.prompt_turns must leave each side a completion, got {k}")
        if self.chosen.turns[:k] != self.rejected.turns[:k] or self.chosen.tools != self.rejected.tools:
            raise ValueError("the two sides of a PreferencePair must share their prompt and tools")


Example = Conversation | Document


# Every reason code a source format can raise. Kept in one place so the pipeline's counters and
# docs can enumerate them.
RECORD_ERROR_REASONS: tuple[str, ...] = (
    "not_an_object",      # the record itself is not a JSON object (dict)
    "missing_field",      # a required field is absent or null
    "wrong_type",         # a field has the wrong JSON type
    "empty_prompt",       # the prompt side (instruction, prompt, source text, user turn) is empty/whitespace
    "empty_response",     # the response side (output, response, target text, assistant turn) is empty/whitespace
    "bad_role",           # a message role that maps to none of system, user, assistant, tool (see --roles)
    "system_not_first",   # a system message anywhere but first
    "assistant_first",    # the first non-system message is from the assistant or a tool (no prompt)
    "empty_messages",     # the messages list is empty
    "no_assistant_turn",  # no assistant message, so nothing to train on
    "no_trained_turn",    # every assistant message is marked untrained (train: false / loss_weight: 0)
    "identical_sides",    # preference: the chosen and the rejected completion are the same
    "bad_train_flag",     # a train / loss_weight value other than true/false, 0/1, or one on a non-assistant message
    "bad_tools",          # tools is not a list of function schemas, each with a name
    "bad_tool_call",      # a tool call that is not {name, arguments}, or arguments that are not valid JSON
    "unknown_tool",       # a tool call names a function that is not in the record's tools
    "orphan_tool_result", # a tool result with no tool call before it to answer
    "bad_content_part",   # a content part of an unknown type, or one without its text
    "empty_text",         # format text: the text is empty/whitespace
)


class RecordError(Exception):
    """A source record cannot be turned into an example.

    reason: a code from RECORD_ERROR_REASONS (stable, for counting);
    field:  the dotted path of the offending field as the record spells it ("translation.fr",
            "conversations[2].value"), or "" when the record as a whole is wrong;
    message: human-readable, names the field, what was expected and what was found.
    """

    def __init__(self, reason: str, field: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Beam pickles exceptions between workers; the default reduce would pass only
        # `message` back to __init__ and fail.
        return (type(self), (self.reason, self.field, self.message))

    def __repr__(self) -> str:
        return f"RecordError(reason={self.reason!r}, field={self.field!r}, message={self.message!r})"


_set = object.__setattr__


def trusted_turn(role: str, content: str, reasoning: str | None = None, tool_calls: tuple[ToolCall, ...] = (),
                 name: str | None = None, tool_call_id: str | None = None) -> Turn:
    """Turn(...) without __post_init__'s checks, for source formats that checked every value
    already: this runs once per message of every record."""
    turn = object.__new__(Turn)
    _set(turn, "role", role)
    _set(turn, "content", content)
    _set(turn, "reasoning", reasoning)
    _set(turn, "tool_calls", tool_calls)
    _set(turn, "name", name)
    _set(turn, "tool_call_id", tool_call_id)
    return turn


def trusted_conversation(turns: tuple[Turn, ...], loss_turns: tuple[int, ...], tools: tuple[Any, ...] = ()) -> Conversation:
    """Conversation(...) without __post_init__'s checks: loss_turns strictly increasing indices of
    assistant turns, given by a source format that built them so."""
    conv = object.__new__(Conversation)
    _set(conv, "turns", turns)
    _set(conv, "loss_turns", loss_turns)
    _set(conv, "tools", tools)
    return conv


def expand_turns(example: "Example | PreferencePair") -> list["Example | PreferencePair"]:
    """--expand-turns: one conversation per target assistant turn i, holding the turns up to
    and including it and training it alone. A chat format then renders each as it would at that
    point of the dialogue (qwen3: the reasoning of reply i in its think block, earlier replies
    without theirs), which is what the model sees at inference (fw-ai/cookbook #386). A
    document is one example already."""
    if not isinstance(example, Conversation):  # a document, or a preference pair: one unit already
        return [example]
    loss = example.loss_turns
    if len(loss) == 1 and loss[0] == len(example.turns) - 1:  # type: ignore[arg-type]
        return [example]
    return [Conversation(example.turns[: i + 1], (i,), example.tools) for i in loss]  # type: ignore[union-attr]
