"""The job's own read and prepare stages, run in this process: what `prepack preflight` and
`prepack generate` read their inputs with (pipelines.inputs.sources, pipelines.inputs.readers,
pipelines.preparer.Preparer), so they see the same specs, records, examples and bad-record
reasons as `prepack pack`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from prepack.packing.accounting import Tally
from prepack.text.formats import Template, template_names

BATCH = 512  # records per read batch, as preflight tokenizes them


class InputsError(Exception):
    """An input that cannot be read as asked: printed as one line, exit status 2."""


def pipeline_modules() -> Any:
    """(preparer, readers, sources): the pipeline's modules, or InputsError without the extra."""
    try:
        from pipelines.inputs import sources
        from pipelines.inputs import readers
        from pipelines import preparer as prepare
    except ImportError as e:
        raise InputsError(f"reading inputs needs the pipeline extra ({e}); pip install 'tunix-prepack[pipeline]'") from e
    return prepare, readers, sources


def read_tasks(spec: str | Sequence[str], tfds_data_dir: str | None = None) -> tuple[list[Any], list[Any]]:
    """(TaskMetas, ReadTasks) of an --input (or several), as the job plans them; InputsError if unreadable."""
    _, _, sources = pipeline_modules()
    try:
        inputs, tasks = sources.resolve_inputs([spec] if isinstance(spec, str) else list(spec), tfds_data_dir)
    except sources.InputError as e:
        raise InputsError(str(e)) from e
    return sources.task_metas(inputs, tasks), tasks


def batches(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def raw_batches(tasks: Iterable[Any], limits: Any, size: int = BATCH) -> Iterator[tuple[int, list]]:
    """(task index, raw records) in batches, as the job's read stage makes them (under its InputLimits)."""
    _, readers, _ = pipeline_modules()
    for task in tasks:
        for batch in batches(readers.iter_task(task, readers.FileDigest(), size, limits), size):
            yield task.task_index, batch


def templated(preparer: Any, metas: list[Any], tasks: list[Any], tally: Tally, limits: Any, progress: Any = None,
              bad: list[Any] | None = None) -> Iterator[Any]:
    """(conv, response, meta) of every example, through the job's prepare stage; bad records are
    tallied by reason as the job does, and their dead letters added to `bad` when it is given.
    progress (a tqdm counter, pipelines/progress.py) counts the records read after each batch."""

    def read_so_far(counter: Any) -> None:
        counter.update(tally.records_read - counter.n)

    prepare, _, _ = pipeline_modules()
    letters: list[Any] = []

    def keep() -> None:
        if bad is not None:
            bad.extend(letters)
        letters.clear()

    template = preparer.template
    if template.table_level:  # oasst1: messages only make sense as whole trees
        trees: dict[str, list] = {}
        for task_index, items in raw_batches(tasks, limits):
            for key, located in prepare.key_table_records(metas, task_index, items, template.group_key, tally, letters):
                trees.setdefault(key, []).append(located)
            keep()
            if progress is not None:
                read_so_far(progress)
        for key in sorted(trees):
            yield from preparer.template_table(trees.pop(key), tally, letters).items()
            keep()
        return
    for task_index, items in raw_batches(tasks, limits):
        yield from preparer.template_records(task_index, items, tally, letters).items()
        keep()
        if progress is not None:
            read_so_far(progress)


def make_template(name: str, options: Mapping[str, str]) -> Template:
    """The template for a --format; options go only to templates that take them, so one
    `source_lang=de` can sit beside alpaca inputs."""
    from prepack.text.formats import get_template

    try:
        return get_template(name, **_taken_options(name, options))
    except ValueError as e:
        raise InputsError(f"format {name!r}: {e}") from e


def _taken_options(name: str, options: Mapping[str, str]) -> dict[str, str]:
    """The options format `name` takes, read from its class (nothing is built to ask)."""
    from prepack.text.formats import template_class

    if name not in template_names():
        raise InputsError(f"unknown format {name!r}; expected one of {', '.join(template_names())}, or auto")
    accepted = {f.name for f in dataclasses.fields(template_class(name))}
    return {k: v for k, v in options.items() if k in accepted}


def checked_format(path: str, fmt: str, options: Mapping[str, str], limits: Any, label: str = "",
                   tfds_data_dir: str | None = None) -> tuple[str, str | None]:
    """The format of an input looked at on its first records, as `prepack pack` does
    (pipelines/launch/format_check.py): (the format, auto resolved, and the note saying so, or
    None); a format the records do not fit is refused in one line."""
    from pipelines.launch.format_check import FormatCheckError, check_source

    _, tasks = read_tasks(path, tfds_data_dir)
    if not tasks:
        return fmt, None
    options = dict(options) if fmt == "auto" else _taken_options(fmt, options)
    try:
        return check_source(fmt, options, tasks[0], limits, label)
    except FormatCheckError as e:
        raise InputsError(str(e)) from None
