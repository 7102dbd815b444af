"""The job's first step: every check that can run before the pipeline, and what the launcher
derives from the config and the inputs for the workers (the PreparedJob)."""

from __future__ import annotations

import dataclasses
import sys
import uuid
from typing import Any

from pipelines.faults import failpoints
from pipelines.inputs import sources
from pipelines.configs import PackConfig
from pipelines.launch.errors import JobError
from pipelines.launch import format_check, token_set
from pipelines.launch.existing_sets import refuse_existing
from pipelines.planning import choose_sub_buckets
from pipelines.inputs.sources import ReadTask, ResolvedInput
from pipelines.stage_shared import JobContext
from prepack.format.tokenset import TokenSetError, TokenSetManifest
from prepack.packing.mixture import recorded_templates
from prepack.text.formats import ResolvedFormat


@dataclasses.dataclass
class PreparedJob:
    """The job after its checks: the workers' context (which holds the config and run id), the
    read tasks and resolved inputs, and the facts the manifest records."""

    ctx: JobContext
    tasks: list[ReadTask]
    inputs: list[ResolvedInput]
    job_info: dict[str, Any]
    table_level: bool
    group_key: str | None
    tokens: TokenSetManifest | None = None  # --from-tokens: the set packed from
    est_records: int = 0
    # The context's config and run id, copied once: plain attributes, so the later steps that read
    # them do not call back into this module.
    config: PackConfig = dataclasses.field(init=False, repr=False, compare=False)
    run_id: str = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.config, self.run_id = self.ctx.config, self.ctx.run_id


def _tool_info() -> dict[str, Any]:
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "name": "tunix-prepack",
        "version": version("tunix-prepack"),
        "apache_beam": version("apache-beam"),
        "array_record": version("array-record"),
    }


def prepare(
    config: PackConfig, run_id: str | None = None, resolved: tuple[list[ResolvedInput], list[ReadTask]] | None = None,
    existing_refused: bool = False,
) -> PreparedJob:
    """Every check that can run before the pipeline: raises JobError with one clear line.

    `resolved`: the inputs and read tasks, given by a caller that must touch neither input
    nor output (the offline Dataflow graph check, gcp/dataflow_validate.py); then the
    existing-set, input and output-probe checks are skipped. `existing_refused`: the caller
    has already applied the overwrite rule (prepack/overwrite.py), so it is not applied again."""
    from prepack.text.chat import ChatFormatError, get_chat_format
    from prepack.text.tokenizer import TokenizerError, load_tokenizer

    run_id = run_id or uuid.uuid4().hex[:12]
    try:
        failpoints.check(config.rows.max_lengths, config.run.write_tokens)
    except failpoints.FailpointError as e:
        raise JobError(str(e)) from e
    if config.run.from_tokens:
        return _prepare_from_tokens(config, run_id, existing_refused)
    if resolved is None and not existing_refused:
        refuse_existing(config)
    named = _named_formats(config)  # before the inputs: a bad option is said before a missing file
    inputs, tasks = _resolve(config) if resolved is None else resolved
    if resolved is None:  # the offline Dataflow check reads no input
        config = _checked_formats(config, tasks)
    formats = _resolved_formats(config, named)
    if config.rows.preference and config.rows.cuts_pieces:
        raise JobError(f"--overlong {config.rows.overlong.value} cuts examples into pieces, and a preference pair is packed "
                       "whole (its two sides in one row): use --overlong drop (the default) or truncate, which cuts the "
                       "ends of both completions")
    try:
        tokenizer = load_tokenizer(config.rows.tokenizer)
    except TokenizerError as e:
        raise JobError(f"unknown or unusable tokenizer: {e}") from e
    try:
        chat_format = get_chat_format(config.rows.chat_format, tokenizer, config.rows.train_reasoning)
    except ChatFormatError as e:
        raise JobError(f"chat format: {e.message}") from e
    est = sum(i.est_records for i in inputs)
    sub_buckets = config.rows.sub_buckets or choose_sub_buckets(est * _copies_at_most(config), config.rows.pack)
    ctx = JobContext(config=config, tasks=sources.task_metas(inputs, tasks), sub_buckets=sub_buckets, run_id=run_id,
                     pad_id=int(tokenizer.pad_id), source_of_input=config.rows.mixture.source_of_input(), formats=formats)
    job_info = {
        "tokenizer": tokenizer.identity(),
        "template": {
            "name": config.rows.format,
            "options": config.rows.template_kwargs,
            **recorded_templates(config.rows.mixture),
            "chat_format": config.rows.chat_format,
            "chat_format_resolved": getattr(chat_format, "name", type(chat_format).__name__),
        },
        "tool": _tool_info(),
        "sub_buckets": sub_buckets,
    }
    return PreparedJob(
        ctx=ctx, tasks=tasks, inputs=inputs, job_info=job_info,
        table_level=any(f.features.table_level for f in formats),
        group_key=next((f.features.group_key for f in formats if f.features.group_key is not None), None),
        est_records=est,
    )


