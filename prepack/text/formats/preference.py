"""Format `preference`: TRL's {prompt, chosen, rejected}, two replies to one prompt, for DPO."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from prepack.text.conversation import PreferencePair, RecordError
from prepack.text.formats.features import SourceFormat
from prepack.text.formats.fields import Columns, RequiredColumns, RoleMap, check_record
from prepack.text.formats.messages import MessageReader, Pending, assemble, system_item
from prepack.text.formats.tools import read_tools


@dataclass(frozen=True)
class PreferenceTemplate(SourceFormat, RequiredColumns):
    """{prompt, chosen, rejected, system?, tools?}. The prompt is a string (one user turn) or a
    message list; each completion a string (one reply), one assistant message, or a list of
    messages, read as in `chat` (tool calls, parts and flags included). The two sides share the
    prompt; each trains its own completion. A pair whose sides are the same completion
    (`identical_sides`), or with an empty side, is a dead letter. Other schemas through `columns`
    and `roles`: a ranking file {conversations: [{from, value}], chosen: {from, value}, rejected:
    {from, value}} reads with columns prompt=conversations,role=from,content=value and roles
    user=human,assistant=gpt (the last two are default spellings already)."""

    columns: str = ""
    roles: str = ""

    name: ClassVar[str] = "preference"
    yields_preference: ClassVar[bool] = True  # each record one PreferencePair: a packing unit of two segments
    COLUMNS: ClassVar[dict[str, str]] = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "role": "role",
                                         "content": "content", "tools": "tools", "system": "system"}

    def __post_init__(self) -> None:
        cols = Columns(self.columns, self.COLUMNS, self.name)
        object.__setattr__(self, "_cols", cols)
        object.__setattr__(self, "_reader", MessageReader(cols["role"], cols["content"], RoleMap(self.roles)))
        object.__setattr__(self, "_required", (cols["prompt"], cols["chosen"], cols["rejected"]))

    def to_conversations(self, record: Mapping[str, Any]) -> list[PreferencePair]:
        record = check_record(record)
        cols = self._cols  # type: ignore[attr-defined]
        reader: MessageReader = self._reader  # type: ignore[attr-defined]
        tools, names = read_tools(record.get(cols["tools"]), cols["tools"])
        head: list[Pending] = []
        system = record.get(cols["system"])
        if system is not None:
            head.append(system_item(system, cols["system"]))
        head += reader.read_side(record, cols["prompt"], "user", names, trained_by_default=False)
        sides = []
        for key in ("chosen", "rejected"):
            side = reader.read_side(record, cols[key], "assistant", names, trained_by_default=True)
            if not any(m.role == "assistant" for m in side):
                raise RecordError("no_assistant_turn", cols[key], f"field '{cols[key]}': expected an assistant reply")
            sides.append(side)
        if _completion(sides[0]) == _completion(sides[1]):
            raise RecordError("identical_sides", cols["rejected"], f"field '{cols['rejected']}': the same completion as "
                              f"'{cols['chosen']}', so the pair teaches nothing")
        chosen = assemble(head + sides[0], tools, cols["chosen"])
        rejected = assemble(head + sides[1], tools, cols["rejected"])
        shared = sum(1 for m in head if m.role != "system" or (m.content or "").strip())  # assemble drops a blank system
        return [PreferencePair(chosen, rejected, shared)]


def _completion(side: list[Pending]) -> list[tuple[Any, ...]]:
    """What a side says, to tell identical sides: each message's role, text, trace and calls."""
    return [(m.role, m.content, m.reasoning, tuple((c.name, c.arguments_text) for c in m.tool_calls)) for m in side]
