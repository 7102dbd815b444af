"""What the single-turn source formats share: one user turn, one target reply, built without
validation (the format checked both texts), and `to_pair` for the tokenizer's fast path."""
from __future__ import annotations

from prepack.text.conversation import Conversation, Turn

__all__ = ["single_turn"]

_set_attr = object.__setattr__
_SINGLE_TURN_LOSS = (1,)


def _trusted_turn(role: str, content: str) -> Turn:
    # Turn(role, content) without __post_init__: callers pass a valid role and a str.
    turn = object.__new__(Turn)
    _set_attr(turn, "role", role)
    _set_attr(turn, "content", content)
    _set_attr(turn, "reasoning", None)
    _set_attr(turn, "tool_calls", ())
    _set_attr(turn, "name", None)
    _set_attr(turn, "tool_call_id", None)
    return turn


def single_turn(prompt: str, response: str) -> list[Conversation]:
    """Conversation((Turn("user", prompt), Turn("assistant", response)), (1,)) without the
    validation, which cannot fail for this fixed shape: this runs once per example."""
    conv = object.__new__(Conversation)
    _set_attr(conv, "turns", (_trusted_turn("user", prompt), _trusted_turn("assistant", response)))
    _set_attr(conv, "loss_turns", _SINGLE_TURN_LOSS)
    _set_attr(conv, "tools", ())
    return [conv]
