"""The packing job: checks up front, the Beam graph, then checks and publishing.

One module per stage (pipelines/<stage>.py), each exposing one beam.PTransform that
build_pipeline composes, in graph order:

    read     ReadInputs: inputs --Create/Reshuffle--> ReadTaskFn (files, JSONL byte ranges, dataset row ranges)
             [--Reshuffle--, only when a task is a big unsplittable file]
    prepare  PrepareExamples: --> PrepareFn (decode, parse, template, tokenize)
             [oasst1: KeyTableRecordsFn --GroupByKey(tree)--> TableToExamplesFn]
    fit      FitToLengths: --> FitAndKeyFn (overlong policy per L, histogram)
    route    PlanAndRoute: --> PlanFn (global BFD plan per L from the histogram; each group's slice of the slots)
             --> GroupByKey((length, sub-bucket)) --> RouteToRowsFn (side inputs: plans without slots;
                 the group's slice of the slots, looked up by its key in a multimap)
    write    WriteShardSets: --> GroupByKey((shard index, window), across L) --> WriteWindowFn (one window's rows, part files)
             --> GroupByKey((L, shard)) --> AssembleShardFn (parts streamed into the shard, staging)
             plus dead letters per L (WriteDeadLetterFn), tallies, and one summary.json (WriteSummaryFn)
    tokens   tokens_sink.WriteTokenSet (the tokenized set, beside the shard sets);
             --from-tokens: tokens_source.ReadTokenSet stands in for read and prepare

pipelines/stage_shared.py holds what the stages share (context, tags, clocks, the counter merge).

The launcher (`run`) owns everything outside the graph, in four steps: prepare (the
fail-fast checks), run (the lock, then the pipeline), verify (the accounting identity
and bad-fraction checks) and commit (the output layer, pipelines/output/: every
publishing step fenced by the lock), with staging cleaned on every exit it can catch
(interrupts.py for signals) and one-line failures (failures.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import hashlib
import logging
import time
import uuid
from typing import Any

from pipelines import failures, output
from pipelines.launch import checks, interrupts, job_stats, local_memory
from pipelines.launch.errors import JobError
from pipelines.launch.manifest_compose import compose_manifest
from pipelines import sources
from pipelines.stages import tokens_sink, tokens_source
from pipelines.stages.fit import FitToLengths
from pipelines.stages.prepare import PrepareExamples
from pipelines.stages.read import ReadInputs
from pipelines.stages.route import PlanAndRoute
from pipelines.stage_shared import NAMESPACE, JobContext
from pipelines.stages.write import WriteShardSets
from pipelines.configs import PackConfig
from pipelines.planning import choose_sub_buckets
from pipelines.sources import ReadTask, ResolvedInput
from pipelines.summary import LengthStats, RunSummary
from pipelines import failpoints
from prepack.format import layout
from prepack.format.tokenset import TokenSetError, TokenSetManifest
from prepack.packing.mixture import recorded_choices, recorded_templates

log = logging.getLogger("prepack.pack")


@dataclasses.dataclass
class JobResult:
    manifests: dict[int, str]  # max length -> manifest path
    stats: dict[int, dict[str, Any]]  # each length's manifest `stats` (LengthStats.to_json)
    seconds: float
    run_id: str
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)  # said to the user: leftovers, shard counts
    tokens_manifest: str | None = None  # the tokenized set published with the shard sets
    mixtures: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # --mixture: each length's manifest `mixture`


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

    @property
    def config(self) -> PackConfig:
        return self.ctx.config

    @property
    def run_id(self) -> str:
        return self.ctx.run_id


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
    from prepack.text.chat_formats import ChatFormatError, get_chat_format
    from prepack.text.templates import get_template
    from prepack.text.tokenizer import TokenizerError, load_tokenizer

    run_id = run_id or uuid.uuid4().hex[:12]
    try:
        failpoints.check()
    except failpoints.FailpointError as e:
        raise JobError(str(e)) from e
    if config.run.from_tokens:
        return _prepare_from_tokens(config, run_id, existing_refused)
    if resolved is None and not existing_refused:
        checks.refuse_existing(config)
    try:  # a mixture file's formats were checked when it was read; a plain run's one source is checked here
        templates = [get_template(s.format, **dict(s.options)) for s in config.rows.mixture.sources]
    except ValueError as e:
        raise JobError(str(e)) from e
    try:
        tokenizer = load_tokenizer(config.rows.tokenizer)
    except TokenizerError as e:
        raise JobError(f"unknown or unusable tokenizer: {e}") from e
    try:
        chat_format = get_chat_format(config.rows.chat_format, tokenizer, config.rows.train_reasoning)
    except ChatFormatError as e:
        raise JobError(f"chat format: {e.message}") from e
    inputs, tasks = _resolve(config) if resolved is None else resolved
    est = sum(i.est_records for i in inputs)
    sub_buckets = config.rows.sub_buckets or choose_sub_buckets(est * _copies_at_most(config), config.rows.pack)
    ctx = JobContext(config=config, tasks=sources.task_metas(inputs, tasks), sub_buckets=sub_buckets, run_id=run_id,
                     pad_id=int(tokenizer.pad_id), source_of_input=config.rows.mixture.source_of_input())
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
        table_level=any(getattr(t, "table_level", False) for t in templates),
        group_key=next((t.group_key for t in templates if getattr(t, "group_key", None)), None),
        est_records=est,
    )


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
        tokens = tokens_source.open_token_set(config.run.from_tokens)
        config = tokens_source.reconcile(config, tokens, config.run.from_tokens)
    except TokenSetError as e:
        raise JobError(str(e)) from e
    if not existing_refused:
        checks.refuse_existing(config)
    sub_buckets = config.rows.sub_buckets or choose_sub_buckets(tokens.job["est_records"] * _copies_at_most(config), config.rows.pack)
    ctx = JobContext(config=config, tasks=tokens_source.tasks_of(tokens), sub_buckets=sub_buckets, run_id=run_id,
                     pad_id=int(tokens.tokenizer["pad_id"]), source_of_input=config.rows.mixture.source_of_input())
    job_info = {"tokenizer": tokens.tokenizer, "template": tokens.template, "tool": _tool_info(),
                "sub_buckets": sub_buckets, "inputs": tokens.inputs}
    return PreparedJob(ctx=ctx, tasks=[], inputs=[], job_info=job_info,
                       table_level=False, group_key=None, tokens=tokens, est_records=tokens.job["est_records"])


def build_pipeline(pipeline: Any, job: PreparedJob) -> None:
    """The graph: one transform per stage (each stage module's PTransform), in order."""
    from pipelines.stages.mix import SampleMixture

    ctx, config = job.ctx, job.config
    if job.tokens is not None:
        prepared = pipeline | "ReadTokenSet" >> tokens_source.ReadTokenSet(job.tokens, config.run.from_tokens)
        fingerprints = prepared["fingerprints"]
    else:
        read = pipeline | "Read" >> ReadInputs(job.tasks, config.run.batch_size, config.run.progress, config.rows.limits)
        prepared = read["records"] | "Prepare" >> PrepareExamples(ctx, job.table_level, job.group_key)
        fingerprints = read["fingerprints"]
    fitted = prepared["examples"] | "Fit" >> FitToLengths(ctx)
    # Each source's share of every length, before the plan.
    kept = {k: fitted[k] for k in ("keyed", "hist", "tally", "weights")} | "Mix" >> SampleMixture(ctx)
    routed = {"keyed": kept["keyed"], "hist": kept["hist"]} | "Route" >> PlanAndRoute(ctx)
    _ = {"rows": routed["rows"], "plans": routed["plans"], "bad": prepared["bad"], "dead": fitted["dead"],
         "tally_read": prepared["tally"], "tally_fit": kept["tally"], "fingerprints": fingerprints} | "Write" >> WriteShardSets(ctx)
    if config.run.write_tokens:
        _ = ({"examples": prepared["examples"], "bad": prepared["bad"], "dead": fitted["dead"]}
             | "WriteTokenSet" >> tokens_sink.WriteTokenSet(config.run.output, job.run_id, config.rows.max_lengths[0]))


def input_descriptions(job: PreparedJob, fingerprints: tuple[tuple, ...]) -> list[dict[str, Any]]:
    """Each input with its content fingerprint: for files, sha256 over (name, sha256) of its read
    tasks in order: whole files, or the byte ranges of a split JSONL file (fixed by its size)."""
    by_task = {f[0]: f for f in fingerprints}
    out = []
    for resolved in job.inputs:
        desc = resolved.describe()
        tasks = [t for t in job.tasks if t.input_index == resolved.index]
        desc["records"] = sum(by_task[t.task_index][3] for t in tasks if t.task_index in by_task)
        if resolved.kind == "files":
            h = hashlib.sha256()
            for t in tasks:
                h.update(f"{t.name}\t{by_task[t.task_index][1]}\n".encode())
            desc["fingerprint"] = f"sha256:{h.hexdigest()}"
        else:
            desc["fingerprint"] = resolved.fingerprint
        out.append(desc)
    return out


def _metrics(result: Any) -> dict[str, Any]:
    try:
        from apache_beam.metrics.metric import MetricsFilter

        q = result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))
        out: dict[str, Any] = {}
        for c in q["counters"]:
            out[c.key.metric.name] = out.get(c.key.metric.name, 0) + c.committed
        for d in q["distributions"]:
            r = d.committed
            out[d.key.metric.name] = {"count": r.count, "sum": r.sum, "min": r.min, "max": r.max}
        return out
    except Exception:  # metrics are informational; a runner without them must not fail the job
        return {}


