"""Format `chat`: the OpenAI / Hugging Face message schema, {messages, tools?}."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from prepack.text.conversation import Conversation
from prepack.text.formats.features import SourceFormat
from prepack.text.formats.fields import Columns, RoleMap, check_record
from prepack.text.formats.messages import MessageReader, messages_fit, read_conversation


@dataclass(frozen=True)
class ChatTemplate(SourceFormat):
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
    COLUMNS: ClassVar[dict[str, str]] = {"messages": "messages", "role": "role", "content": "content",
                                         "tools": "tools", "system": "system"}

    def __post_init__(self) -> None:
        cols = Columns(self.columns, self.COLUMNS, self.name)  # a subclass's own defaults (sharegpt)
        object.__setattr__(self, "_cols", cols)
        object.__setattr__(self, "_reader", MessageReader(cols["role"], cols["content"], RoleMap(self.roles)))

    @property
    def column_names(self) -> Columns:
        """Where this format reads each canonical field, --columns applied (--format auto tells
        sharegpt from chat by it)."""
        return self._cols  # type: ignore[attr-defined]

    def keys(self) -> frozenset[str]:
        """The columns a record must have to be in this format (for --format auto)."""
        return frozenset((self._cols["messages"],))  # type: ignore[attr-defined]

    def fits(self, record: Mapping[str, Any]) -> bool:
        return messages_fit(record, self._cols)  # type: ignore[attr-defined]

    def to_conversations(self, record: Mapping[str, Any]) -> list[Conversation]:
        cols = self._cols  # type: ignore[attr-defined]
        return [read_conversation(check_record(record), cols, self._reader,  # type: ignore[attr-defined]
                                  f"an array of {{{cols['role']}, {cols['content']}}} objects")]
