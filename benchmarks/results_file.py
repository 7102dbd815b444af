"""A device benchmark's JSON results: read as a stranger's file, written whole or not at all.

The device benchmarks (bench_train_device, bench_cookbook_device, bench_attention) resume across
calls of a machine that can end at any moment: each keeps one JSON file that every run merges into.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from typing import Any


class UnreadableResults(ValueError):
    """The file exists but is not this benchmark's results (the message says why)."""


def load(path: str, empty: dict[str, Any], holds: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The results so far: a copy of `empty` when there is no file; the file's object, with `empty`'s
    missing keys added, when `holds` accepts it. Raises UnreadableResults otherwise."""
    if not os.path.exists(path):
        return copy.deepcopy(empty)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UnreadableResults(str(e)) from None
    if not isinstance(data, dict) or not holds(data):
        raise UnreadableResults("not this benchmark's results")
    for key, value in empty.items():
        data.setdefault(key, copy.deepcopy(value))
    return data


def save(path: str, data: dict[str, Any]) -> None:
    """Atomically: a call that ends mid-write leaves the previous results intact."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
