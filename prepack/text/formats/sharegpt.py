"""Format `sharegpt`: {conversations: [{from, value}], system?, tools?}, the most common chat schema
on the Hugging Face Hub (LLaMA-Factory's and axolotl's `sharegpt`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from prepack.text.formats.chat import ChatTemplate


@dataclass(frozen=True)
class ShareGPTTemplate(ChatTemplate):
    """{conversations: [{from, value}, ...], system?, tools?}. Roles as published: human (user),
    gpt (assistant), system, function_call (an assistant tool call whose value is JSON: one
    {name, arguments} object, or a list of them for parallel calls) and observation (a tool's
    result), plus every spelling the `chat` format reads (prepack/text/formats/fields.py). It is
    `chat` under other default names: the messages are read and checked as there, and `columns`
    and `roles` map other spellings."""

    name: ClassVar[str] = "sharegpt"
    # Where --columns make the two read the same keys, they are one format (--format auto).
    same_reader_as: ClassVar[str | None] = "chat"
    COLUMNS: ClassVar[dict[str, str]] = {"messages": "conversations", "role": "from", "content": "value",
                                         "tools": "tools", "system": "system"}
