"""What a source format says of itself beyond `to_conversations`: every feature a caller may ask
of a format, declared once with the value a format has when it lacks the feature, so callers
read the member instead of probing for it (prepack/text/formats/__init__.py: `Template`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Iterable, Mapping

from prepack.text.conversation import Conversation

__all__ = ["DroppedMessage", "Oasst1Result", "PromptResponseReader", "SourceFormat"]

# A single-turn record -> (prompt, response), with the same checks and errors as to_conversations.
PromptResponseReader = Callable[[Mapping[str, Any]], tuple[str, str]]


# What a table-level format makes of one table (oasst1.py: the only one, hence the names).
@dataclass(frozen=True, slots=True)
class DroppedMessage:
    message_id: str | None
    message_tree_id: str | None
    reason: str   # one of oasst1.OASST1_DROP_REASONS
    detail: str   # human-readable explanation


@dataclass
class Oasst1Result:
    examples: list[tuple[Conversation, str]]   # (conversation, example_id = assistant message_id)
    dropped: list[DroppedMessage] = field(default_factory=list)


class SourceFormat:
    """The features every format has, at the values of a format that lacks them; a format
    overrides the ones it has."""

    name: ClassVar[str]
    # True: a record is one part of a table (oasst1's messages), templated with the records that
    # share its `group_key`; such a format offers conversations_from_table instead.
    table_level: ClassVar[bool] = False
    group_key: ClassVar[str | None] = None
    # True: each record is one PreferencePair (a preference set), a packing unit of two segments (rows of format 5 or 6).
    yields_preference: ClassVar[bool] = False
    # Canonical field -> the format's own column name: what --columns may rename (empty: no columns).
    COLUMNS: ClassVar[Mapping[str, str]] = MappingProxyType({})
    # The format this one reads as, once --columns give both the same names (--format auto keeps one).
    same_reader_as: ClassVar[str | None] = None

    def prompt_response_reader(self) -> PromptResponseReader | None:
        """How to read a record as one (prompt, response) without building Conversations, for the
        chat format's tokenize_prompt_responses_flat; None: the records are not single-turn."""
        return None

    def conversations_from_table(self, messages: Iterable[Mapping[str, Any]]) -> Oasst1Result:
        """The examples of one table's records (those sharing a `group_key`), for a table-level
        format; any other format templates its records one by one."""
        raise TypeError(f"format {self.name!r} is not table-level: template its records one by one with to_conversations")
