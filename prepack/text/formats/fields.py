"""Reading a record's fields: typed getters whose errors name the field as the record spells it,
and the column and role mappings (`--columns`, `--roles`, a mixture source's `columns:` and
`roles:`) that let any schema be read by a source format.

A mapping travels as text, `canonical=name,...` sorted by canonical name (`mapping_text`): that is
what `--columns`/`--roles` take, what a format's options hold, and what manifests and tokenized sets
record, so two runs with the same mapping record the same bytes.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from prepack.text.conversation import RecordError

__all__ = [
    "describe",
    "check_record",
    "get_str",
    "get_optional_str",
    "require_nonblank",
    "parse_mapping",
    "mapping_text",
    "Columns",
    "RequiredColumns",
    "RoleMap",
    "DEFAULT_ROLES",
    "CANONICAL_ROLES",
]

_JSON_TYPE_NAMES = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
    type(None): "null",
}


def describe(value: Any) -> str:
    """'a number (3.5)', 'an array of 2 items', ... for error messages; shortened so a
    huge bad value cannot flood the logs."""
    name = _JSON_TYPE_NAMES.get(type(value), type(value).__name__)
    if isinstance(value, (list, tuple)):
        return f"an array of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        keys = ", ".join(map(str, list(value)[:5]))
        return f"an object with keys [{keys}{', ...' if len(value) > 5 else ''}]"
    if value is None:
        return "null"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    article = "an" if name[0] in "aeiou" else "a"
    return f"{article} {name} ({text})"


def check_record(record: Any) -> Mapping[str, Any]:
    # dict first: isinstance against typing.Mapping goes through the ABC machinery (~8 µs).
    if record.__class__ is not dict and not isinstance(record, Mapping):
        raise RecordError("not_an_object", "", f"record: expected a JSON object, got {describe(record)}")
    return record


def get_str(obj: Mapping[str, Any], key: str, path: str, what: str) -> str:
    """obj[key] as a string; `what` says what the field should hold (for the message)."""
    if key not in obj:
        raise RecordError("missing_field", path, f"missing field '{path}': expected a string ({what})")
    value = obj[key]
    if value is None:
        # HF datasets write absent values as null; treat that as missing, but say so.
        raise RecordError("missing_field", path, f"field '{path}' is null: expected a string ({what})")
    if not isinstance(value, str):
        raise RecordError("wrong_type", path, f"field '{path}': expected a string ({what}), got {describe(value)}")
    return value


def get_optional_str(obj: Mapping[str, Any], key: str, path: str, what: str) -> str:
    """Like get_str, but absent or null means ''."""
    value = obj.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RecordError("wrong_type", path, f"field '{path}': expected a string ({what}) or null, got {describe(value)}")
    return value


def require_nonblank(text: str, reason: str, path: str, what: str) -> None:
    if not text.strip():
        got = "an empty string" if not text else "only whitespace"
        raise RecordError(reason, path, f"field '{path}': expected non-empty {what}, got {got}")


# --------------------------------------------------------------------------------------
# Mappings: canonical=name pairs
# --------------------------------------------------------------------------------------

_NAME = re.compile(r"[^\s,=][^,=]{0,199}")  # a column, key or role value: no ',' or '=', not blank
MAX_PAIRS = 64


def parse_mapping(text: str, option: str, canonical: Iterable[str], repeatable: bool = False) -> tuple[tuple[str, str], ...]:
    """'a=x,b=y' -> (('a', 'x'), ('b', 'y')) sorted, each canonical name one of `canonical`
    (`repeatable`: a name may map several values, as --roles user=human,user=person). Raises
    ValueError with one line naming the option and what is wrong."""
    allowed = tuple(canonical)
    pairs: list[tuple[str, str]] = []
    parts = [p for p in text.split(",")] if text else []
    if len(parts) > MAX_PAIRS:
        raise ValueError(f"{option}: at most {MAX_PAIRS} pairs, got {len(parts)}")
    for part in parts:
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not _NAME.fullmatch(value):
            raise ValueError(f"{option}: expected NAME=VALUE pairs separated by commas (e.g. {allowed[0]}=...), got {part!r}")
        if key not in allowed:
            raise ValueError(f"{option}: unknown name {key!r}; expected one of {', '.join(allowed)}")
        if not repeatable and any(k == key for k, _ in pairs):
            raise ValueError(f"{option}: {key} is given twice")
        pairs.append((key, value))
    return tuple(sorted(pairs))


def mapping_text(pairs: Iterable[tuple[str, str]]) -> str:
    """The canonical text of a mapping: sorted 'a=x,b=y' (what options and manifests record)."""
    return ",".join(f"{k}={v}" for k, v in sorted(pairs))


class Columns:
    """Where a format finds each of its canonical fields: the record's columns (messages, tools,
    system, prompt, ...) and, for message lists, the message keys (role, content). `defaults`
    are the format's own spellings; `--columns` overrides them one by one."""

    def __init__(self, text: str, defaults: Mapping[str, str], fmt: str) -> None:
        pairs = parse_mapping(text, f"--columns of format {fmt!r}", tuple(defaults))
        self._names = {**defaults, **dict(pairs)}
        taken: dict[str, str] = {}
        for canonical, name in self._names.items():
            if name in taken and _same_level(canonical, taken[name]):
                raise ValueError(f"--columns of format {fmt!r}: {canonical} and {taken[name]} both read {name!r}")
            taken.setdefault(name, canonical)

    def __getitem__(self, canonical: str) -> str:
        return self._names[canonical]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Columns) and self._names == other._names

    __hash__ = None  # type: ignore[assignment]