class Interrupted(KeyboardInterrupt):
    """The run was interrupted (SIGINT/SIGTERM); the message says what is published now."""


def _acquire_lock(config: PackConfig, run_id: str) -> output.OutputLock:
    try:
        return output.OutputLock.acquire(config.run.output, run_id, config.run.lock_expiry_s)
    except (output.LockHeld, output.LockLost) as e:  # LockLost: a lease too short for its round trip
        raise JobError(str(e)) from e
    except Exception as e:  # a missing bucket, a read-only folder: say so before any work
        raise JobError(f"output {config.run.output!r} is not writable ({type(e).__name__}: {e})") from e


def _leftovers(config: PackConfig, run_id: str, held: output.OutputLock) -> list[str]:
    """Reports (or with --clean-stale removes) what earlier killed runs left in the output."""
    found = output.find_leftovers(config.run.output, run_id)
    if not found.paths:
        return []
    if config.run.clean_stale:
        output.remove_leftovers(found, held)
        return [f"removed {found.describe(config.run.output).split(' holds ', 1)[1]}"]
    return [f"{found.describe(config.run.output)}; pass --clean-stale to remove them"]


def run(config: PackConfig, beam_args: list[str], run_id: str | None = None, existing_refused: bool = False) -> JobResult:
    """Prepare, run, verify, commit; raises JobError (the previous sets intact) on failure.
    `existing_refused`: the caller has already applied the overwrite rule (prepack/overwrite.py)
    to this config, as `prepack pack` does before Beam is imported; it is not applied again."""
    started = time.monotonic()
    job = prepare(config, run_id, existing_refused=existing_refused)
    config = job.config  # --from-tokens: with the token choices of the set
    held = _acquire_lock(config, job.run_id)
    held.on_lost = interrupts.stop_main  # a lease found lost mid-pipeline stops the run at once
    commit: output.Commit | None = None

    def clean_up() -> None:
        output.cleanup_run(config.run.output, config.rows.max_lengths, job.run_id)
        held.release()
        output.storage_for(config.run.output).remove_if_empty(config.run.output)  # a failed first run leaves no folder

    cleanup_key = interrupts.register(clean_up)  # run by the signal watchdog if this thread is stuck
    try:
        failpoints.hit("after_lock")
        held.check()  # a run paused past its lease (a stopped VM, a debugger) learns so before it reads anything
        places = [output.length_place(config.run.output, L) for L in config.rows.max_lengths]
        places += [output.tokens_place(config.run.output)] if config.run.write_tokens else []
        seen = output.look(config.run.output, places, held)
        notes = _leftovers(config, job.run_id, held)
        for note in notes:
            log.warning(note)
        summary, metrics = _run_pipeline(job, _local_beam_args(job, beam_args))
        stats = checks.verify(config, job.run_id, summary, held)
        notes += checks.shard_notes(config, summary)
        lengths, tokens = _staged_sets(job, summary, stats)
        failpoints.hit("before_publish")
        commit = output.Commit(config.run.output, job.run_id, held, seen, config.run.overwrite)
        _commit(commit, config, lengths, tokens)
        tokens_path = layout.tokens_manifest_path(config.run.output) if tokens else None
        figures = {L: s.to_json() for L, s in stats.items()}
        return JobResult(_lengths_switched(commit), figures, time.monotonic() - started, job.run_id, metrics, notes, tokens_path,
                         mixture_objects(config, summary))
    except KeyboardInterrupt as e:
        if held.lost is not None:
            raise JobError(str(held.lost)) from e
        raise Interrupted(_interrupted_message(config, _lengths_switched(commit))) from e
    except output.LockLost as e:  # before the commit (a takeover's rewrite, clean-up, kept dead letters): one line
        raise JobError(str(e)) from e
    except output.SwitchRefused as e:
        raise JobError(f"{e}; the sets now in {config.run.output} are another run's; this run published nothing") from e
    except failpoints.InjectedFault as e:  # after_lock, before_publish: nothing switched yet (the commit's own are caught there)
        raise JobError(failures.injected(str(e))) from e
    except OSError as e:
        if e.errno == errno.ENOSPC:
            if commit is not None and commit.switched:  # the previous sets are not all intact any more: say which are new
                raise JobError(_publish_failed(config, _lengths_switched(commit), e)) from e
            raise JobError(failures.no_space(config.run.output, getattr(e, "filename", None))) from e
        raise
    finally:
        clean_up()
        interrupts.unregister(cleanup_key)


