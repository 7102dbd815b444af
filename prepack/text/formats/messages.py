"""Message lists, the one reader every message format shares (chat, sharegpt, prompt_completion,
preference).

`MessageReader.read` turns a list of message objects into `Pending` messages: each one's canonical
role (after the role map), text, reasoning trace, tool calls and training flag, checked field by
field. `assemble` then applies the conversation's rules and builds the `Conversation`:

- a system message only first (an empty one is dropped; a format's `system` column is one more
  system message, first);
- the first other message from the user (a tool result may not open a conversation either);
- user text non-blank; an assistant reply non-blank unless it makes tool calls;
- a tool result answers a call: it follows an assistant turn's calls, at most one result per call;
- what is trained: every assistant turn the format trains by default (all of them in `chat`; the
  completion's in `prompt_completion`), overridden per message by `train: true|false` (axolotl) or
  `loss_weight: 0|1` (LLaMA-Factory, also 0.0/1.0). Any other value, or a non-assistant message
  marked trained, is refused naming the field; messages after the last assistant turn are dropped
  (nothing would be trained on them).

Content is a string, or a list of parts: `{type: text, text|value}` (parts joined as written),
`{type: reasoning|thinking, ...}` (the reply's reasoning trace) and `{type: tool_call, value}` (a
call, an object or JSON text). Any other part is refused naming its type.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prepack.text.conversation import Conversation, RecordError, ToolCall, Turn, trusted_conversation, trusted_turn
from prepack.text.formats.fields import Columns, RoleMap, describe, get_optional_str, require_nonblank
from prepack.text.formats.tools import read_call, read_calls_json, read_tools

__all__ = ["Pending", "MessageReader", "assemble", "read_list", "read_conversation", "messages_fit", "system_item",
           "AT_COLUMN", "MESSAGE_COLUMN"]

# Pending.index for a message that is not in a list: a column holding the text itself (a string
# side of prompt_completion or preference), or a column holding one message object.
AT_COLUMN, MESSAGE_COLUMN = -1, -2

_TEXT_KEYS = ("text", "value")
_REASONING_TYPES = frozenset({"reasoning", "thinking"})


@dataclass(slots=True)
class Pending:
    """One message after reading, before the conversation's rules. Where it is (`base`, `index`,
    the message keys) is kept as parts: the dotted field names are built only for an error."""

    role: str  # system, user, assistant or tool
    content: str | None  # None: the message has no text (allowed on a tool-calling reply)
    base: str  # the list's field ("conversations"), or the column itself for a string side
    index: int = AT_COLUMN  # the message's place in the list; AT_COLUMN / MESSAGE_COLUMN: `base` is the message
    keys: tuple[str, str] = ("", "")  # its role and content keys
    flag: bool | None = None  # train / loss_weight, when the message sets one
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    name: str | None = None
    tool_call_id: str | None = None
    trained_by_default: bool = True

    @property
    def path(self) -> str:
        """The message's field, as the record spells it ("conversations[3]")."""
        return self.base if self.index < 0 else f"{self.base}[{self.index}]"

    @property
    def role_field(self) -> str:
        return self.base if self.index == AT_COLUMN else f"{self.path}.{self.keys[0]}"

    @property
    def content_field(self) -> str:
        return self.base if self.index == AT_COLUMN else f"{self.path}.{self.keys[1]}"


def read_list(value: Any, path: str, what: str) -> Sequence[Any]:
    """A record's message list: an array (a JSON array, or a tuple from Arrow)."""
    if value is None:
        raise RecordError("missing_field", path, f"missing field '{path}': expected {what}")
    if not isinstance(value, (list, tuple)):
        raise RecordError("wrong_type", path, f"field '{path}': expected {what}, got {describe(value)}")
    if not value:
        raise RecordError("empty_messages", path, f"field '{path}': expected at least one message, got an empty array")
    return value


