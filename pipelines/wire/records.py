"""The values that travel between the job's steps, kept as plain tuples.

Plain tuples of ints, strs and bytes go through Beam's fast primitive coder;
dataclasses or numpy arrays would be pickled, several times slower per element.
Token payloads travel in columnar batches (pipelines/wire/columns.py).

- Loc = (task_index, record_index, line, sub_index): where an example came from.
  sub_index numbers the examples one record yields (0 for the first).
- DeadLetter = (sort_key, entry dict): sorted by source before writing
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

Loc = tuple[int, int, int, int]
DeadLetter = tuple[tuple, dict]


@dataclasses.dataclass(frozen=True)
class TaskMeta:
    """What a worker needs to name a record's source: kept small, shipped with the DoFns."""

    input_index: int
    input_spec: str
    path: str
    name: str  # in example ids: the file's name relative to its glob (plus "@start" for a byte range), or the split
    byte_start: int | None = None  # where the task's byte range of a JSONL file starts; None: a whole file or a dataset


def example_id(meta: TaskMeta, record_index: int, sub_index: int = 0) -> str:
    """Unique within a run and independent of where the input folder lives: the input's
    position, the file's name relative to its glob (or the split), and the record number."""
    base = f"{meta.input_index}/{meta.name}/{record_index}"
    return base if sub_index == 0 else f"{base}#{sub_index}"


def source(metas: list[TaskMeta], loc: Loc) -> dict[str, Any]:
    task_index, record_index, line, sub_index = loc
    meta = metas[task_index]
    out: dict[str, Any] = {"input": meta.input_spec, "file": meta.path, "record": record_index}
    if line:
        out["line"] = line
    if sub_index:
        out["example"] = sub_index
    return out


def range_offsets(metas: Sequence[TaskMeta], fingerprints: Iterable[Sequence]) -> dict[int, tuple[int, int]]:
    """For each byte-range task: (records, lines) of its file before the range, from every
    range's counts (fingerprint entries: task_index, sha256, bytes, records, lines)."""
    counts = {f[0]: (f[3], f[4]) for f in fingerprints}
    ranges = sorted((m.input_index, m.path, m.byte_start, i) for i, m in enumerate(metas) if m.byte_start is not None)
    out: dict[int, tuple[int, int]] = {}
    file, records, lines = None, 0, 0
    for input_index, path, _, task_index in ranges:
        if (input_index, path) != file:
            file, records, lines = (input_index, path), 0, 0
        out[task_index] = (records, lines)
        records, lines = records + counts[task_index][0], lines + counts[task_index][1]
    return out


def place_in_file(entry: dict[str, Any], task_index: int, offsets: dict[int, tuple[int, int]]) -> dict[str, Any]:
    """A dead letter's source with range-relative record and line numbers made file-relative."""
    base = offsets.get(task_index)
    if base is None:
        return entry
    src = dict(entry["source"])
    src["record"] += base[0]
    if "line" in src:
        src["line"] += base[1]
    return {**entry, "source": src}


def dead_letter(
    metas: list[TaskMeta], loc: Loc, reason: str, field: str, message: str, raw: Any = None, **extra: Any
) -> DeadLetter:
    entry = {"reason": reason, "field": field, "message": message, "source": source(metas, loc), "raw": raw, **extra}
    return (tuple(loc) + (reason,), entry)
