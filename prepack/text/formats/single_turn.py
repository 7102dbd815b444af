"""What the single-turn source formats share: one user turn, one target reply, built without
validation (the format checked both texts), and `to_pair` for the tokenizer's fast path."""
from __future__ import annotations

from prepack.text.conversation import Conversation, trusted_conversation, trusted_turn

__all__ = ["single_turn"]

_SINGLE_TURN_LOSS = (1,)


def single_turn(prompt: str, response: str) -> list[Conversation]:
    """Conversation((Turn("user", prompt), Turn("assistant", response)), (1,)) without the
    validation, which cannot fail for this fixed shape: this runs once per example."""
    return [trusted_conversation((trusted_turn("user", prompt), trusted_turn("assistant", response)), _SINGLE_TURN_LOSS)]
