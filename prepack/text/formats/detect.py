"""Which source format a dataset's records are in, from their keys: `--format auto`, and the
one-line advice when the records fit no format, or not the one given.

A format fits a record when the record has the columns the format reads (each format's `fits`,
after `--columns`). The chosen format must fit every sampled record. When two fit, the one whose
columns include the other's wins (oasst1's message_id, role and text over text's text); when
neither includes the other, the choice is refused, naming both.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from prepack.text.formats import get_template, template_class, template_names
from prepack.text.formats.fields import DEFAULT_ROLES

__all__ = ["FormatGuessError", "detect", "mismatch", "keys_seen"]

SHOWN_KEYS = 10


class FormatGuessError(ValueError):
    """The records fit no format, or more than one: the message is one line saying what to try."""


def keys_seen(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The records' keys in the order they first appear."""
    seen: dict[str, None] = {}
    for record in records:
        seen.update(dict.fromkeys(map(str, record)))
    return list(seen)


def _shown(keys: Sequence[str]) -> str:
    return ", ".join(keys[:SHOWN_KEYS]) + (", ..." if len(keys) > SHOWN_KEYS else "")


def _templates(options: Mapping[str, str]) -> dict[str, Any]:
    """Every format that takes the given options (columns/roles), built with them."""
    out = {}
    for name in template_names():
        accepted = {f.name for f in dataclasses.fields(template_class(name))}
        if not set(options) <= accepted:
            continue
        try:
            out[name] = get_template(name, **options)
        except ValueError:  # e.g. a column this format does not have
            continue
    return out


def _fitting(records: Sequence[Mapping[str, Any]], options: Mapping[str, str]) -> list[str]:
    """The formats that fit every record, the less specific of two nested ones left out."""
    templates = _templates(options)
    fits = [name for name, t in templates.items() if all(t.fits(r) for r in records)]
    fits = [name for name in fits if not _same_as_another(templates[name], templates, fits)]
    keys = {name: templates[name].keys() for name in fits}
    return [a for a in fits if not any(keys[a] < keys[b] for b in fits if b != a)]


def _same_as_another(template: Any, templates: Mapping[str, Any], fits: Sequence[str]) -> bool:
    """sharegpt reads as chat does; when --columns give both the same keys, they are one format."""
    other = template.same_reader_as
    return other in fits and templates[other].column_names == template.column_names


def detect(records: Sequence[Mapping[str, Any]], options: Mapping[str, str] = {}) -> str:
    """The one format the records are in; FormatGuessError naming the keys otherwise."""
    found = keys_seen(records)
    fitting = _fitting(records, options)
    if len(fitting) == 1:
        return fitting[0]
    if fitting:
        raise FormatGuessError(f"--format auto: the records (keys {_shown(found)}) fit {' and '.join(fitting)}; "
                               f"name one with --format")
    raise FormatGuessError(f"records have keys {_shown(found)}, which fit no format; {suggestion(records)}")


def mismatch(fmt: str, records: Sequence[Mapping[str, Any]], options: Mapping[str, str] = {}) -> str | None:
    """None when `fmt` fits some of the records; else the one line saying what they are instead."""
    template = get_template(fmt, **options)
    if any(template.fits(r) for r in records):
        return None
    found = keys_seen(records)
    wanted = ", ".join(sorted(template.keys()))
    fitting = _fitting(records, {})
    if fitting:
        return f"records have keys {_shown(found)}, not the {wanted} of format {fmt!r}: try --format {fitting[0]}"
    return f"records have keys {_shown(found)}, not the {wanted} of format {fmt!r}; {suggestion(records)}"


def suggestion(records: Sequence[Mapping[str, Any]]) -> str:
    """What to try for records that no format reads with its own column names: the format and
    the --columns that name the record's own keys."""
    first = records[0] if records else {}
    for key, value in first.items():
        if isinstance(value, (list, tuple)) and value and all(isinstance(m, Mapping) for m in value):
            inner = keys_seen(value)
            if {"from", "value"} <= set(inner):
                return f"try --format sharegpt --columns messages={key}"
            role, content = _role_key(value, inner), _content_key(value, inner)
            if role and content:
                mapped = ",".join(f"{c}={k}" for c, k in (("role", role), ("content", content)) if c != k)
                return f"try --format chat --columns messages={key}" + (f",{mapped}" if mapped else "")
    texts = [k for k, v in first.items() if isinstance(v, str)]
    if len(texts) == 1:
        return f"try --format text --columns text={texts[0]}"
    if len(texts) >= 2:
        return f"try --format prompt_completion --columns prompt={texts[0]},completion={texts[1]}"
    return "see docs/formats.md for the formats and --columns"


def _role_key(messages: Sequence[Mapping[str, Any]], inner: list[str]) -> str | None:
    """The message key whose values are role names (or, failing that, the one with the fewest
    distinct short string values)."""
    best: tuple[int, str] | None = None
    for key in inner:
        values = {m.get(key) for m in messages}
        if not all(isinstance(v, str) and len(v) <= 32 for v in values):
            continue
        if values & DEFAULT_ROLES.keys():
            return key
        if best is None or len(values) < best[0]:
            best = (len(values), key)
    return best[1] if best else None


def _content_key(messages: Sequence[Mapping[str, Any]], inner: list[str]) -> str | None:
    """The message key holding the longest texts."""
    lengths = {k: sum(len(m[k]) for m in messages if isinstance(m.get(k), str)) for k in inner}
    role = _role_key(messages, inner)
    lengths.pop(role, None)
    return max(lengths, key=lengths.__getitem__) if lengths and max(lengths.values()) else None
