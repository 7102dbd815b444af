"""Format `prompt_completion`: TRL's {prompt, completion}, as strings or as message lists."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from prepack.text.conversation import Conversation, RecordError
from prepack.text.formats.features import SourceFormat
from prepack.text.formats.fields import Columns, RequiredColumns, RoleMap, check_record
from prepack.text.formats.messages import MessageReader, Pending, assemble, system_item
from prepack.text.formats.tools import read_tools


@dataclass(frozen=True)
class PromptCompletionTemplate(SourceFormat, RequiredColumns):
    """{prompt, completion, system?, tools?}. Each side is a string (one user turn; one assistant
    reply), one message object, or a list of messages (as in `chat`). What is trained: the completion's assistant
    turns; the prompt's assistant turns are context, unless a message's flag says otherwise.
    Unlike TRL's plain-string prompt-completion (concatenated with no chat markup), both sides go
    through the chat format, as every format here does."""

    columns: str = ""
    roles: str = ""

    name: ClassVar[str] = "prompt_completion"
    COLUMNS: ClassVar[dict[str, str]] = {"prompt": "prompt", "completion": "completion", "role": "role",
                                         "content": "content", "tools": "tools", "system": "system"}

    def __post_init__(self) -> None:
        cols = Columns(self.columns, self.COLUMNS, self.name)
        object.__setattr__(self, "_cols", cols)
        object.__setattr__(self, "_reader", MessageReader(cols["role"], cols["content"], RoleMap(self.roles)))
        object.__setattr__(self, "_required", (cols["prompt"], cols["completion"]))

    def to_conversations(self, record: Mapping[str, Any]) -> list[Conversation]:
        record = check_record(record)
        cols = self._cols  # type: ignore[attr-defined]
        tools, names = read_tools(record.get(cols["tools"]), cols["tools"])
        items: list[Pending] = []
        system = record.get(cols["system"])
        if system is not None:
            items.append(system_item(system, cols["system"]))
        reader = self._reader  # type: ignore[attr-defined]
        items += reader.read_side(record, cols["prompt"], "user", names, trained_by_default=False)
        completion = reader.read_side(record, cols["completion"], "assistant", names, trained_by_default=True)
        if not any(m.role == "assistant" for m in completion):
            raise RecordError("no_assistant_turn", cols["completion"], f"field '{cols['completion']}': expected at "
                              "least one assistant message")
        return [assemble(items + completion, tools, cols["completion"])]
