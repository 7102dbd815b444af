"""Checks for values read from storage that others can write: manifests, run records
(prepack/format/run_record.py), the tokenized set's manifest.

A training host reads manifests from buckets other people can write, so nothing taken from
one is used before it is checked here: a file name must be a plain name as the writer makes
it (it can then only name a file inside the set's own folder, or the cache's), a sha256 must
be 64 hex digits (it names the cache file), counts must be integers, objects must be
objects. One implementation, used by the loaders, the pipelines and `prepack inspect`.

Each check takes `where` (the manifest's path) and the field's name, and raises `error`
(the caller's error class) with one line naming both.
"""

from __future__ import annotations

import json
import re
import reprlib
from collections.abc import Iterator
from typing import Any

# What the writers make: rows-00000-of-00004-<hex>.array_record, tokens-<hex>.array_record,
# dropped-<hex>.jsonl, dead_letter.jsonl. No separator, no "..", no scheme, no hidden name.
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,254}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Counts (rows, bytes, tokens) fit in int64: numpy, the packer and array_record use it.
MAX_COUNT = (1 << 63) - 1
# The size cap of every metadata file read from storage: a shard set's manifest, a tokenized
# set's manifest, a run record (published.json), a loader or checkpoint state. Such a file is
# read whole and parsed in memory, so a larger one is refused in one line before it is parsed,
# and no more than this many bytes (+1) of it are ever read (prepack.storage.read_metadata, the
# one reader; a `--mixture` file has its own, smaller cap). A real manifest is far smaller: a
# shard entry is ~200 bytes, so 16 MiB holds ~80,000 shards; the job's manifests of 10^6-row
# sets are ~100 KiB.
MAX_METADATA_FILE_BYTES = 16 << 20


def too_large(where: str, limit: int = MAX_METADATA_FILE_BYTES) -> str:
    """The one line for a metadata file over the cap."""
    return (f"{where}: larger than {limit:,} bytes, the most a manifest or run record may hold (a real one is far "
            "smaller); it was not read. The file was edited or is damaged: republish the set")


def file_name(value: Any, where: str, field: str, error: type[Exception]) -> str:
    """A plain file name in the manifest's folder; refuses paths, '..', schemes, hidden names."""
    if not isinstance(value, str) or not _FILE_NAME.match(value) or ".." in value:
        raise error(f"{where}: {field} {_show(value)} is not a plain file name in the set's folder "
                    "(no '/', '\\', '..', scheme or leading '.'); the manifest was edited or is damaged: republish the set")
    return value


def sha256_hex(value: Any, where: str, field: str, error: type[Exception]) -> str:
    if not isinstance(value, str) or not _SHA256.match(value):
        raise error(f"{where}: {field} {_show(value)} is not a sha256 (64 lowercase hex digits); "
                    "the manifest was edited or is damaged: republish the set")
    return value


def count(value: Any, where: str, field: str, error: type[Exception], low: int = 0, high: int = MAX_COUNT) -> int:
    """An integer in [low, high] (a JSON number written as an integer; never a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise error(f"{where}: {field} {_show(value)} is not an integer from {low:,} to {high:,}; "
                    "the manifest was edited or is damaged: republish the set")
    return value


def mapping(value: Any, where: str, field: str, error: type[Exception], optional: bool = False) -> dict[str, Any] | None:
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        raise error(f"{where}: {field} is {_kind(value)}, not a JSON object; the manifest was edited or is damaged: "
                    "republish the set")
    return value


def sequence(value: Any, where: str, field: str, error: type[Exception]) -> list[Any]:
    if not isinstance(value, list):
        raise error(f"{where}: {field} is {_kind(value)}, not a JSON array; the manifest was edited or is damaged: "
                    "republish the set")
    return value


def text(value: Any, where: str, field: str, error: type[Exception], optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise error(f"{where}: {field} is {_kind(value)}, not a string; the manifest was edited or is damaged: "
                    "republish the set")
    return value


def shard_entries(value: Any, where: str, error: type[Exception]) -> list[dict[str, Any]]:
    """The `shards` list: each entry exactly {path, num_rows, num_bytes, sha256}, all checked;
    no two entries name the same file."""
    entries = []
    seen: set[str] = set()
    for k, entry in enumerate(sequence(value, where, "shards", error)):
        field = f"shards[{k}]"
        mapping(entry, where, field, error)
        keys = set(entry)
        if keys != {"path", "num_rows", "num_bytes", "sha256"}:
            raise error(f"{where}: {field} has keys {sorted(keys)}, expected num_bytes, num_rows, path, sha256; "
                        "the manifest was edited or is damaged: republish the set")
        name = file_name(entry["path"], where, f"{field}.path", error)
        if name in seen:
            raise error(f"{where}: {field}.path {name!r} is listed twice; the manifest was edited or is damaged: republish the set")
        seen.add(name)
        entries.append({"path": name,
                        "num_rows": count(entry["num_rows"], where, f"{field}.num_rows", error),
                        "num_bytes": count(entry["num_bytes"], where, f"{field}.num_bytes", error),
                        "sha256": sha256_hex(entry["sha256"], where, f"{field}.sha256", error)})
    return entries


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


class _BoundedRepr(reprlib.Repr):
    """repr() that never builds the whole text of a huge value: a few items per level, a
    few levels, and big integers by their size (repr of a 5,001-digit int raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxdict, self.maxlist, self.maxtuple, self.maxset = 3, 4, 4, 4, 4
        self.maxstring = self.maxother = self.maxlong = 80

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 200:
            return f"<an integer of about {int(x.bit_length() * 0.30103):,} digits>"
        return super().repr_int(x, level)


_BOUNDED = _BoundedRepr()


def shown(value: Any, limit: int = 80) -> str:
    """A length-capped form of an untrusted value for a one-line message (never its full repr)."""
    text = " ".join(_BOUNDED.repr(value).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def shown_with_type(value: Any) -> str:
    """'a string 'lots'', 'an object {'x': 1}': the value's JSON kind and its capped form."""
    return f"{_kind(value)} {shown(value)}"


def _show(value: Any) -> str:
    return shown(value)


def jsonl_values(path: str, error: type[Exception], max_line_bytes: int, what: str) -> Iterator[tuple[str, Any]]:
    """(where, value) of each non-blank line of a JSONL file others may have written, `where` its
    "path:line". Each line is read with a bound (max_line_bytes) and must be UTF-8 and JSON; JSON
    that Python's parser cannot hold (arrays nested 100,000 deep, a 5,001-digit integer) is refused
    as well: each in one line naming the file and line (`error`), never a traceback. `what`: what a
    line should be, for the message of one too long."""
    with open(path, "rb") as f:
        number = 0
        while True:
            line = f.readline(max_line_bytes + 1)
            if not line:
                return
            number += 1
            where = f"{path}:{number}"
            if len(line) > max_line_bytes:
                raise error(f"{where}: longer than {max_line_bytes:,} bytes, not {what} (it was not read further)")
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{where}: not UTF-8 text (byte {e.start})") from None
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise error(f"{where}: not valid JSON ({e.msg})") from None
            except (ValueError, RecursionError) as e:  # nesting 100,000 deep; a 5,001-digit integer
                raise error(f"{where}: not valid JSON ({type(e).__name__}: {str(e)[:100]})") from None
            yield where, value
