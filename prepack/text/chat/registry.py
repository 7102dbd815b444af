"""Chat formats by name (`--chat-format`), and `auto`: the one the tokenizer calls for."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from prepack.text.chat.base import ChatFormat, ChatFormatError
from prepack.text.chat.chatml import ChatMLFormat
from prepack.text.chat.gemma import GemmaFormat
from prepack.text.chat.hf import HFTemplateFormat
from prepack.text.chat.qwen3 import Qwen3Format

if TYPE_CHECKING:
    from prepack.text.tokenizer import Tokenizer

__all__ = ["get_chat_format", "chat_format_names"]

_FORMATS: dict[str, Callable[..., ChatFormat]] = {
    "gemma": GemmaFormat,
    "chatml": ChatMLFormat,
    "qwen3": Qwen3Format,
    "hf": HFTemplateFormat,
}


def chat_format_names() -> tuple[str, ...]:
    return (*_FORMATS, "auto")


def get_chat_format(name: str, tokenizer: "Tokenizer", train_reasoning: bool = True) -> ChatFormat:
    """Build chat format `name` for `tokenizer`.

    auto: 'hf' if the tokenizer has a chat template, else 'gemma' if it has
    <start_of_turn>, else 'qwen3' if it has <|im_start|>, <think> and </think>, else 'chatml'
    if it has <|im_start|>, else ChatFormatError.
    """
    if name == "auto":
        if getattr(tokenizer, "chat_template", None):
            return HFTemplateFormat(tokenizer)
        if tokenizer.token_to_id("<start_of_turn>") is not None:
            return GemmaFormat(tokenizer)
        if tokenizer.token_to_id("<|im_start|>") is not None:
            if all(tokenizer.token_to_id(t) is not None for t in ("<think>", "</think>")):
                return Qwen3Format(tokenizer, train_reasoning)
            return ChatMLFormat(tokenizer)
        raise ChatFormatError(
            "no_format_detected",
            f"chat format 'auto': tokenizer {getattr(tokenizer, 'name', '?')!r} has no chat template and neither "
            f"<start_of_turn> (gemma) nor <|im_start|> (chatml); choose a tokenizer with a chat template",
        )
    factory = _FORMATS.get(name)
    if factory is None:
        raise ChatFormatError("unknown_chat_format", f"unknown chat format {name!r}; expected one of {', '.join(chat_format_names())}")
    return Qwen3Format(tokenizer, train_reasoning) if factory is Qwen3Format else factory(tokenizer)
