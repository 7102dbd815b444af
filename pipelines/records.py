"""The values that travel between the job's steps, kept as plain tuples.

Plain tuples of ints, strs and bytes go through Beam's fast primitive coder;
dataclasses or numpy arrays would be pickled, several times slower per element.
Token payloads travel in columnar batches (pipelines/columns.py).

- Loc = (task_index, record_index, line, sub_index): where an example came from.
  sub_index numbers the examples one record yields (0 for the first).
- DeadLetter = (sort_key, entry dict): sorted by source before writing
"""

from __future__ import annotations

import dataclasses
from typing import Any

Loc = tuple[int, int, int, int]
DeadLetter = tuple[tuple, dict]


@dataclasses.dataclass(frozen=True)
class TaskMeta:
    """What a worker needs to name a record's source: kept small, shipped with the DoFns."""

    input_index: int
    input_spec: str
    path: str
    name: str


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


def dead_letter(
    metas: list[TaskMeta], loc: Loc, reason: str, field: str, message: str, raw: Any = None, **extra: Any
) -> DeadLetter:
    entry = {"reason": reason, "field": field, "message": message, "source": source(metas, loc), "raw": raw, **extra}
    return (tuple(loc) + (reason,), entry)
