"""Source formats (`--format`): one record of a dataset -> the examples it holds.

One format per module; each is a frozen dataclass whose fields are its options (strings, as
`--source-lang` or a mixture source's `columns:` give them), with `to_conversations(record)`
returning `Conversation`s or `Document`s (prepack/text/conversation.py). Formats look only at a
record's structure: the same record renders for any tokenizer and chat format.

A run resolves each source's format once, when it is planned (`--format auto` from the first
records): a `ResolvedFormat`, plain data that travels to the workers, which build from it.

Bad records raise `RecordError` with a stable `reason` and the field as the record spells it.
`oasst1` is table-level: its records are messages of a tree, templated together.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Protocol, Sequence, cast

from prepack.text.conversation import Conversation, Document, PreferencePair, RecordError
from prepack.text.formats.alpaca import AlpacaTemplate
from prepack.text.formats.chat import ChatTemplate
from prepack.text.formats.features import Oasst1Result, PromptResponseReader, SourceFormat
from prepack.text.formats.oasst1 import Oasst1Template
from prepack.text.formats.preference import PreferenceTemplate
from prepack.text.formats.prompt_completion import PromptCompletionTemplate
from prepack.text.formats.prompt_response import PromptResponseTemplate
from prepack.text.formats.sharegpt import ShareGPTTemplate
from prepack.text.formats.text import TextTemplate
from prepack.text.formats.translation import TranslationTemplate

__all__ = ["Template", "ResolvedFormat", "get_template", "template_names", "template_class", "RecordError"]


class Template(Protocol):
    """What the pipeline needs from a source format: every feature a caller may ask of one.
    Each format inherits the features it lacks from SourceFormat (features.py), which says what
    each means."""

    name: str
    table_level: bool
    group_key: str | None
    yields_preference: bool
    COLUMNS: Mapping[str, str]
    same_reader_as: str | None

    def to_conversations(self, record: Mapping[str, Any]) -> Sequence[Conversation | Document | PreferencePair]: ...

    def prompt_response_reader(self) -> PromptResponseReader | None: ...

    def conversations_from_table(self, messages: Iterable[Mapping[str, Any]]) -> Oasst1Result: ...


_REGISTRY: dict[str, type[SourceFormat]] = {
    "alpaca": AlpacaTemplate,
    "translation": TranslationTemplate,
    "prompt_response": PromptResponseTemplate,
    "prompt_completion": PromptCompletionTemplate,
    "preference": PreferenceTemplate,
    "chat": ChatTemplate,
    "sharegpt": ShareGPTTemplate,
    "text": TextTemplate,
    "oasst1": Oasst1Template,
}


def template_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def template_class(name: str) -> type[SourceFormat]:
    """The format registered as `name`; ValueError naming the accepted ones."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown source format {name!r}; expected one of {', '.join(template_names())}")
    return cls


def get_template(name: str, **options: Any) -> Template:
    """The format registered as `name`, built with `options` (translation: source_lang,
    target_lang, prompt_format; every format but oasst1: columns; message formats: roles).
    Raises ValueError for an unknown name, option or mapping, naming what is accepted."""
    cls = template_class(name)
    accepted = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"source format {name!r} does not take option(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(accepted) if accepted else 'none'}"
        )
    return cast(Template, cls(**options))  # each registered class adds to_conversations to SourceFormat


@dataclasses.dataclass(frozen=True)
class ResolvedFormat:
    """A source's format as the run's plan settles it: a registered name (never `auto`) and the
    options it is built with. Plain data, so it pickles small to the workers; each builds its
    format from it (`build`) instead of looking at the records again."""

    name: str
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def checked(cls, name: str, options: Mapping[str, str] | Iterable[tuple[str, str]] = ()) -> "ResolvedFormat":
        """The format `name` with `options`, built once to check them: ValueError (one line, as
        get_template says it) for an unknown name, option or mapping."""
        resolved = cls(name, tuple(sorted(dict(options).items())))
        resolved.build()
        return resolved

    def build(self) -> Template:
        return get_template(self.name, **dict(self.options))

    @property
    def features(self) -> type[SourceFormat]:
        """The format's class: its declared features (table_level, group_key, yields_preference,
        ...) without building it."""
        return template_class(self.name)