class MessageReader:
    """Reads message objects whose role and text sit under `role_key` and `content_key`."""

    def __init__(self, role_key: str, content_key: str, roles: RoleMap) -> None:
        self.role_key, self.content_key, self.roles = role_key, content_key, roles
        self._keys = (role_key, content_key)
        self._role_of = roles.table.get

    def read(self, messages: Sequence[Any], path: str, tool_names: frozenset[str],
             trained_by_default: bool = True) -> list[Pending]:
        return [self._message(m, path, i, tool_names, trained_by_default) for i, m in enumerate(messages)]

    def read_side(self, record: Mapping[str, Any], column: str, role: str, tool_names: frozenset[str],
                  trained_by_default: bool) -> list[Pending]:
        """One side of a prompt/completion record: a string (one `role` message), one message object,
        or a list of messages."""
        value = record.get(column)
        if isinstance(value, str):
            return [Pending(role, value, column, trained_by_default=trained_by_default)]
        if isinstance(value, Mapping):
            return [self._message(value, column, MESSAGE_COLUMN, tool_names, trained_by_default)]
        if value is not None and not isinstance(value, (list, tuple)):
            raise RecordError("wrong_type", column, f"field '{column}': expected a string, a message or a list of "
                              f"messages, got {describe(value)}")
        messages = read_list(value, column, "a string, a message or a list of messages")
        return self.read(messages, column, tool_names, trained_by_default)

    def _message(self, msg: Any, base: str, index: int, tool_names: frozenset[str], trained_by_default: bool) -> Pending:
        rk, ck = self._keys
        if msg.__class__ is not dict and not isinstance(msg, Mapping):
            path = base if index < 0 else f"{base}[{index}]"
            raise RecordError("wrong_type", path, f"field '{path}': expected a {{{rk}, {ck}}} object, got {describe(msg)}")
        raw_role = msg.get(rk)
        role = self._role_of(raw_role) if raw_role.__class__ is str or isinstance(raw_role, str) else None
        out = Pending(role, None, base, index, self._keys, trained_by_default=trained_by_default)  # type: ignore[arg-type]
        if role is None:
            self._bad_role(raw_role, out.role_field)
        raw = msg.get(ck)
        if role == "tool_call":  # ShareGPT's function_call turn: the value is the call itself
            if raw is None:
                raise RecordError("missing_field", out.content_field, f"missing field '{out.content_field}': expected "
                                  "the call as JSON {\"name\": ..., \"arguments\": ...}")
            out.role, out.content = "assistant", ""
            out.tool_calls = read_calls_json(raw, out.content_field, tool_names)
        elif raw.__class__ is str:
            out.content = raw
        elif isinstance(raw, (list, tuple)):
            self._parts(raw, out, tool_names)
        elif raw is not None:
            raise RecordError("wrong_type", out.content_field, f"field '{out.content_field}': expected a string or a "
                              f"list of content parts, got {describe(raw)}")
        if len(msg) > 2 or ck not in msg:  # the optional keys; a plain {role, content} message has none
            self._extras(msg, out, tool_names)
        return out

    def _bad_role(self, raw_role: Any, role_field: str) -> None:
        if raw_role is None:
            raise RecordError("missing_field", role_field, f"missing field '{role_field}': expected the message's role")
        if not isinstance(raw_role, str):
            raise RecordError("wrong_type", role_field, f"field '{role_field}': expected a string (the message's "
                              f"role), got {describe(raw_role)}")
        raise RecordError("bad_role", role_field, f"field '{role_field}': unknown role {raw_role!r}; known: "
                          f"{self.roles.known()}; map it with --roles, e.g. --roles assistant={raw_role}")

    def _parts(self, parts: Sequence[Any], out: Pending, tool_names: frozenset[str]) -> None:
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        for j, part in enumerate(parts):
            where = f"{out.content_field}[{j}]"
            if isinstance(part, str):  # a bare string part: text
                texts.append(part)
                continue
            if not isinstance(part, Mapping):
                raise RecordError("bad_content_part", where, f"field '{where}': expected a content part "
                                  f"{{type, text}}, got {describe(part)}")
            kind = part.get("type")
            if kind == "text":
                texts.append(_part_text(part, where, _TEXT_KEYS))
            elif kind in _REASONING_TYPES:
                if out.role != "assistant":
                    raise RecordError("bad_content_part", where, f"field '{where}': a {kind} part in a {out.role} "
                                      "message; only an assistant reply carries a reasoning trace")
                reasoning.append(_part_text(part, where, (*_TEXT_KEYS, kind)))
            elif kind == "tool_call":
                if out.role != "assistant":
                    raise RecordError("bad_content_part", where, f"field '{where}': a tool_call part in a {out.role} "
                                      "message; only an assistant reply makes calls")
                if "value" not in part:
                    raise RecordError("bad_content_part", where, f"field '{where}.value': missing; expected the call")
                calls.extend(read_calls_json(part["value"], f"{where}.value", tool_names))
            else:
                raise RecordError("bad_content_part", f"{where}.type", f"field '{where}.type': unknown content part "
                                  f"type {describe(kind)}; expected text, reasoning, thinking or tool_call")
        out.content = "".join(texts)
        if reasoning:
            out.reasoning = "".join(reasoning)
        out.tool_calls = tuple(calls)

    def _extras(self, msg: Mapping[str, Any], out: Pending, tool_names: frozenset[str]) -> None:
        """tool_calls, reasoning_content, name, tool_call_id and the training flags."""
        path = out.path
        calls = msg.get("tool_calls")
        if calls is not None:
            if out.role != "assistant":
                raise RecordError("bad_tool_call", f"{path}.tool_calls", f"field '{path}.tool_calls': tool calls in a "
                                  f"{out.role} message; only an assistant reply makes calls")
            if not isinstance(calls, (list, tuple)):
                raise RecordError("bad_tool_call", f"{path}.tool_calls", f"field '{path}.tool_calls': expected a list "
                                  f"of calls, got {describe(calls)}")
            out.tool_calls += tuple(read_call(c, f"{path}.tool_calls[{i}]", tool_names) for i, c in enumerate(calls))
        if "reasoning_content" in msg and msg["reasoning_content"] is not None:
            trace = get_optional_str(msg, "reasoning_content", f"{path}.reasoning_content", "the reply's reasoning trace")
            if out.role != "assistant":
                raise RecordError("wrong_type", f"{path}.reasoning_content", f"field '{path}.reasoning_content': only "
                                  f"an assistant reply carries a reasoning trace, this is a {out.role} message")
            if out.reasoning is not None and trace:
                raise RecordError("wrong_type", f"{path}.reasoning_content", f"field '{path}.reasoning_content': the "
                                  "message also has a reasoning part; give the trace once")
            out.reasoning = trace if trace else out.reasoning
        if out.role == "tool":
            out.name = _optional_id(msg, "name", path)
            out.tool_call_id = _optional_id(msg, "tool_call_id", path)
        out.flag = _flag(msg, out)


