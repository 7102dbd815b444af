"""Format `sharegpt`: {conversations: [{from, value}], system?, tools?}, the most common chat schema
on the Hugging Face Hub (LLaMA-Factory's and axolotl's `sharegpt`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from prepack.text.conversation import Conversation
from prepack.text.formats.chat import messages_fit, read_conversation
from prepack.text.formats.fields import Columns, RoleMap, check_record
from prepack.text.formats.messages import MessageReader


@dataclass(frozen=True)
class ShareGPTTemplate:
    """{conversations: [{from, value}, ...], system?, tools?}. Roles as published: human (user),
    gpt (assistant), system, function_call (an assistant tool call whose value is JSON: one
    {name, arguments} object, or a list of them for parallel calls) and observation (a tool's
    result), plus every spelling the `chat` format reads (prepack/text/formats/fields.py). The
    messages are read and checked as in `chat`; `columns` and `roles` map other spellings."""

    columns: str = ""
    roles: str = ""

    name: ClassVar[str] = "sharegpt"
    # `chat` under other default names: where --columns make the two read the same keys, they are one.
    same_reader_as: ClassVar[str] = "chat"
    table_level: ClassVar[bool] = False
    COLUMNS: ClassVar[dict[str, str]] = {"messages": "conversations", "role": "from", "content": "value",
                                         "tools": "tools", "system": "system"}

    def __post_init__(self) -> None:
        cols = Columns(self.columns, self.COLUMNS, self.name)
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
