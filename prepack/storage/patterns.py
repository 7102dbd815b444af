"""What an input pattern matches, one rule for local paths and gs://.

`*` matches within one folder (never a `/` or a backslash), `**` across folders, `?` any
one character, `[...]` a character class (`[!...]` its complement); everything else is
literal, and a pattern ending in `/` (or a backslash) means the files directly in that
folder. These are the rules Beam's FileSystems.match applied to `--input` before this
module, kept so that a glob matches the same files as before.
"""

from __future__ import annotations

import re

WILDCARDS = "*?["


class PatternError(ValueError):
    """A pattern no path can match (a character class with a reversed range, `[z-a]`); the message
    names the pattern and the range. Beam's FileSystems.match refused the same patterns."""


def has_wildcard(pattern: str) -> bool:
    return any(ch in pattern for ch in WILDCARDS)


def literal_head(pattern: str) -> str:
    """The pattern up to its first wildcard: every match starts with it."""
    for i, ch in enumerate(pattern):
        if ch in WILDCARDS:
            return pattern[:i]
    return pattern


def _char_class(pattern: str, start: int) -> tuple[str, int]:
    """The regex of the class opening at pattern[start] == '[' and the index after it; an
    unclosed '[' is a literal '['. PatternError for a class with a reversed range."""
    end = start + 1
    if end < len(pattern) and pattern[end] == "!":
        end += 1
    if end < len(pattern) and pattern[end] == "]":
        end += 1  # a ']' first in the class is one of its characters
    end = pattern.find("]", end)
    if end < 0:
        return re.escape("["), start + 1
    char_class = pattern[start:end + 1]
    body = char_class[1:-1]
    negated = body.startswith("!")
    items = []
    for low, high in _class_items(body[1:] if negated else body):
        if high is None:
            items.append(re.escape(low))
        elif low > high:
            raise PatternError(
                f"pattern {pattern!r}: its character class {char_class} has the reversed range {low}-{high} ({low!r} "
                f"comes after {high!r}, so no character is in it); write {high}-{low}, or put the '-' last to mean "
                "the character '-'")
        else:
            items.append(f"{re.escape(low)}-{re.escape(high)}")
    # Every character escaped, ranges kept: the same set, and no `--` or `&&` for re to warn of.
    return f"[{'^' if negated else ''}{''.join(items)}]", end + 1


def _class_items(body: str) -> list[tuple[str, str | None]]:
    """A class body's items as a regular expression reads them: (low, high) for `low-high`
    between two characters, (char, None) for any other character (a '-' first or last)."""
    items: list[tuple[str, str | None]] = []
    i = 0
    while i < len(body):
        if i + 2 < len(body) and body[i + 1] == "-":
            items.append((body[i], body[i + 2]))
            i += 3
        else:
            items.append((body[i], None))
            i += 1
    return items


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """The regular expression a whole path must match to match `pattern`."""
    parts = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            parts.append(".*")
            i += 2
        elif pattern[i] == "*":
            parts.append(r"[^/\\]*")
            i += 1
        elif pattern[i] == "?":
            parts.append(".")
            i += 1
        elif pattern[i] == "[":
            regex, i = _char_class(pattern, i)
            parts.append(regex)
        else:
            parts.append(re.escape(pattern[i]))
            i += 1
    return re.compile("(?s)" + "".join(parts) + r"\Z")


def folder_pattern(pattern: str) -> str:
    """`DIR/` (or `DIR\\`) means `DIR/*`: the files directly in that folder."""
    return pattern + "*" if pattern.endswith(("/", "\\")) else pattern
