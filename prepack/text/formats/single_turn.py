"""What the single-turn source formats share: one user turn, one target reply, built without
validation (the format checked both texts), and `to_pair` for the tokenizer's fast path."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Mapping

from prepack.text.conversation import Conversation, trusted_conversation, trusted_turn
from prepack.text.formats.features import PromptResponseReader, SourceFormat

__all__ = ["SingleTurnFormat", "single_turn"]

_SINGLE_TURN_LOSS = (1,)


def single_turn(prompt: str, response: str) -> list[Conversation]:
    """Conversation((Turn("user", prompt), Turn("assistant", response)), (1,)) without the
    validation, which cannot fail for this fixed shape: this runs once per example."""
    return [trusted_conversation((trusted_turn("user", prompt), trusted_turn("assistant", response)), _SINGLE_TURN_LOSS)]


class SingleTurnFormat(SourceFormat, ABC):
    """A format whose every record is one user prompt and one reply: `to_pair` reads it, and
    to_conversations is the same example as a Conversation."""

    @abstractmethod
    def to_pair(self, record: Mapping[str, Any]) -> tuple[str, str]:
        """(prompt, response) of the one example; the same checks and errors as to_conversations."""

    def to_conversations(self, record: Mapping[str, Any]) -> list[Conversation]:
        return single_turn(*self.to_pair(record))

    def prompt_response_reader(self) -> PromptResponseReader | None:
        return self.to_pair