class RequiredColumns:
    """`keys` and `fits` (for --format auto) of a format that needs a fixed set of columns,
    named in `_required` by the format's __post_init__."""

    _required: tuple[str, ...]

    def keys(self) -> frozenset[str]:
        """The columns a record must have to be in this format."""
        return frozenset(self._required)

    def fits(self, record: Mapping[str, Any]) -> bool:
        return self.keys() <= record.keys()


_MESSAGE_KEYS = frozenset({"role", "content"})


def _same_level(a: str, b: str) -> bool:
    """Record columns and message keys live at different levels: a column and a message key
    may share a name (a `text` column and a `text` content key)."""
    return (a in _MESSAGE_KEYS) == (b in _MESSAGE_KEYS)


# Canonical roles: what a message can be after mapping. `tool_call` is ShareGPT's assistant
# turn whose value is a call (function_call); `tool` is a tool's result.
CANONICAL_ROLES = ("system", "user", "assistant", "tool_call", "tool")
# The role values every message format reads without --roles (ShareGPT's and OpenAI's spellings;
# `developer` is OpenAI's and FunctionGemma's system role, `model` Gemma's assistant, `ipython`
# Llama 3.1's tool result).
DEFAULT_ROLES: dict[str, str] = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant",
    "function_call": "tool_call", "tool_call": "tool_call",
    "tool": "tool", "observation": "tool", "function": "tool", "ipython": "tool",
}


class RoleMap:
    """Role values -> canonical roles: the defaults, every canonical name as itself, then
    `--roles canonical=value,...` on top (it overrides only the values it names)."""

    def __init__(self, text: str) -> None:
        pairs = parse_mapping(text, "--roles", CANONICAL_ROLES, repeatable=True)
        values = [v for _, v in pairs]
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise ValueError(f"--roles: the value {twice[0]!r} is mapped to two roles")
        self.table: dict[str, str] = {**DEFAULT_ROLES, **{c: c for c in CANONICAL_ROLES}, **{v: c for c, v in pairs}}

    def get(self, value: str) -> str | None:
        return self.table.get(value)

    def known(self) -> str:
        """The accepted values, for a message."""
        return ", ".join(sorted(self.table))
