"""The values that travel between the job's steps, kept as plain tuples.

Plain tuples of ints, strs and bytes go through Beam's fast primitive coder;
dataclasses or numpy arrays would be pickled, several times slower per element.
Token ids travel as little-endian int32 bytes and loss masks as uint8 bytes.

- Loc = (task_index, record_index, line, sub_index): where an example came from.
  sub_index numbers the examples one record yields (0 for the first).
- Example = (hash, example_id, ids_bytes, mask_bytes, loc)  after tokenizing
- Payload = (hash, example_id, ids_bytes, mask_bytes)       while routed to rows
- Fragment = (row, position, ids_bytes, mask_bytes)         on its way to a shard
- DeadLetter = (sort_key, entry dict)                       sorted by source before writing
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

Loc = tuple[int, int, int, int]
Example = tuple[int, str, bytes, bytes, Loc]
Payload = tuple[int, str, bytes, bytes]
Fragment = tuple[int, int, bytes, bytes]
DeadLetter = tuple[tuple, dict]

IDS_DTYPE = np.dtype("<i4")


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


def ids_to_bytes(ids: Any) -> bytes:
    return np.asarray(ids, dtype=IDS_DTYPE).tobytes()


def mask_to_bytes(mask: Any) -> bytes:
    return np.asarray(mask, dtype=np.uint8).tobytes()


def has_target(mask: bytes, end: int | None = None) -> bool:
    """Whether any token after the first (the row builder zeroes the first) is a target."""
    return mask.find(b"\x01", 1, len(mask) if end is None else end) != -1
