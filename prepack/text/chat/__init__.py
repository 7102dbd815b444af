"""Chat formats (`--chat-format`): an example -> token ids and a loss mask, one format per module.

gemma (Gemma's template), chatml (ChatML, with Qwen3's tool layout), qwen3 (ChatML as Qwen3's
template writes it, think blocks included), hf (the tokenizer's own jinja template), and auto.
prepack/text/chat/base.py has the segment model and the loss rule every format follows;
tool_calls.py reads the calls of generated text back in the layout a format wrote them.
"""
from prepack.text.chat.base import (CHAT_FORMAT_ERROR_REASONS, ChatFormat, ChatFormatError, PromptResponseLayout, Segment,
                                    TokenizedExample)
from prepack.text.chat.batch import (tokenize_conversations, tokenize_conversations_flat, tokenize_prompt_responses_flat,
                                     tokenize_preference_pairs)
from prepack.text.chat.chatml import ChatMLFormat
from prepack.text.chat.gemma import GemmaFormat
from prepack.text.chat.hf import HFTemplateFormat
from prepack.text.chat.qwen3 import Qwen3Format
from prepack.text.chat.registry import chat_format_names, get_chat_format

__all__ = [
    "TokenizedExample", "ChatFormatError", "CHAT_FORMAT_ERROR_REASONS", "ChatFormat", "GemmaFormat", "ChatMLFormat",
    "Qwen3Format", "HFTemplateFormat", "get_chat_format", "chat_format_names", "tokenize_conversations",
    "tokenize_conversations_flat", "PromptResponseLayout", "Segment", "tokenize_prompt_responses_flat", "tokenize_preference_pairs",
]
