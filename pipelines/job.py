"""The packing job: checks up front, the Beam graph, then checks and publishing.

One module per stage (pipelines/<stage>.py), in graph order:

    read     inputs --Create/Reshuffle--> ReadTaskFn (files, JSONL byte ranges, dataset row ranges)
             [--Reshuffle--, only when a task is a big unsplittable file]
    prepare  --> PrepareFn (decode, parse, template, tokenize)
             [oasst1: KeyTableRecordsFn --GroupByKey(tree)--> TableToExamplesFn]
    fit      --> FitAndKeyFn (overlong policy per L, histogram)
    route    --> PlanFn (global BFD plan per L from the histogram; each group's slice of the slots)
             --> GroupByKey((length, sub-bucket)) --> RouteToRowsFn (side inputs: plans without slots;
                 the group's slice of the slots, looked up by its key in a multimap)
    write    --> GroupByKey((shard index, window), across L) --> WriteWindowFn (one window's rows, part files)
             --> GroupByKey((L, shard)) --> AssembleShardFn (parts streamed into the shard, staging)
             plus dead letters per L (WriteDeadLetterFn), tallies, and one summary.json (WriteSummaryFn)

pipelines/stage.py holds what the stages share (context, tags, clocks, the counter merge).

The launcher (`run`) owns everything outside the graph: the fail-fast checks,
the output lock (lock.py), the accounting identity and bad-fraction checks, the
publishing order (swap.py), staging clean-up on every exit it can catch
(staging.py, and interrupts.py for signals), and one-line failures (failures.py).
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

from pipelines import failures, interrupts, local_memory, lock, outputs, publish, sources, staging, swap, tokens_sink, tokens_source
from pipelines.fit import FitAndKeyFn
from pipelines.prepare import KeyTableRecordsFn, PrepareFn, TableToExamplesFn
from pipelines.read import ReadTaskFn
from pipelines.route import PlanFn, RouteToRowsFn
from pipelines.stage import (NAMESPACE, TAG_BAD, TAG_DEAD, TAG_FINGERPRINT, TAG_HIST, TAG_PLAN, TAG_TALLY, JobContext,
                             MergeCounters, MergeTallies)
from pipelines.write import AssembleShardFn, WriteDeadLetterFn, WriteSummaryFn, WriteWindowFn
from pipelines.options import PackConfig
from pipelines.planning import choose_sub_buckets
from pipelines.sources import ReadTask, ResolvedInput
from prepack.accounting import NO_TARGETS
from prepack.tokenset import TokenSetError, TokenSetManifest

log = logging.getLogger("prepack.pack")


@dataclasses.dataclass
class JobResult:
    manifests: dict[int, str]  # max length -> manifest path
    stats: dict[int, dict[str, Any]]
    seconds: float
    run_id: str
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)  # said to the user: leftovers, shard counts
    tokens_manifest: str | None = None  # the tokenized set published with the shard sets


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
    config: PackConfig, run_id: str | None = None, resolved: tuple[list[ResolvedInput], list[ReadTask]] | None = None
) -> PreparedJob:
    """Every check that can run before the pipeline: raises JobError with one clear line.

    `resolved`: the inputs and read tasks, given by a caller that must touch neither input
    nor output (the offline Dataflow graph check, gcp/dataflow_validate.py); then the
    existing-set, input and output-probe checks are skipped."""
    from prepack.chat_formats import ChatFormatError, get_chat_format
    from prepack.templates import get_template
    from prepack.tokenizer import TokenizerError, load_tokenizer

    run_id = run_id or uuid.uuid4().hex[:12]
    if config.from_tokens:
        return _prepare_from_tokens(config, run_id)
    if resolved is None:
        publish.refuse_existing(config)
        if config.write_tokens and not config.overwrite:
            refused = tokens_sink.refuse_existing(config.output)
            if refused:
                raise publish.JobError(refused)
    try:
        template = get_template(config.format, **config.template_kwargs)
    except ValueError as e:
        raise publish.JobError(str(e)) from e
    try:
        tokenizer = load_tokenizer(config.tokenizer)
    except TokenizerError as e:
        raise publish.JobError(f"unknown or unusable tokenizer: {e}") from e
    try:
        chat_format = get_chat_format(config.chat_format, tokenizer)
    except ChatFormatError as e:
        raise publish.JobError(f"chat format: {e.message}") from e
    if resolved is None:
        try:
            inputs, tasks = sources.resolve_inputs(config.inputs, config.tfds_data_dir)
        except sources.InputError as e:
            raise publish.JobError(str(e)) from e
    else:
        inputs, tasks = resolved
    est = sum(i.est_records for i in inputs)
    sub_buckets = config.sub_buckets or choose_sub_buckets(est, config.pack)
    ctx = JobContext(config=config, tasks=sources.task_metas(inputs, tasks), sub_buckets=sub_buckets, run_id=run_id,
                     pad_id=int(tokenizer.pad_id))
    job_info = {
        "tokenizer": tokenizer.identity(),
        "template": {
            "name": config.format,
            "options": config.template_kwargs,
            "chat_format": config.chat_format,
            "chat_format_resolved": getattr(chat_format, "name", type(chat_format).__name__),
        },
        "tool": _tool_info(),
        "sub_buckets": sub_buckets,
    }
    return PreparedJob(
        ctx=ctx, tasks=tasks, inputs=inputs, job_info=job_info,
        table_level=bool(getattr(template, "table_level", False)), group_key=getattr(template, "group_key", None),
        est_records=est,
    )


def _prepare_from_tokens(config: PackConfig, run_id: str) -> PreparedJob:
    """--from-tokens: the token choices, tasks and tokenizer identity come from the set."""
    try:
        tokens = tokens_source.open_token_set(config.from_tokens)
        config = tokens_source.reconcile(config, tokens, config.from_tokens)
    except TokenSetError as e:
        raise publish.JobError(str(e)) from e
    publish.refuse_existing(config)
    sub_buckets = config.sub_buckets or choose_sub_buckets(tokens.job["est_records"], config.pack)
    ctx = JobContext(config=config, tasks=tokens_source.tasks_of(tokens), sub_buckets=sub_buckets, run_id=run_id,
                     pad_id=int(tokens.tokenizer["pad_id"]))
    job_info = {"tokenizer": tokens.tokenizer, "template": tokens.template, "tool": _tool_info(),
                "sub_buckets": sub_buckets, "inputs": tokens.inputs}
    return PreparedJob(ctx=ctx, tasks=[], inputs=[], job_info=job_info,
                       table_level=False, group_key=None, tokens=tokens, est_records=tokens.job["est_records"])


def build_pipeline(pipeline: Any, job: PreparedJob) -> None:
    import apache_beam as beam

    ctx, config = job.ctx, job.config
    if job.tokens is not None:
        examples, bads, tallies, fingerprints = tokens_source.read_tokens(pipeline, job.tokens, config.from_tokens)
        _fit_route_write(pipeline, job, examples, bads, tallies, fingerprints)
        return
    read = (
        pipeline
        | "ListInputs" >> beam.Create(job.tasks)
        | "SpreadTasks" >> beam.Reshuffle()
        | "Read" >> beam.ParDo(ReadTaskFn(config.batch_size, config.progress, config.limits)).with_outputs(TAG_FINGERPRINT, main="records")
    )
    # Records cross a shuffle only when some task is big and unsplittable (a large compressed or
    # non-JSONL file); byte ranges and dataset row ranges already spread the reading evenly.
    spread = any(t.may_exceed(sources.SPREAD_TASK_BYTES) for t in job.tasks)
    raw = read.records | "SpreadRecords" >> beam.Reshuffle() if spread else read.records
    if job.table_level:
        keyed = raw | "KeyByTable" >> beam.ParDo(KeyTableRecordsFn(ctx, job.group_key)).with_outputs(TAG_BAD, TAG_TALLY, main="messages")
        prepared = (
            keyed.messages
            | "GroupTables" >> beam.GroupByKey()
            | "TemplateTokenize" >> beam.ParDo(TableToExamplesFn(ctx)).with_outputs(TAG_BAD, TAG_TALLY, main="examples")
        )
        bads, tallies = [keyed[TAG_BAD], prepared[TAG_BAD]], [keyed[TAG_TALLY], prepared[TAG_TALLY]]
    else:
        prepared = raw | "TemplateTokenize" >> beam.ParDo(PrepareFn(ctx)).with_outputs(TAG_BAD, TAG_TALLY, main="examples")
        bads, tallies = [prepared[TAG_BAD]], [prepared[TAG_TALLY]]
    fitted = _fit_route_write(pipeline, job, prepared.examples, bads, tallies, read[TAG_FINGERPRINT])
    if config.write_tokens:
        first = config.max_lengths[0]
        no_targets = fitted[TAG_DEAD] | "NoTargetsOnce" >> beam.FlatMap(
            lambda le: [le[1]] if le[0] == first and le[1][1]["reason"] == NO_TARGETS else [])
        dropped = (*bads, no_targets) | "FlattenDropped" >> beam.Flatten()
        tokens_sink.add_to_pipeline(pipeline, prepared.examples, dropped, config.output, job.run_id)


def _fit_route_write(pipeline: Any, job: PreparedJob, examples: Any, bads: list, tallies: list, fingerprints: Any) -> Any:
    """From TokenizedBatches (tokenized now, or read from a tokenized set) to staged shard
    sets, dead letters and the run summary; returns FitAndKeyFn's outputs."""
    import apache_beam as beam
    from apache_beam.pvalue import AsDict, AsList, AsMultiMap, AsSingleton

    ctx, config = job.ctx, job.config
    fitted = examples | "FitAndKey" >> beam.ParDo(FitAndKeyFn(ctx)).with_outputs(
        TAG_HIST, TAG_TALLY, TAG_DEAD, main="keyed")
    planned = (
        fitted[TAG_HIST]
        | "Histogram" >> beam.CombineGlobally(MergeCounters())
        | "Plan" >> beam.ParDo(PlanFn(config.max_lengths, config.pack, config.num_shards, config.target_shard_mb))
        .with_outputs(TAG_PLAN, main="slices")
    )
    # Every worker holds the plans without their slots (O(groups)); each (length, sub-bucket)
    # group reads its own slice of the slots from a multimap side input, fetched per key.
    plans = AsDict(planned[TAG_PLAN])
    shards = (
        fitted.keyed
        | "GroupByLength" >> beam.GroupByKey()
        | "RouteToRows" >> beam.ParDo(RouteToRowsFn(ctx), plans=plans, slices=AsMultiMap(planned.slices))
        | "GroupByWindow" >> beam.GroupByKey()
        | "WriteWindows" >> beam.ParDo(WriteWindowFn(config.output, job.run_id, ctx.pad_id), plans=plans)
        | "GroupByShard" >> beam.GroupByKey()
        | "WriteShards" >> beam.ParDo(AssembleShardFn(config.output, job.run_id), plans=plans)
    )
    lengths = config.max_lengths
    bad_per_length = (
        tuple(bads) | "FlattenBad" >> beam.Flatten()
        | "BadToEveryLength" >> beam.FlatMap(lambda entry: [(L, entry) for L in lengths])
    )
    dead = (
        (bad_per_length, fitted[TAG_DEAD]) | "FlattenDead" >> beam.Flatten()
        | "GroupDead" >> beam.GroupByKey()
        | "WriteDeadLetters" >> beam.ParDo(WriteDeadLetterFn(config.output, job.run_id, ctx.tasks),
                                           fingerprints=AsList(fingerprints))
    )
    tally = (
        (*tallies, fitted[TAG_TALLY]) | "FlattenTally" >> beam.Flatten()
        | "Tally" >> beam.CombineGlobally(MergeTallies())
    )
    (
        pipeline
        | "Once" >> beam.Create([None])
        | "WriteSummary" >> beam.ParDo(
            WriteSummaryFn(config.output, job.run_id),
            tally=AsSingleton(tally), plans=plans, shards=AsList(shards), dead=AsList(dead),
            fingerprints=AsList(fingerprints),
        )
    )
    return fitted


