"""Format `text`: {text}, a plain document for continued pretraining."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from prepack.text.conversation import Document
from prepack.text.formats.features import SourceFormat
from prepack.text.formats.fields import Columns, check_record, get_str, require_nonblank


@dataclass(frozen=True)
class TextTemplate(SourceFormat):
    """{text}: one document, no chat markup. Every token is a target except each segment's first
    (the row rule for every segment); the document ends with the tokenizer's eos, which is trained.
    A document longer than the max length follows --overlong: `split` keeps all of it, in pieces."""

    columns: str = ""

    name: ClassVar[str] = "text"
    COLUMNS: ClassVar[dict[str, str]] = {"text": "text"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key", Columns(self.columns, self.COLUMNS, self.name)["text"])

    def keys(self) -> frozenset[str]:
        """The columns a record must have to be in this format (for --format auto)."""
        return frozenset((self._key,))  # type: ignore[attr-defined]

    def fits(self, record: Mapping[str, Any]) -> bool:
        return isinstance(record.get(self._key), str)  # type: ignore[attr-defined]

    def to_conversations(self, record: Mapping[str, Any]) -> list[Document]:
        key = self._key  # type: ignore[attr-defined]
        text = get_str(check_record(record), key, key, "the document's text")
        require_nonblank(text, "empty_text", key, "text")
        return [Document(text)]