def _local_beam_args(job: PreparedJob, beam_args: list[str]) -> list[str]:
    """On the local runner: as many SDK workers as the examples and this machine's memory allow."""
    if not local_memory.is_local_runner(beam_args):
        return beam_args
    examples = job.est_records if job.tokens is not None else local_memory.estimate_examples(job.inputs, job.tasks)
    beam_args = local_memory.with_local_workers(beam_args, examples)
    local_memory.bound_worker_arenas(beam_args)
    workers = local_memory.local_workers(beam_args)
    log.info("local runner: %d SDK worker process%s for about %s examples", workers, "" if workers == 1 else "es",
             f"{examples:,}")
    # Logged, not kept in the result's notes: it depends on this machine's free memory now.
    too_big = local_memory.warning(examples, workers, local_memory.available_bytes())
    if too_big:
        log.warning(too_big)
    return beam_args


def _run_pipeline(job: PreparedJob, beam_args: list[str]) -> tuple[RunSummary, dict[str, Any]]:
    """Runs the Beam graph; returns the workers' run summary and the job's metrics."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    config = job.config
    try:
        output.probe(config.run.output, job.run_id)
    except Exception as e:
        raise JobError(f"output {config.run.output!r} is not writable ({type(e).__name__}: {e})") from e
    pipeline = beam.Pipeline(options=PipelineOptions(beam_args))
    build_pipeline(pipeline, job)
    result = None
    try:
        result = pipeline.run()
        state = result.wait_until_finish()
    except KeyboardInterrupt:
        _cancel(result)
        raise
    except Exception as e:
        line = failures.one_line(e, config.run.output)
        if line is None:
            raise
        raise JobError(line) from e
    if str(state).split(".")[-1] not in ("DONE", "None"):
        raise JobError(f"the pipeline ended in state {state}; nothing was published")
    return job_stats.read_summary(config.run.output, job.run_id), _metrics(result)


def mixture_objects(config: PackConfig, summary: RunSummary) -> dict[int, dict[str, Any]]:
    """Each length's manifest `mixture` object (prepack.packing.mixture.mixture_manifest); {} for a plain run."""
    from prepack.packing.accounting import Tally
    from prepack.packing.mixture import mixture_manifest

    tally = Tally.from_json(summary.tally)
    objects = {L: mixture_manifest(config.rows.mixture, tally, L) for L in config.rows.max_lengths}
    return {L: o for L, o in objects.items() if o is not None}


