"""The launcher's look at each source's first records, before any work: `--format auto` picks the
format from their keys (and says which), and a source whose first records fit no part of its
format fails at once, in one line naming the keys found and what to try, instead of after a whole
run of dead letters (prepack/text/formats/detect.py has the rules)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pipelines.inputs import readers
from pipelines.inputs.limits import InputLimits
from pipelines.inputs.sources import ReadTask
from prepack.text.formats.detect import FormatGuessError, detect, keys_seen, mismatch

__all__ = ["SAMPLE_RECORDS", "FormatCheckError", "check_source", "check_formats"]

# Records looked at per source: enough to see past a few bad lines, few enough to cost nothing.
SAMPLE_RECORDS = 32


class FormatCheckError(ValueError):
    """A source's records fit not its format (or no one format, for auto): one line."""


def check_source(fmt: str, options: Mapping[str, str], task: ReadTask, limits: InputLimits,
                 naming: str = "") -> tuple[str, str | None]:
    """(the source's format, a note to print) from its first task's first records: `auto`
    resolved, an explicit format checked. Unreadable or empty inputs pass: the job reports them."""
    try:
        records = [r for r in readers.sample(task, SAMPLE_RECORDS, limits) if isinstance(r, Mapping)]
    except Exception:  # noqa: BLE001 - a file the job's own reading reports, with its one line
        records = []
    where = f"{naming}{task.path}"
    if not records:
        if fmt == "auto":
            raise FormatCheckError(f"{where}: --format auto found no records to choose a format from; name one with --format")
        return fmt, None
    options = {k: v for k, v in options.items() if k in ("columns", "roles")} if fmt == "auto" else dict(options)
    if fmt == "auto":
        try:
            chosen = detect(records, options)
        except FormatGuessError as e:
            raise FormatCheckError(f"{where}: {e}") from None
        return chosen, f"--format auto: {chosen} for {where} (keys {', '.join(keys_seen(records)[:10])})"
    problem = mismatch(fmt, records, options)
    if problem is not None:
        raise FormatCheckError(f"{where}: {problem}")
    return fmt, None


def check_formats(rows: Any, tasks: Sequence[ReadTask]) -> tuple[Any, list[str]]:
    """Every source of a RowSpec checked on its first input's first task; a plain run's `auto`
    resolved into a new RowSpec. Returns (the RowSpec, the notes to print)."""
    mixture = rows.mixture
    source_of = mixture.source_of_input()
    notes: list[str] = []
    for source in mixture.sources:
        task = next((t for t in tasks if source_of[t.input_index] == source.index), None)
        if task is None:
            continue
        fmt, note = check_source(source.format, dict(source.options), task, rows.limits, mixture.naming(source.index))
        if note:
            notes.append(note)
        if fmt != source.format:  # auto, only ever a plain run's one source
            rows = dataclasses.replace(rows, format=fmt, mixture=None)
    return rows, notes
