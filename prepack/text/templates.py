"""Source records -> conversations.

A *template* turns one source record (one JSON object of a dataset) into zero or more
`Conversation`s; each conversation becomes exactly one training example later on
(`prepack.text.chat_formats` turns it into token ids and a loss mask).

Templates only look at the record's structure. They do not know about tokenizers or chat
markup, so the same `alpaca` record can be rendered for Gemma, Qwen or any HF chat template.

Bad records raise `RecordError` with a short, stable `reason` code and the dotted `field`
that is wrong. The pipeline counts records by reason and adds file/line to the message, so
reason codes must stay stable; the full list is `RECORD_ERROR_REASONS`.

The `oasst1` format is different: its source is a table of messages (one record per
message) that only make sense together, so it is table-level; see `oasst1_conversations`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Literal, Mapping, Protocol, get_args

__all__ = [
    "Role",
    "Turn",
    "Conversation",
    "RecordError",
    "RECORD_ERROR_REASONS",
    "Template",
    "AlpacaTemplate",
    "PromptResponseTemplate",
    "TranslationTemplate",
    "ChatTemplate",
    "Oasst1Template",
    "DroppedMessage",
    "Oasst1Result",
    "OASST1_DROP_REASONS",
    "LANGUAGE_NAMES",
    "DEFAULT_TRANSLATION_PROMPT",
    "language_name",
    "get_template",
    "template_names",
    "oasst1_build",
    "oasst1_conversations",
    "expand_turns",
]

Role = Literal["system", "user", "assistant"]
_ROLES: frozenset[str] = frozenset(get_args(Role))


# --------------------------------------------------------------------------------------
# Data types
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    """One message of a conversation. `content` is kept verbatim (chat formats decide
    about trimming, because that is part of each model's markup)."""

    role: Role
    content: str
    # An assistant turn's reasoning trace (a `chat` record's `reasoning_content`), None when it
    # has none. Only chat formats with think tokens (qwen3) can lay it out; the others refuse it.
    reasoning: str | None = None

    def __post_init__(self) -> None:
        # Programming errors, not data errors: templates validate data before building Turns.
        if self.role not in _ROLES:
            raise ValueError(f"Turn.role must be one of {sorted(_ROLES)}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise TypeError(f"Turn.content must be str, got {type(self.content).__name__}")
        if self.reasoning is not None and (self.role != "assistant" or not isinstance(self.reasoning, str)):
            raise ValueError("Turn.reasoning must be a str, and only on an assistant turn")


@dataclass(frozen=True, slots=True)
class Conversation:
    """A sequence of turns and which assistant turns are training targets.

    `loss_turns` holds indices into `turns`, strictly increasing, each an assistant turn.
    Leaving it out (None) makes every assistant turn a target. One conversation is one
    training example, so e.g. oasst1 emits one conversation per assistant reply with only
    the last turn as target, while a `chat` record trains on all of its replies at once.
    """

    turns: tuple[Turn, ...]
    loss_turns: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        turns = tuple(self.turns)
        object.__setattr__(self, "turns", turns)
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
    def messages(self) -> list[dict[str, str]]:
        """The turns as HF-style [{role, content}] dicts (for jinja chat templates), with
        `reasoning_content` on a turn that has a reasoning trace (the key Qwen3's template reads)."""
        return [{"role": t.role, "content": t.content} if t.reasoning is None else
                {"role": t.role, "content": t.content, "reasoning_content": t.reasoning} for t in self.turns]


# Every reason code a template can raise. Kept in one place so the pipeline's counters and
# docs can enumerate them.
RECORD_ERROR_REASONS: tuple[str, ...] = (
    "not_an_object",      # the record itself is not a JSON object (dict)
    "missing_field",      # a required field is absent or null
    "wrong_type",         # a field has the wrong JSON type
    "empty_prompt",       # the prompt side (instruction, prompt, source text, user turn) is empty/whitespace
    "empty_response",     # the response side (output, response, target text, assistant turn) is empty/whitespace
    "bad_role",           # chat: a message role outside system/user/assistant (+ alias model)
    "system_not_first",   # chat: a system message anywhere but first
    "assistant_first",    # chat: the first non-system message is from the assistant (no prompt)
    "empty_messages",     # chat: the messages list is empty
    "no_assistant_turn",  # chat: no assistant message, so nothing to train on
)


class RecordError(Exception):
    """A source record cannot be turned into a conversation.

    reason: a code from RECORD_ERROR_REASONS (stable, for counting);
    field:  the dotted path of the offending field ("translation.fr", "messages[2].content"),
            or "" when the record as a whole is wrong;
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


# --------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------

_JSON_TYPE_NAMES = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
    type(None): "null",
}


def _describe(value: Any) -> str:
    """'a number (3.5)', 'an array of 2 items', ... for error messages; shortened so a
    huge bad value cannot flood the logs."""
    name = _JSON_TYPE_NAMES.get(type(value), type(value).__name__)
    if isinstance(value, (list, tuple)):
        return f"an array of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        keys = ", ".join(map(str, list(value)[:5]))
        return f"an object with keys [{keys}{', ...' if len(value) > 5 else ''}]"
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    article = "an" if name[0] in "aeiou" else "a"
    return f"{article} {name} ({text})"


def _check_record(record: Any) -> Mapping[str, Any]:
    # dict first: isinstance against typing.Mapping goes through the ABC machinery (~8 µs).
    if record.__class__ is not dict and not isinstance(record, Mapping):
        raise RecordError("not_an_object", "", f"record: expected a JSON object, got {_describe(record)}")
    return record


def _get_str(obj: Mapping[str, Any], key: str, path: str, what: str) -> str:
    """obj[key] as a string; `what` says what the field should hold (for the message)."""
    if key not in obj:
        raise RecordError("missing_field", path, f"missing field '{path}': expected a string ({what})")
    value = obj[key]
    if value is None:
        # HF datasets write absent values as null; treat that as missing, but say so.
        raise RecordError("missing_field", path, f"field '{path}' is null: expected a string ({what})")
    if not isinstance(value, str):
        raise RecordError("wrong_type", path, f"field '{path}': expected a string ({what}), got {_describe(value)}")
    return value


def _get_optional_str(obj: Mapping[str, Any], key: str, path: str, what: str) -> str:
    """Like _get_str, but absent or null means ''."""
    value = obj.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RecordError("wrong_type", path, f"field '{path}': expected a string ({what}) or null, got {_describe(value)}")
    return value


def _require_nonblank(text: str, reason: str, path: str, what: str) -> None:
    if not text.strip():
        got = "an empty string" if not text else "only whitespace"
        raise RecordError(reason, path, f"field '{path}': expected non-empty {what}, got {got}")


# --------------------------------------------------------------------------------------
# Templates
# --------------------------------------------------------------------------------------


class Template(Protocol):
    """What the pipeline needs from a source format."""

    name: str
    table_level: bool  # True: records are parts of a table (oasst1), see Oasst1Template

    def to_conversations(self, record: Mapping[str, Any]) -> list[Conversation]: ...


# Single-turn templates (alpaca, prompt_response, translation) also offer
# `to_pair(record) -> (prompt, response)`: the same example as to_conversations without the
# Conversation objects, so a batch can go straight to chat_formats.tokenize_pairs_flat.


def _trusted_turn(role: Role, content: str) -> Turn:
    # Turn(role, content) without __post_init__: callers pass a valid role and a str.
    turn = object.__new__(Turn)
    _set_attr(turn, "role", role)
    _set_attr(turn, "content", content)
    _set_attr(turn, "reasoning", None)
    return turn


_set_attr = object.__setattr__
_SINGLE_TURN_LOSS = (1,)


def _single_turn(prompt: str, response: str) -> list[Conversation]:
    # Conversation((Turn("user", prompt), Turn("assistant", response)), (1,)) without the
    # validation, which cannot fail for this fixed shape (prompt and response are str, checked
    # by the templates): this runs once per example.
    conv = object.__new__(Conversation)
    _set_attr(conv, "turns", (_trusted_turn("user", prompt), _trusted_turn("assistant", response)))
    _set_attr(conv, "loss_turns", _SINGLE_TURN_LOSS)
    return [conv]


@dataclass(frozen=True)
class AlpacaTemplate:
    """{instruction, input, output}: prompt = instruction, plus "\\n\\n" + input when the
    input is non-blank (Alpaca leaves it "" for instruction-only tasks)."""

    name: ClassVar[str] = "alpaca"
    table_level: ClassVar[bool] = False

    def to_conversations(self, record: Mapping[str, Any]) -> list[Conversation]:
        return _single_turn(*self.to_pair(record))

    def to_pair(self, record: Mapping[str, Any]) -> tuple[str, str]:
        """(prompt, response) of the one example; the same checks and errors as to_conversations."""
        record = _check_record(record)
        instruction = _get_str(record, "instruction", "instruction", "the task instruction")
        extra = _get_optional_str(record, "input", "input", "the optional task input")
        output = _get_str(record, "output", "output", "the target response")
        _require_nonblank(instruction, "empty_prompt", "instruction", "instruction text")
        _require_nonblank(output, "empty_response", "output", "response text")
        return (instruction + "\n\n" + extra if extra.strip() else instruction), output


@dataclass(frozen=True)
class PromptResponseTemplate:
    """{prompt, response}: one user turn and one assistant turn."""

    name: ClassVar[str] = "prompt_response"
    table_level: ClassVar[bool] = False

    def to_conversations(self, record: Mapping[str, Any]) -> list[Conversation]:
        return _single_turn(*self.to_pair(record))

    def to_pair(self, record: Mapping[str, Any]) -> tuple[str, str]:
        """(prompt, response) of the one example; the same checks and errors as to_conversations."""
        record = _check_record(record)
        prompt = _get_str(record, "prompt", "prompt", "the user prompt")
        response = _get_str(record, "response", "response", "the target response")
        _require_nonblank(prompt, "empty_prompt", "prompt", "prompt text")
        _require_nonblank(response, "empty_response", "response", "response text")
        return prompt, response


# ISO 639-1 codes -> English names used in the translation instruction. Small on purpose:
# unknown codes fall back to the code itself, which still makes a readable prompt.
LANGUAGE_NAMES: dict[str, str] = {
    "ar": "Arabic", "bg": "Bulgarian", "ca": "Catalan", "cs": "Czech", "da": "Danish",
    "de": "German", "el": "Greek", "en": "English", "es": "Spanish", "et": "Estonian",
    "fa": "Persian", "fi": "Finnish", "fr": "French", "he": "Hebrew", "hi": "Hindi",
    "hr": "Croatian", "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese",
    "ko": "Korean", "lt": "Lithuanian", "lv": "Latvian", "nl": "Dutch", "no": "Norwegian",
    "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "sk": "Slovak",
    "sl": "Slovenian", "sr": "Serbian", "sv": "Swedish", "th": "Thai", "tr": "Turkish",
    "uk": "Ukrainian", "vi": "Vietnamese", "zh": "Chinese",
}

DEFAULT_TRANSLATION_PROMPT = "Translate the following text from {source} to {target}.\n\n{text}"


def language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code.lower(), code)


@dataclass(frozen=True)
class TranslationTemplate:
    """OPUS-100 style {"translation": {src: ..., tgt: ...}} or flat {src: ..., tgt: ...}.

    Options: source_lang (default "en"), target_lang (default "fr"), prompt_format (a
    str.format string with {source}, {target} = language names and {text} = source text).
    """

    source_lang: str = "en"
    target_lang: str = "fr"
    prompt_format: str = DEFAULT_TRANSLATION_PROMPT

    name: ClassVar[str] = "translation"
    table_level: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for opt in ("source_lang", "target_lang"):
            value = getattr(self, opt)
            if not isinstance(value, str) or not value:
                raise ValueError(f"translation template: option {opt} must be a non-empty language code, got {value!r}")
        if self.source_lang == self.target_lang:
            raise ValueError(f"translation template: source_lang and target_lang are both {self.source_lang!r}")
        if "{text}" not in self.prompt_format:
            raise ValueError("translation template: prompt_format must contain {text}")
        # Fail at construction, not on the first record, if the format has unknown fields.
        self.prompt_format.format(source="", target="", text="")
        # Looked up once, not per record.
        object.__setattr__(self, "_names", (language_name(self.source_lang), language_name(self.target_lang)))

    def to_conversations(self, record: Mapping[str, Any]) -> list[Conversation]:
        return _single_turn(*self.to_pair(record))

    def to_pair(self, record: Mapping[str, Any]) -> tuple[str, str]:
        """(prompt, response) of the one example; the same checks and errors as to_conversations."""
        record = _check_record(record)
        src_code, tgt_code = self.source_lang, self.target_lang
        if "translation" in record:
            pair = record["translation"]
            if pair.__class__ is not dict and not isinstance(pair, Mapping):
                raise RecordError(
                    "wrong_type", "translation",
                    f"field 'translation': expected an object with '{src_code}' and '{tgt_code}' keys, got {_describe(pair)}",
                )
            prefix = "translation."
        else:
            pair, prefix = record, ""
            if src_code not in record and tgt_code not in record:
                # Neither shape matched: name both so the user sees what was looked for.
                raise RecordError(
                    "missing_field", src_code,
                    f"missing field '{src_code}' (or 'translation.{src_code}'): expected the "
                    f"{language_name(src_code)} source text; record has keys [{', '.join(map(str, list(record)[:8]))}]",
                )
        src_name, tgt_name = self._names
        source = _get_str(pair, src_code, prefix + src_code, f"the {src_name} source text")
        target = _get_str(pair, tgt_code, prefix + tgt_code, f"the {tgt_name} target text")
        _require_nonblank(source, "empty_prompt", prefix + src_code, f"{src_name} source text")
        _require_nonblank(target, "empty_response", prefix + tgt_code, f"{tgt_name} target text")
        return self.prompt_format.format(source=src_name, target=tgt_name, text=source), target


# Accepted chat roles. "model" is Gemma's word for the assistant.
_CHAT_ROLE_ALIASES: dict[str, Role] = {"system": "system", "user": "user", "assistant": "assistant", "model": "assistant"}


@dataclass(frozen=True)
class ChatTemplate:
    """{messages: [{role, content}, ...]}: loss on every assistant turn. An assistant message
    may carry `reasoning_content` (a string or null; blank counts as none): its reasoning trace,
    laid out by the chat format (qwen3: in the think block, see docs/qwen3.md).

    Rules (each violation is a RecordError): roles are system/user/assistant/model; a system
    message may only come first; the first non-system message must be from the user; user
    and assistant content must be non-blank. An empty system message is dropped (it carries
    nothing). Messages after the last assistant turn are dropped because nothing would be
    trained on them.
    """

    name: ClassVar[str] = "chat"
    table_level: ClassVar[bool] = False

    def to_conversations(self, record: Mapping[str, Any]) -> list[Conversation]:
        record = _check_record(record)
        if "messages" not in record or record["messages"] is None:
            raise RecordError("missing_field", "messages", "missing field 'messages': expected an array of {role, content} objects")
        messages = record["messages"]
        if not isinstance(messages, (list, tuple)):
            raise RecordError(
                "wrong_type", "messages",
                f"field 'messages': expected an array of {{role, content}} objects, got {_describe(messages)}",
            )
        if not messages:
            raise RecordError("empty_messages", "messages", "field 'messages': expected at least one message, got an empty array")
        turns: list[Turn] = []
        seen_non_system = False
        for i, msg in enumerate(messages):
            path = f"messages[{i}]"
            if not isinstance(msg, Mapping):
                raise RecordError("wrong_type", path, f"field '{path}': expected a {{role, content}} object, got {_describe(msg)}")
            raw_role = _get_str(msg, "role", path + ".role", "system, user or assistant")
            role = _CHAT_ROLE_ALIASES.get(raw_role)
            if role is None:
                raise RecordError(
                    "bad_role", path + ".role",
                    f"field '{path}.role': expected one of system, user, assistant (or model), got {raw_role!r}",
                )
            content = _get_str(msg, "content", path + ".content", f"the {role} message text")
            if role == "system":
                if i != 0:
                    raise RecordError(
                        "system_not_first", path + ".role",
                        f"field '{path}.role': a system message is only allowed as the first message, found at index {i}",
                    )
                if not content.strip():
                    continue
            elif role == "user":
                _require_nonblank(content, "empty_prompt", path + ".content", "user message text")
            else:
                if not seen_non_system:
                    raise RecordError(
                        "assistant_first", path + ".role",
                        f"field '{path}.role': expected the first non-system message to be from the user, got an assistant message",
                    )
                _require_nonblank(content, "empty_response", path + ".content", "assistant message text")
                reasoning = _get_optional_str(msg, "reasoning_content", path + ".reasoning_content", "the reply's reasoning trace")
                if reasoning.strip():
                    turns.append(Turn(role, content, reasoning))
                    seen_non_system = True
                    continue
            seen_non_system = seen_non_system or role != "system"
            turns.append(Turn(role, content))
        last = max((i for i, t in enumerate(turns) if t.role == "assistant"), default=-1)
        if last < 0:
            raise RecordError("no_assistant_turn", "messages", f"field 'messages': expected at least one assistant message, got roles {[t.role for t in turns]}")
        return [Conversation(tuple(turns[: last + 1]))]


def expand_turns(conv: Conversation) -> list[Conversation]:
    """--expand-turns: one conversation per target assistant turn i, holding the turns up to
    and including it and training it alone. A chat format then renders each as it would at that
    point of the dialogue (qwen3: the reasoning of reply i in its think block, earlier replies
    without theirs), which is what the model sees at inference (fw-ai/cookbook #386)."""
    loss = conv.loss_turns
    if len(loss) == 1 and loss[0] == len(conv.turns) - 1:
        return [conv]
    return [Conversation(conv.turns[: i + 1], (i,)) for i in loss]  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------
# oasst1 (table-level)
# --------------------------------------------------------------------------------------

# Why a message of the oasst1 table produced no example and is not used as context.
OASST1_DROP_REASONS: tuple[str, ...] = (
    "invalid",          # not an object, or message_id/text/role missing or of the wrong type
    "duplicate_id",     # a second message with an already seen message_id
    "bad_role",         # role is neither "prompter" nor "assistant"
    "empty_text",       # text is empty/whitespace
    "deleted",          # deleted is True
    "not_english",      # lang != "en"
    "review_failed",    # review_result is not True (False or missing)
    "assistant_root",   # a thread starts with an assistant message: no prompt to answer
    "missing_parent",   # parent_id names a message that is not in the table given
    "orphaned",         # some ancestor was dropped, so the thread prefix is incomplete
    "cycle",            # the parent_id links loop
)


@dataclass(frozen=True, slots=True)
class DroppedMessage:
    message_id: str | None
    message_tree_id: str | None
    reason: str   # one of OASST1_DROP_REASONS
    detail: str   # human-readable explanation


@dataclass
class Oasst1Result:
    examples: list[tuple[Conversation, str]]   # (conversation, example_id = assistant message_id)
    dropped: list[DroppedMessage] = field(default_factory=list)


_OASST1_ROLES: dict[str, Role] = {"prompter": "user", "assistant": "assistant"}


def _oasst1_own_problem(msg: Mapping[str, Any]) -> tuple[str, str] | None:
    """Checks that depend on the message alone: (reason, detail) or None if it is usable."""
    role = msg.get("role")
    if role not in _OASST1_ROLES:
        return "bad_role", f"role: expected 'prompter' or 'assistant', got {_describe(role)}"
    text = msg.get("text")
    if not isinstance(text, str):
        return "invalid", f"text: expected a string, got {_describe(text)}"
    if not text.strip():
        return "empty_text", "text is empty or whitespace"
    # A missing `deleted` counts as not deleted (some exports omit it); a missing
    # review_result is not a pass, because the review is the quality gate we filter on.
    if msg.get("deleted") is True:
        return "deleted", "deleted is true"
    if msg.get("lang") != "en":
        return "not_english", f"lang: expected 'en', got {_describe(msg.get('lang'))}"
    if msg.get("review_result") is not True:
        return "review_failed", f"review_result: expected true, got {_describe(msg.get('review_result'))}"
    return None


def oasst1_build(messages: Iterable[Mapping[str, Any]]) -> Oasst1Result:
    """Rebuild oasst1 threads from a table of messages (normally one message_tree_id).

    Keeps messages with lang == "en", review_result True and deleted not True; a message
    below a dropped one is dropped as "orphaned". Every kept assistant message becomes one
    example: the turns from the thread root down to it (prompter -> user), loss only on
    that last turn, example_id = its message_id. Prompter messages never become examples
    themselves and are not listed as dropped when they simply have no reply.

    Output order is sorted by (message_tree_id, message_id), independent of input order.
    """
    dropped: list[DroppedMessage] = []
    by_id, own_drop = _oasst1_index(messages, dropped)
    resolved = _oasst1_resolve(by_id, own_drop)
    examples_keyed: list[tuple[tuple[str, str], Conversation, str]] = []
    for mid, msg in by_id.items():
        value = resolved[mid]
        tree = msg.get("message_tree_id")
        tree_key = tree if isinstance(tree, str) else ""
        if _is_drop(value):
            reason, detail = value  # type: ignore[misc]
            dropped.append(DroppedMessage(mid, tree if isinstance(tree, str) else None, reason, detail))
        elif msg["role"] == "assistant":
            turns = value  # type: ignore[assignment]
            conv = Conversation(turns, (len(turns) - 1,))  # type: ignore[arg-type]
            examples_keyed.append(((tree_key, mid), conv, mid))

    examples_keyed.sort(key=lambda item: item[0])
    dropped.sort(key=lambda d: (d.message_tree_id or "", d.message_id or "", d.reason))
    return Oasst1Result([(conv, eid) for _, conv, eid in examples_keyed], dropped)


def _oasst1_index(messages: Iterable[Mapping[str, Any]], dropped: list[DroppedMessage]
                  ) -> tuple[dict[str, Mapping[str, Any]], dict[str, tuple[str, str]]]:
    """The messages by id, and each one's own drop reason (its fields, not its ancestors');
    messages without a usable id go straight to `dropped`."""
    by_id: dict[str, Mapping[str, Any]] = {}
    own_drop: dict[str, tuple[str, str]] = {}
    for msg in messages:
        if not isinstance(msg, Mapping):
            dropped.append(DroppedMessage(None, None, "invalid", f"expected a message object, got {_describe(msg)}"))
            continue
        mid = msg.get("message_id")
        tree = msg.get("message_tree_id")
        tree = tree if isinstance(tree, str) else None
        if not isinstance(mid, str) or not mid:
            dropped.append(DroppedMessage(None, tree, "invalid", f"message_id: expected a non-empty string, got {_describe(mid)}"))
            continue
        if mid in by_id:
            dropped.append(DroppedMessage(mid, tree, "duplicate_id", "a message with this message_id came earlier; the first is kept"))
            continue
        parent = msg.get("parent_id")
        if parent is not None and not isinstance(parent, str):
            own_drop[mid] = ("invalid", f"parent_id: expected a string or null, got {_describe(parent)}")
        else:
            problem = _oasst1_own_problem(msg)
            if problem is not None:
                own_drop[mid] = problem
        by_id[mid] = msg
    return by_id, own_drop


def _is_drop(value: tuple[Any, ...]) -> bool:
    return bool(value) and isinstance(value[0], str)


def _oasst1_resolve(by_id: dict[str, Mapping[str, Any]], own_drop: dict[str, tuple[str, str]]
                    ) -> dict[str, tuple[Turn, ...] | tuple[str, str]]:
    """Every message's turn prefix (root..message) or drop reason. An iterative walk up the parent
    chain with memoisation: deep threads cannot hit the recursion limit, and each message is
    resolved once."""
    resolved: dict[str, tuple[Turn, ...] | tuple[str, str]] = {}  # id -> turns | (reason, detail)
    for start in by_id:
        chain: list[str] = []
        on_chain: set[str] = set()
        cur: str | None = start
        while cur is not None and cur not in resolved and cur in by_id and cur not in on_chain:
            chain.append(cur)
            on_chain.add(cur)
            cur = by_id[cur].get("parent_id")
        if cur is not None and cur in on_chain:
            # Never seen in real data; every message on the walked chain is unusable.
            for mid in chain:
                resolved[mid] = ("cycle", f"parent_id links loop through message {cur}")
            continue
        # What sits above the top of the chain: nothing (root), an already resolved
        # ancestor, or a parent_id that names no message in the table.
        missing_parent = cur is not None and cur not in resolved
        acc: tuple[Turn, ...] | tuple[str, str] = () if cur is None or missing_parent else resolved[cur]
        for depth, mid in enumerate(reversed(chain)):
            own = own_drop.get(mid)
            if own is not None:
                acc = own
            elif depth == 0 and missing_parent:
                acc = ("missing_parent", f"parent message {cur} is not in the table")
            elif _is_drop(acc):
                parent_id = by_id[mid].get("parent_id")
                acc = ("orphaned", f"parent message {parent_id} was dropped ({acc[0]})")
            else:
                msg = by_id[mid]
                role = _OASST1_ROLES[msg["role"]]
                if not acc and role == "assistant":
                    acc = ("assistant_root", "the thread starts with an assistant message, so there is no prompt")
                else:
                    acc = acc + (Turn(role, msg["text"]),)  # type: ignore[operator]
            resolved[mid] = acc
    return resolved


def oasst1_conversations(
    messages: Iterable[Mapping[str, Any]], dropped: list[DroppedMessage] | None = None
) -> list[tuple[Conversation, str]]:
    """`oasst1_build(messages).examples`; dropped messages are appended to `dropped` when
    a list is given (so callers that only want examples keep a plain list return)."""
    result = oasst1_build(messages)
    if dropped is not None:
        dropped.extend(result.dropped)
    return result.examples


@dataclass(frozen=True)
class Oasst1Template:
    """Registry entry for the OpenAssistant/oasst1 message table.

    table_level is True: a single record is one message and cannot be converted alone.
    The pipeline groups records by `group_key` and calls `conversations_from_table`.
    """

    name: ClassVar[str] = "oasst1"
    table_level: ClassVar[bool] = True
    group_key: ClassVar[str] = "message_tree_id"

    def conversations_from_table(self, messages: Iterable[Mapping[str, Any]]) -> Oasst1Result:
        return oasst1_build(messages)

    def to_conversations(self, record: Mapping[str, Any]) -> list[Conversation]:
        raise NotImplementedError(
            "oasst1 is a table-level format: group its messages by 'message_tree_id' and call "
            "conversations_from_table(messages) (or templates.oasst1_conversations)"
        )


# --------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------

_REGISTRY: dict[str, type] = {
    "alpaca": AlpacaTemplate,
    "translation": TranslationTemplate,
    "prompt_response": PromptResponseTemplate,
    "chat": ChatTemplate,
    "oasst1": Oasst1Template,
}


def template_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_template(name: str, **options: Any) -> Template:
    """The template registered as `name`, built with `options` (only `translation` takes
    any: source_lang, target_lang, prompt_format). Raises ValueError for an unknown name or
    option, naming what is accepted."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown source format {name!r}; expected one of {', '.join(template_names())}")
    accepted = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"source format {name!r} does not take option(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(accepted) if accepted else 'none'}"
        )
    return cls(**options)