def _named_formats(config: PackConfig) -> dict[int, ResolvedFormat]:
    """The sources whose format is named (not `auto`), each checked once with its options; a
    mixture file's were checked when it was read, a plain run's one source is checked here."""
    try:
        return {s.index: ResolvedFormat.checked(s.format, s.options) for s in config.rows.mixture.sources
                if s.format != "auto"}  # auto is resolved from the records (_checked_formats)
    except ValueError as e:
        raise JobError(str(e)) from e


def _resolved_formats(config: PackConfig, named: dict[int, ResolvedFormat]) -> tuple[ResolvedFormat, ...]:
    """Every source's format, once `auto` is resolved: what the workers build theirs from."""
    try:
        return tuple(named.get(s.index) or ResolvedFormat.checked(s.format, s.options) for s in config.rows.mixture.sources)
    except ValueError as e:
        raise JobError(str(e)) from e


def _checked_formats(config: PackConfig, tasks: list[ReadTask]) -> PackConfig:
    """`--format auto` resolved and each source's format checked on its first records
    (format_check.py); the auto choice is said on stderr, as the run's first line."""
    try:
        rows, notes = format_check.check_formats(config.rows, tasks)
    except format_check.FormatCheckError as e:
        raise JobError(str(e)) from e
    for note in notes:
        print(f"prepack pack: {note}", file=sys.stderr)
    return dataclasses.replace(config, rows=rows)


def _copies_at_most(config: PackConfig) -> int:
    """A mixture may write each example up to max_repeats times: the groups the sub-buckets
    bound grow with it (the same figure for a full run and --from-tokens with one mixture file)."""
    return config.rows.mixture.max_repeats


def _resolve(config: PackConfig) -> tuple[list[ResolvedInput], list[ReadTask]]:
    """Every source's inputs, in order; an input that does not resolve is one line naming its source."""
    try:
        return sources.resolve_inputs(config.rows.inputs, config.rows.tfds_data_dir)
    except sources.InputError as e:
        source = config.rows.mixture.source_of_input()[e.input_index] if e.input_index is not None else 1
        raise JobError(f"{config.rows.mixture.naming(source)}{e}") from e


def _prepare_from_tokens(config: PackConfig, run_id: str, existing_refused: bool) -> PreparedJob:
    """--from-tokens: the token choices, tasks and tokenizer identity come from the set."""
    try:
        tokens = token_set.open_token_set(config.run.from_tokens)
        config = token_set.reconcile(config, tokens, config.run.from_tokens)
    except TokenSetError as e:
        raise JobError(str(e)) from e
    if not existing_refused:
        refuse_existing(config)
    sub_buckets = config.rows.sub_buckets or choose_sub_buckets(tokens.job["est_records"] * _copies_at_most(config), config.rows.pack)
    ctx = JobContext(config=config, tasks=token_set.tasks_of(tokens), sub_buckets=sub_buckets, run_id=run_id,
                     pad_id=int(tokens.tokenizer["pad_id"]), source_of_input=config.rows.mixture.source_of_input())
    job_info = {"tokenizer": tokens.tokenizer, "template": tokens.template, "tool": _tool_info(),
                "sub_buckets": sub_buckets, "inputs": tokens.inputs}
    return PreparedJob(ctx=ctx, tasks=[], inputs=[], job_info=job_info,
                       table_level=False, group_key=None, tokens=tokens, est_records=tokens.job["est_records"])