def _part_text(part: Mapping[str, Any], where: str, keys: tuple[str, ...]) -> str:
    for key in keys:
        value = part.get(key)
        if isinstance(value, str):
            return value
    raise RecordError("bad_content_part", where, f"field '{where}': a {part.get('type')} part without its text "
                      f"(expected a string under {' or '.join(repr(k) for k in keys)})")


def _optional_id(msg: Mapping[str, Any], key: str, path: str) -> str | None:
    value = msg.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RecordError("wrong_type", f"{path}.{key}", f"field '{path}.{key}': expected a string or null, got {describe(value)}")
    return value


def _flag(msg: Mapping[str, Any], out: Pending) -> bool | None:
    """train: true|false, or loss_weight: 0|1 (also 0.0/1.0); None when the message sets neither."""
    found: list[tuple[str, bool]] = []
    if "train" in msg and msg["train"] is not None:
        value = msg["train"]
        if value is not True and value is not False:
            raise RecordError("bad_train_flag", f"{out.path}.train", f"field '{out.path}.train': expected true or "
                              f"false, got {describe(value)}")
        found.append(("train", value))
    if "loss_weight" in msg and msg["loss_weight"] is not None:
        value = msg["loss_weight"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value not in (0, 1):
            raise RecordError("bad_train_flag", f"{out.path}.loss_weight", f"field '{out.path}.loss_weight': expected "
                              f"0 or 1 (or 0.0/1.0), got {describe(value)}")
        found.append(("loss_weight", value == 1))
    if not found:
        return None
    if len(found) == 2 and found[0][1] != found[1][1]:
        raise RecordError("bad_train_flag", f"{out.path}.loss_weight", f"field '{out.path}.loss_weight' says "
                          f"{int(found[1][1])} but '{out.path}.train' says {str(found[0][1]).lower()}; give one")
    key, trained = found[-1]
    if trained and out.role != "assistant":
        raise RecordError("bad_train_flag", f"{out.path}.{key}", f"field '{out.path}.{key}': marks a {out.role} message "
                          "trained; only assistant replies are trained (0 or false is fine anywhere)")
    return trained


def assemble(items: Sequence[Pending], tools: tuple[Any, ...], messages_field: str) -> Conversation:
    """The conversation's rules (see the module docstring) over read messages, in order."""
    turns: list[Turn] = []
    loss: list[int] = []
    seen_user = False
    open_calls = 0
    last_assistant = -1
    for k, m in enumerate(items):
        role = m.role
        if role == "system":
            if k != 0:
                raise RecordError("system_not_first", m.role_field, f"field '{m.role_field}': a system message is only "
                                  f"allowed as the first message, found at index {k}")
            text = _text(m, "the system prompt")
            if text.strip():
                turns.append(trusted_turn("system", text))
            continue
        if role == "user":
            text = _text(m, "the user's message")
            require_nonblank(text, "empty_prompt", m.content_field, "user message text")
            turns.append(trusted_turn("user", text))
            seen_user, open_calls = True, 0
            continue
        if role == "tool":
            if open_calls == 0:
                raise RecordError("orphan_tool_result", m.role_field, f"field '{m.role_field}': a tool result with no "
                                  "tool call before it to answer")
            open_calls -= 1
            turns.append(trusted_turn("tool", _text(m, "the tool's result"), name=m.name, tool_call_id=m.tool_call_id))
            continue
        if not seen_user:  # an assistant before any user message
            raise RecordError("assistant_first", m.role_field, f"field '{m.role_field}': expected the first non-system "
                              "message to be from the user, got an assistant message")
        text = m.content if m.content is not None else ""
        if not m.tool_calls:
            if m.content is None:
                raise RecordError("missing_field", m.content_field, f"missing field '{m.content_field}': expected the "
                                  "assistant's reply (or tool calls)")
            require_nonblank(text, "empty_response", m.content_field, "assistant message text")
        reasoning = m.reasoning if m.reasoning is not None and m.reasoning.strip() else None
        turns.append(trusted_turn("assistant", text, reasoning, m.tool_calls))
        open_calls = len(m.tool_calls)
        last_assistant = len(turns) - 1
        if m.flag if m.flag is not None else m.trained_by_default:
            loss.append(last_assistant)
    if last_assistant < 0:
        roles = [t.role for t in turns]
        raise RecordError("no_assistant_turn", messages_field, f"field '{messages_field}': expected at least one "
                          f"assistant message, got roles {roles}")
    if not loss:
        raise RecordError("no_trained_turn", messages_field, f"field '{messages_field}': every assistant message is "
                          "marked untrained (train: false / loss_weight: 0), so there is nothing to train")
    return trusted_conversation(tuple(turns[: last_assistant + 1]), tuple(loss), tuple(tools))


def _text(m: Pending, what: str) -> str:
    if m.content is None:
        raise RecordError("missing_field", m.content_field, f"missing field '{m.content_field}': expected a string ({what})")
    return m.content


def read_conversation(record: Mapping[str, Any], cols: Columns, reader: MessageReader, what: str) -> Conversation:
    """The message formats' one path: tools, the optional system column, the messages, the rules."""
    key = cols["messages"]
    messages = read_list(record.get(key), key, what)
    tools_key = cols["tools"]
    tools, names = read_tools(record.get(tools_key), tools_key)
    items = reader.read(messages, key, names)
    system = record.get(cols["system"])
    if system is not None:
        items.insert(0, system_item(system, cols["system"]))
    return assemble(items, tools, key)


def messages_fit(record: Mapping[str, Any], cols: Columns) -> bool:
    """Whether a record holds a message list whose messages have the role key (--format auto)."""
    messages = record.get(cols["messages"])
    if not isinstance(messages, (list, tuple)) or not messages:
        return False
    first = messages[0]
    return isinstance(first, Mapping) and cols["role"] in first


def system_item(value: Any, key: str) -> Pending:
    """A format's `system` column as the conversation's first (system) message."""
    if not isinstance(value, str):
        raise RecordError("wrong_type", key, f"field '{key}': expected a string (the system prompt) or null, "
                          f"got {describe(value)}")
    return Pending("system", value, key)
