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
    unclosed '[' is a literal '['."""
    end = start + 1
    if end < len(pattern) and pattern[end] == "!":
        end += 1
    if end < len(pattern) and pattern[end] == "]":
        end += 1  # a ']' first in the class is one of its characters
    end = pattern.find("]", end)
    if end < 0:
        return re.escape("["), start + 1
    body = pattern[start + 1:end].replace("\\", "\\\\").replace("[", "\\[")
    if body.startswith("!"):
        body = "^" + body[1:]
    elif body.startswith("^"):
        body = "\\" + body
    return f"[{body}]", end + 1


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