def input_descriptions(job: PreparedJob, fingerprints: list[list]) -> list[dict[str, Any]]:
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


def _acquire_lock(config: PackConfig, run_id: str) -> lock.OutputLock:
    try:
        return lock.OutputLock.acquire(config.output, run_id)
    except lock.LockHeld as e:
        raise publish.JobError(str(e)) from e
    except Exception as e:  # a missing bucket, a read-only folder: say so before any work
        raise publish.JobError(f"output {config.output!r} is not writable ({type(e).__name__}: {e})") from e


def _leftovers(config: PackConfig, run_id: str) -> list[str]:
    """Reports (or with --clean-stale removes) what earlier killed runs left in the output."""
    found = staging.find_leftovers(config.output, run_id)
    if not found.paths:
        return []
    if config.clean_stale:
        staging.remove_leftovers(found)
        return [f"removed {found.describe(config.output).split(' holds ', 1)[1]}"]
    return [f"{found.describe(config.output)}; pass --clean-stale to remove them"]


def _empty_or_all_bad(stats: dict[str, Any], config: PackConfig, kept: list[str]) -> str | None:
    if stats["records_read"] == 0:
        return (f"the inputs hold no records ({', '.join(config.inputs)} {'is' if len(config.inputs) == 1 else 'are'} "
                "empty); nothing was published. Check --input")
    if stats["examples_read"] and stats["bad_records"] == stats["examples_read"]:
        where = f"; they are listed in {kept[0]}" if kept else ""
        return (f"all {stats['examples_read']} examples read are bad records ({', '.join(f'{k} {v}' for k, v in sorted(stats['examples_dropped'].items()))})"
                f"; nothing was published{where}. Check --format and the inputs")
    if stats["examples_read"] == 0:
        return (f"no examples in the inputs ({stats['records_read']} records read, "
                f"{sum(stats['records_filtered'].values())} left out by design); nothing was published")
    return None


