"""Format `translation`: OPUS-100 style {"translation": {src: ..., tgt: ...}} or flat {src: ..., tgt: ...}."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from prepack.text.conversation import RecordError
from prepack.text.formats.fields import Columns, check_record, describe, get_str, require_nonblank
from prepack.text.formats.single_turn import SingleTurnFormat

# ISO 639-1 codes -> English names used in the translation instruction. Small on purpose:
# unknown codes fall back to the code itself, which still makes a readable prompt.
LANGUAGE_NAMES: dict[str, str] = {
    "ar": "Arabic", "bg": "Bulgarian", "ca": "Catalan", "cs": "Czech", "da": "Danish",
    "de": "German", "el": "Greek", "en": "English", "es": "Spanish", "et": "Estonian",
    "fa": "Persian", "fi": "Finnish", "fr": "French", "he": "Hebrew", "hi": "Hindi",
    "hr": "Croatian", "hu": "Hungarian", "id": "Indonesian", "it": "Italian", "ja": "Japanese",
    "ko": "Korean", "lt": "Lithuanian", "lv": "Latvian", "nl": "Dutch", "no": "Norwegian",
    "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian", "sk": "Slovak",
    "sl": "Slovenian", "sr": "Serbian", "sv": "Swedish", "th": "Thai", "tr": "Turkish",
    "uk": "Ukrainian", "vi": "Vietnamese", "zh": "Chinese",
}

DEFAULT_TRANSLATION_PROMPT = "Translate the following text from {source} to {target}.\n\n{text}"


def language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code.lower(), code)


@dataclass(frozen=True)
class TranslationTemplate(SingleTurnFormat):
    """OPUS-100 style {"translation": {src: ..., tgt: ...}} or flat {src: ..., tgt: ...}.

    Options: source_lang (default "en"), target_lang (default "fr"), prompt_format (a
    str.format string with {source}, {target} = language names and {text} = source text),
    columns (renames the `translation` column).
    """

    source_lang: str = "en"
    target_lang: str = "fr"
    prompt_format: str = DEFAULT_TRANSLATION_PROMPT
    columns: str = ""

    name: ClassVar[str] = "translation"
    COLUMNS: ClassVar[dict[str, str]] = {"translation": "translation"}

    def __post_init__(self) -> None:
        for opt in ("source_lang", "target_lang"):
            value = getattr(self, opt)
            if not isinstance(value, str) or not value:
                raise ValueError(f"translation template: option {opt} must be a non-empty language code, got {value!r}")
        if self.source_lang == self.target_lang:
            raise ValueError(f"translation template: source_lang and target_lang are both {self.source_lang!r}")
        if "{text}" not in self.prompt_format:
            raise ValueError("translation template: prompt_format must contain {text}")
        # Fail at construction, not on the first record, if the format has unknown fields.
        self.prompt_format.format(source="", target="", text="")
        # Looked up once, not per record.
        object.__setattr__(self, "_names", (language_name(self.source_lang), language_name(self.target_lang)))
        object.__setattr__(self, "_pair_key", Columns(self.columns, self.COLUMNS, self.name)["translation"])

    def keys(self) -> frozenset[str]:
        """The columns a record must have to be in this format (for --format auto)."""
        return frozenset((self._pair_key,))  # type: ignore[attr-defined]

    def fits(self, record: Mapping[str, Any]) -> bool:
        pair = record.get(self._pair_key)  # type: ignore[attr-defined]
        return isinstance(pair, Mapping) or {self.source_lang, self.target_lang} <= record.keys()

    def to_pair(self, record: Mapping[str, Any]) -> tuple[str, str]:
        record = check_record(record)
        src_code, tgt_code = self.source_lang, self.target_lang
        key = self._pair_key  # type: ignore[attr-defined]
        if key in record:
            pair = record[key]
            if pair.__class__ is not dict and not isinstance(pair, Mapping):
                raise RecordError(
                    "wrong_type", key,
                    f"field '{key}': expected an object with '{src_code}' and '{tgt_code}' keys, got {describe(pair)}",
                )
            prefix = key + "."
        else:
            pair, prefix = record, ""
            if src_code not in record and tgt_code not in record:
                # Neither shape matched: name both so the user sees what was looked for.
                raise RecordError(
                    "missing_field", src_code,
                    f"missing field '{src_code}' (or '{key}.{src_code}'): expected the "
                    f"{language_name(src_code)} source text; record has keys [{', '.join(map(str, list(record)[:8]))}]",
                )
        src_name, tgt_name = self._names  # type: ignore[attr-defined]
        source = get_str(pair, src_code, prefix + src_code, f"the {src_name} source text")
        target = get_str(pair, tgt_code, prefix + tgt_code, f"the {tgt_name} target text")
        require_nonblank(source, "empty_prompt", prefix + src_code, f"{src_name} source text")
        require_nonblank(target, "empty_response", prefix + tgt_code, f"{tgt_name} target text")
        return self.prompt_format.format(source=src_name, target=tgt_name, text=source), target