def _staged_sets(job: PreparedJob, summary: RunSummary, stats: dict[int, LengthStats]
                 ) -> tuple[dict[int, output.StagedSet], output.StagedSet | None]:
    """The run's staged shard sets and tokenized set, with the manifests that publish them."""
    config = job.config
    if job.tokens is None:
        job.job_info["inputs"] = input_descriptions(job, summary.fingerprints)
    created_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    lengths = {}
    mixtures = mixture_objects(config, summary)
    for L in config.rows.max_lengths:
        manifest = compose_manifest(config, L, stats[L], summary.lengths[L].shards, job.job_info,
                                            summary.lengths[L].plan.method)
        manifest.created_at = created_at
        manifest.mixture = mixtures.get(L)
        manifest.use_row_format(sources=config.rows.mixture.recorded, example_targets=config.rows.cuts_pieces)
        if job.tokens is not None:
            manifest.lineage = tokens_source.lineage(job.tokens, config.run.from_tokens)
        lengths[L] = output.StagedSet(
            output.length_place(config.run.output, L), layout.staging_dir(config.run.output, L, job.run_id),
            manifest.to_json().encode("utf-8"), tuple(s.path for s in manifest.shards), manifest.dead_letter)
    if not config.run.write_tokens:
        return lengths, None
    tokens = _tokens_manifest(job, summary)
    tokens.created_at = created_at
    files = tuple(s.path for s in tokens.shards) + ((tokens.dropped,) if tokens.dropped else ())
    return lengths, output.StagedSet(output.tokens_place(config.run.output), layout.tokens_staging_dir(config.run.output, job.run_id),
                                     tokens.to_json().encode("utf-8"), files)