def _shard_notes(config: PackConfig, summary: dict[str, Any]) -> list[str]:
    notes = []
    for L in config.max_lengths:
        written = summary["lengths"][str(L)]["plan"]["num_shards"]
        if config.num_shards is not None and written < config.num_shards:
            rows = summary["lengths"][str(L)]["plan"]["num_rows"]
            notes.append(f"L{L}: --num-shards {config.num_shards} asked, {written} written ({rows} rows; a shard holds at least one row)")
    return notes


def run(config: PackConfig, beam_args: list[str], run_id: str | None = None) -> JobResult:
    """Runs the whole job and publishes; raises JobError (the previous sets intact) on failure."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    started = time.monotonic()
    job = prepare(config, run_id)
    config = job.config  # --from-tokens: with the token choices of the set
    held = _acquire_lock(config, job.run_id)
    switched: dict[int, str] = {}
    result = None

    def clean_up() -> None:
        staging.cleanup_run(config.output, config.max_lengths, job.run_id)
        tokens_sink.cleanup(config.output, job.run_id)
        held.release()
        outputs.remove_if_empty(config.output)  # a failed first run into a new folder leaves no folder behind

    cleanup_key = interrupts.register(clean_up)  # run by the signal watchdog if this thread is stuck
    try:
        seen = swap.look(config.output, config.max_lengths)
        notes = _leftovers(config, job.run_id)
        if local_memory.is_local_runner(beam_args):
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
        for note in notes:
            log.warning(note)
        publish.probe_output(config.output, job.run_id)
        pipeline = beam.Pipeline(options=PipelineOptions(beam_args))
        build_pipeline(pipeline, job)
        try:
            result = pipeline.run()
            state = result.wait_until_finish()
        except KeyboardInterrupt:
            _cancel(result)
            raise
        except Exception as e:
            line = failures.one_line(e, config.output)
            if line is None:
                raise
            raise publish.JobError(line) from e
        if str(state).split(".")[-1] not in ("DONE", "None"):
            raise publish.JobError(f"the pipeline ended in state {state}; nothing was published")
        metrics = _metrics(result)
        summary = publish.read_summary(config.output, job.run_id)
        stats: dict[int, dict[str, Any]] = {}
        problems: list[str] = []
        for L in config.max_lengths:
            stats[L] = publish.length_stats(summary, L, config.pack)
            problems += publish.check_stats(stats[L], L, summary["lengths"][str(L)]["plan"])
        if problems:
            raise publish.JobError("accounting check failed, nothing was published: " + "; ".join(problems))
        first = stats[config.max_lengths[0]]
        if _empty_or_all_bad(first, config, []) is not None:
            kept = publish.keep_failed_dead_letters(config, job.run_id) if first["bad_records"] else []
            raise publish.JobError(_empty_or_all_bad(first, config, kept))
        if publish.bad_fraction_error(first, config, []) is not None:
            kept = publish.keep_failed_dead_letters(config, job.run_id)
            raise publish.JobError(publish.bad_fraction_error(first, config, kept))
        no_rows = [L for L in config.max_lengths if stats[L]["rows"] == 0]
        if no_rows:
            raise publish.JobError(
                f"no example fits max length {', '.join(map(str, no_rows))} (examples dropped: "
                f"{stats[no_rows[0]]['examples_dropped']}); nothing was published"
            )
        for note in _shard_notes(config, summary):
            log.warning(note)
            notes.append(note)
        if job.tokens is None:
            job.job_info["inputs"] = input_descriptions(job, summary["fingerprints"])
        tokens_manifest = _tokens_manifest(job, summary) if config.write_tokens else None
        created_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        manifests = {}
        for L in config.max_lengths:
            manifests[L] = publish.compose_manifest(config, L, stats[L], summary["lengths"][str(L)]["shards"], job.job_info)
            manifests[L].created_at = created_at
            if job.tokens is not None:
                manifests[L].lineage = tokens_source.lineage(job.tokens, config.from_tokens)
        # The run record names OUTPUT/tokens/manifest.json as it is once this run is published.
        if tokens_manifest is not None:
            tokens_manifest.created_at = created_at
            tokens_sha256 = hashlib.sha256(tokens_manifest.to_json().encode("utf-8")).hexdigest()
        else:
            tokens_sha256 = tokens_source.manifest_sha256(tokens_sink.tokens_dir(config.output))
        # Checked again at the last moment: the lock is still ours, and nothing appeared meanwhile.
        swap.fault_point("before_publish")
        try:
            held.check()
        except lock.LockLost as e:
            raise publish.JobError(str(e)) from e
        publish.refuse_existing(config)
        try:
            switched = swap.publish(config.output, job.run_id, manifests, seen, config.overwrite, progress=switched,
                                    tokens_manifest_sha256=tokens_sha256)
        except outputs.SwitchRefused as e:
            raise publish.JobError(f"{e}; the sets now in {config.output} are another run's") from e
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise
            raise publish.JobError(_publish_failed(config, switched, e)) from e
        except Exception as e:  # storage errors while publishing (gs:// 5xx, permissions): say what is published
            raise publish.JobError(_publish_failed(config, switched, e)) from e
        tokens_path = None
        if tokens_manifest is not None:
            try:
                tokens_path = tokens_sink.publish(config.output, job.run_id, tokens_manifest, created_at)
            except Exception as e:  # the shard sets are published; say that the tokenized set is not
                raise publish.JobError(f"the shard sets are published, but the tokenized set {config.output}/tokens "
                                       f"could not be ({type(e).__name__}: {e}); run again to publish it") from e
        return JobResult(switched, stats, time.monotonic() - started, job.run_id, metrics, notes, tokens_path)
    except KeyboardInterrupt as e:
        raise Interrupted(_interrupted_message(config, switched)) from e
    except OSError as e:
        if e.errno == errno.ENOSPC:
            if switched:  # the previous sets are not all intact any more: say which lengths are new
                raise publish.JobError(_publish_failed(config, switched, e)) from e
            raise publish.JobError(failures.no_space(config.output, getattr(e, "filename", None))) from e
        raise
    finally:
        clean_up()
        interrupts.unregister(cleanup_key)


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
    if not switched or len(switched) == len(config.max_lengths):
        return ""
    rest = [L for L in config.max_lengths if L not in switched]
    return (f" (L{', L'.join(map(str, switched))} already hold{'s' if len(switched) == 1 else ''} this run's set, "
            f"L{', L'.join(map(str, rest))} {'does' if len(rest) == 1 else 'do'} not: {config.output}/{swap.RUN_RECORD_NAME} "
            "does not match them; run again with --overwrite)")


def _publish_failed(config: PackConfig, switched: dict[int, str], error: Exception) -> str:
    head = f"publishing into {config.output} failed ({type(error).__name__}: {error})"
    if switched:
        return head + (_partial(config, switched) or "; every length was switched: run again with --overwrite to clean up")
    return head + "; nothing new was published, the previous shard sets are intact. Run again"


def _interrupted_message(config: PackConfig, switched: dict[int, str]) -> str:
    if not switched:
        return "interrupted; nothing new was published, the previous shard sets are intact"
    if len(switched) == len(config.max_lengths):
        return "interrupted after every length was switched to the new sets; run again with --overwrite to finish cleaning up"
    return "interrupted while publishing" + _partial(config, switched)


def _tokens_manifest(job: PreparedJob, summary: dict[str, Any]) -> TokenSetManifest:
    """The tokenized set's manifest; raises JobError if its counts do not add up."""
    config = job.config
    choices = {"inputs": list(config.inputs), "format": config.format, "template_options": config.template_kwargs,
               "chat_format": config.chat_format, "tokenizer": config.tokenizer, "tfds_data_dir": config.tfds_data_dir}
    index = tokens_sink.read_index(config.output, job.run_id)
    manifest = tokens_sink.compose_manifest(summary, index, job.ctx.tasks, choices, job.job_info, job.est_records)
    s = manifest.stats
    if s["examples_read"] != s["examples_kept"] + sum(s["examples_dropped"].values()):
        raise publish.JobError(f"accounting check failed for the tokenized set, nothing was published: examples read "
                               f"{s['examples_read']} != kept {s['examples_kept']} + dropped {sum(s['examples_dropped'].values())}")
    return manifest
