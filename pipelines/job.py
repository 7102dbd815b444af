"""The packing job: checks up front, the Beam graph, then checks and publishing.

One module per stage (pipelines/<stage>.py), in graph order:

    read     inputs --Create/Reshuffle--> ReadTaskFn (files, JSONL byte ranges, dataset row ranges)
             [--Reshuffle--, only when a task is a big unsplittable file]
    prepare  --> PrepareFn (decode, parse, template, tokenize)
             [oasst1: KeyTableRecordsFn --GroupByKey(tree)--> TableToExamplesFn]
    fit      --> FitAndKeyFn (overlong policy per L, histogram)
    route    --> GroupByKey((length, sub-bucket)) --> RouteToRowsFn (side input: the global plans)
    write    --> GroupByKey(shard index, across L) --> WriteShardFn (that shard of every L, staging)
             plus dead letters per L (WriteDeadLetterFn), tallies, and one summary.json (WriteSummaryFn)

pipelines/stage.py holds what the stages share (context, tags, clocks, the counter merge).

The launcher (`run`) owns everything outside the graph: the fail-fast checks,
the accounting identity and bad-fraction checks, and the publishing order.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import time
import uuid
from typing import Any

from pipelines import publish, sources
from pipelines.fit import FitAndKeyFn
from pipelines.prepare import KeyTableRecordsFn, PrepareFn, TableToExamplesFn
from pipelines.read import ReadTaskFn
from pipelines.route import RouteToRowsFn
from pipelines.stage import NAMESPACE, TAG_BAD, TAG_DEAD, TAG_FINGERPRINT, TAG_HIST, TAG_TALLY, JobContext, MergeCounters, MergeTallies
from pipelines.write import WriteDeadLetterFn, WriteShardFn, WriteSummaryFn
from pipelines.options import PackConfig
from pipelines.planning import build_plans, choose_sub_buckets
from pipelines.sources import ReadTask, ResolvedInput

log = logging.getLogger("prepack.pack")


@dataclasses.dataclass
class JobResult:
    manifests: dict[int, str]  # max length -> manifest path
    stats: dict[int, dict[str, Any]]
    seconds: float
    run_id: str
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)


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


def prepare(config: PackConfig, run_id: str | None = None) -> PreparedJob:
    """Every check that can run before the pipeline: raises JobError with one clear line."""
    from prepack.chat_formats import ChatFormatError, get_chat_format
    from prepack.templates import get_template
    from prepack.tokenizer import TokenizerError, load_tokenizer

    run_id = run_id or uuid.uuid4().hex[:12]
    publish.refuse_existing(config)
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
    try:
        inputs, tasks = sources.resolve_inputs(config.inputs, config.tfds_data_dir)
    except sources.InputError as e:
        raise publish.JobError(str(e)) from e
    publish.probe_output(config.output, run_id)
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
    )


def build_pipeline(pipeline: Any, job: PreparedJob) -> None:
    import apache_beam as beam
    from apache_beam.pvalue import AsList, AsSingleton

    ctx, config = job.ctx, job.config
    read = (
        pipeline
        | "ListInputs" >> beam.Create(job.tasks)
        | "SpreadTasks" >> beam.Reshuffle()
        | "Read" >> beam.ParDo(ReadTaskFn(config.batch_size, config.progress)).with_outputs(TAG_FINGERPRINT, main="records")
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
    fitted = prepared.examples | "FitAndKey" >> beam.ParDo(FitAndKeyFn(ctx)).with_outputs(
        TAG_HIST, TAG_TALLY, TAG_DEAD, main="keyed")
    plans = (
        fitted[TAG_HIST]
        | "Histogram" >> beam.CombineGlobally(MergeCounters())
        | "Plan" >> beam.Map(build_plans, config.max_lengths, config.pack, config.num_shards, config.target_shard_mb)
    )
    shards = (
        fitted.keyed
        | "GroupByLength" >> beam.GroupByKey()
        | "RouteToRows" >> beam.ParDo(RouteToRowsFn(ctx), plans=AsSingleton(plans))
        | "GroupByShard" >> beam.GroupByKey()
        | "WriteShards" >> beam.ParDo(WriteShardFn(config.output, job.run_id, ctx.pad_id), plans=AsSingleton(plans))
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
                                           fingerprints=AsList(read[TAG_FINGERPRINT]))
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
            tally=AsSingleton(tally), plans=AsSingleton(plans), shards=AsList(shards), dead=AsList(dead),
            fingerprints=AsList(read[TAG_FINGERPRINT]),
        )
    )


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


def run(config: PackConfig, beam_args: list[str], run_id: str | None = None) -> JobResult:
    """Runs the whole job and publishes; raises JobError (nothing published) on failure."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    started = time.monotonic()
    job = prepare(config, run_id)
    try:
        pipeline = beam.Pipeline(options=PipelineOptions(beam_args))
        build_pipeline(pipeline, job)
        result = pipeline.run()
        state = result.wait_until_finish()
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
        if publish.bad_fraction_error(first, config, []) is not None:
            kept = publish.keep_failed_dead_letters(config, job.run_id)
            raise publish.JobError(publish.bad_fraction_error(first, config, kept))
        no_rows = [L for L in config.max_lengths if stats[L]["rows"] == 0]
        if no_rows:
            raise publish.JobError(
                f"no example fits max length {', '.join(map(str, no_rows))} (examples dropped: "
                f"{stats[no_rows[0]]['examples_dropped']}); nothing was published"
            )
        job.job_info["inputs"] = input_descriptions(job, summary["fingerprints"])
        created_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        manifests = {}
        for L in config.max_lengths:
            shards = summary["lengths"][str(L)]["shards"]
            manifest = publish.compose_manifest(config, L, stats[L], shards, job.job_info)
            manifests[L] = publish.publish_length(config, job.run_id, manifest, created_at)
        publish.cleanup(config, job.run_id)
        return JobResult(manifests, stats, time.monotonic() - started, job.run_id, metrics)
    except BaseException:
        publish.cleanup(config, job.run_id)
        raise