def _lengths_switched(commit: output.Commit | None) -> dict[int, str]:
    switched = commit.switched if commit is not None else {}
    return {int(name[1:]): path for name, path in switched.items() if name.startswith("L")}


def _commit(commit: output.Commit, config: PackConfig, lengths: dict[int, output.StagedSet],
            tokens: output.StagedSet | None) -> None:
    """Publishes through the output layer; every failure becomes one line saying what is published."""
    try:
        commit.publish(lengths, tokens)
    except output.LockLost as e:
        raise JobError(str(e)) from e
    except output.SwitchRefused as e:
        raise JobError(f"{e}; the sets now in {config.run.output} are another run's") from e
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise
        raise JobError(_publish_failed(config, _lengths_switched(commit), e)) from e
    except Exception as e:  # storage errors while publishing (gs:// 5xx, permissions): say what is published
        raise JobError(_publish_failed(config, _lengths_switched(commit), e)) from e


def _cancel(result: Any) -> None:
    """Cancels a submitted remote job (Dataflow) when the launcher is interrupted; a local
    runner's result is already finished or has none to cancel."""
    if result is None or not hasattr(result, "cancel"):
        return
    try:
        log.warning("interrupted: cancelling the submitted job %s", getattr(result, "job_id", lambda: "")())
        result.cancel()
    except Exception as e:  # already finished, or the service is unreachable: say so and go on
        log.warning("could not cancel the submitted job (%s: %s); cancel it in the console", type(e).__name__, e)


def _partial(config: PackConfig, switched: dict[int, str]) -> str:
    if not switched or len(switched) == len(config.rows.max_lengths):
        return ""
    rest = [L for L in config.rows.max_lengths if L not in switched]
    return (f" (L{', L'.join(map(str, switched))} already hold{'s' if len(switched) == 1 else ''} this run's set, "
            f"L{', L'.join(map(str, rest))} {'does' if len(rest) == 1 else 'do'} not: {layout.run_record_path(config.run.output)} "
            "does not match them; run again with --overwrite)")


def _publish_failed(config: PackConfig, switched: dict[int, str], error: Exception) -> str:
    head = f"publishing into {config.run.output} failed ({type(error).__name__}: {error})"
    if switched:
        return head + (_partial(config, switched) or "; every length was switched: run again with --overwrite to clean up")
    return head + "; nothing new was published, the previous shard sets are intact. Run again"


def _interrupted_message(config: PackConfig, switched: dict[int, str]) -> str:
    if not switched:
        return "interrupted; nothing new was published, the previous shard sets are intact"
    if len(switched) == len(config.rows.max_lengths):
        return "interrupted after every length was switched to the new sets; run again with --overwrite to finish cleaning up"
    return "interrupted while publishing" + _partial(config, switched)


def _tokens_manifest(job: PreparedJob, summary: RunSummary) -> TokenSetManifest:
    """The tokenized set's manifest; raises JobError if its counts do not add up."""
    config = job.config
    choices = {"inputs": list(config.rows.inputs), "format": config.rows.format, "template_options": config.rows.template_kwargs,
               "chat_format": config.rows.chat_format, "tokenizer": config.rows.tokenizer, "tfds_data_dir": config.rows.tfds_data_dir}
    if not config.rows.train_reasoning:  # recorded only when off, so sets made before the option read as "yes"
        choices["train_reasoning"] = "no"
    if config.rows.expand_turns:
        choices["expand_turns"] = True
    choices.update(recorded_choices(config.rows.mixture))  # the sources each example's id names (by its input index)
    index = tokens_sink.read_index(config.run.output, job.run_id)
    manifest = tokens_sink.compose_manifest(summary, index, job.ctx.tasks, choices, job.job_info, job.est_records)
    s = manifest.stats
    if s["examples_read"] != s["examples_kept"] + sum(s["examples_dropped"].values()):
        raise JobError(f"accounting check failed for the tokenized set, nothing was published: examples read "
                               f"{s['examples_read']} != kept {s['examples_kept']} + dropped {sum(s['examples_dropped'].values())}")
    return manifest
