"""Format `chat`: the OpenAI / Hugging Face message schema, {messages, tools?}."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from prepack.text.conversation import Conversation
from prepack.text.formats.fields import Columns, RoleMap, check_record
from prepack.text.formats.messages import MessageReader, Pending, assemble, read_list
from prepack.text.formats.tools import read_tools


@dataclass(frozen=True)
class ChatTemplate:
    """{messages: [{role, content}, ...], tools?}: trains every assistant turn unless a message's
    flag says otherwise (prepack/text/formats/messages.py has the rules). Messages follow the
    OpenAI / Hugging Face schema: roles system (or developer), user, assistant (or model) and tool;
    an assistant message may carry `tool_calls` and `reasoning_content`; content is a string or a
    list of parts. `tools` is a list of function schemas or a JSON string of one. An optional
    `system` column is the system prompt. `columns` and `roles` map other spellings
    (`--columns messages=dialog,role=speaker,content=text`, `--roles assistant=bot`)."""

    columns: str = ""
    roles: str = ""

    name: ClassVar[str] = "chat"
    table_level: ClassVar[bool] = False
    COLUMNS: ClassVar[dict[str, str]] = {"messages": "messages", "role": "role", "content": "content",
                                         "tools": "tools", "system": "system"}

    def __post_init__(self) -> None:
        cols = Columns(self.columns, self.COLUMNS, self.name)  # a subclass's own defaults (sharegpt)
        object.__setattr__(self, "_cols", cols)
        object.__setattr__(self, "_reader", MessageReader(cols["role"], cols["content"], RoleMap(self.roles)))

    def keys(self) -> frozenset[str]:
        """The columns a record must have to be in this format (for --format auto)."""
        return frozenset((self._cols["messages"],))  # type: ignore[attr-defined]

    def fits(self, record: Mapping[str, Any]) -> bool:
        return messages_fit(record, self._cols)  # type: ignore[attr-defined]

    def to_conversations(self, record: Mapping[str, Any]) -> list[Conversation]:
        cols = self._cols  # type: ignore[attr-defined]
        return [read_conversation(check_record(record), cols, self._reader,  # type: ignore[attr-defined]
                                  f"an array of {{{cols['role']}, {cols['content']}}} objects")]


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
    from prepack.text.conversation import RecordError
    from prepack.text.formats.fields import describe

    if not isinstance(value, str):
        raise RecordError("wrong_type", key, f"field '{key}': expected a string (the system prompt) or null, "
                          f"got {describe(value)}")
    return Pending("system", value, key)
