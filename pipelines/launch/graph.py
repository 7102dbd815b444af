"""The job's second step: the Beam graph, one transform per stage in the order the data flows, and
running it (on the local runner, with as many SDK workers as the examples and memory allow).

    read     ReadInputs: inputs --Create/Reshuffle--> ReadTaskFn (files, JSONL byte ranges, dataset row ranges)
             [--Reshuffle--, only when a task is a big unsplittable file]
    prepare  PrepareExamples: --> PrepareFn (decode, parse, template, tokenize)
             [oasst1: KeyTableRecordsFn --GroupByKey(tree)--> TableToExamplesFn]
    fit      FitToLengths: --> FitAndKeyFn (overlong policy per L, histogram)
    mix      SampleMixture: each source's share of every length, before the plan (a plain run passes through)
    route    PlanAndRoute: --> PlanFn (global BFD plan per L from the histogram; each group's slice of the slots)
             --> GroupByKey((length, sub-bucket)) --> RouteToRowsFn (side inputs: plans without slots;
                 the group's slice of the slots, looked up by its key in a multimap)
    write    WriteShardSets: --> GroupByKey((shard index, window), across L) --> WriteWindowFn (one window's rows, part files)
             --> GroupByKey((L, shard)) --> AssembleShardFn (parts streamed into the shard, staging)
             plus dead letters per L (WriteDeadLetterFn), tallies, and one summary.json (WriteSummaryFn)
    tokens   tokens_sink.WriteTokenSet (the tokenized set, beside the shard sets);
             --from-tokens: tokens_source.ReadTokenSet stands in for read and prepare

pipelines/stage_shared.py holds what the stages share (context, tags, clocks, the counter merge).
"""

from __future__ import annotations

import logging
from typing import Any

from pipelines import output
from pipelines.faults import failures
from pipelines.launch import job_stats, local_memory
from pipelines.launch.errors import JobError
from pipelines.launch.prepare_job import PreparedJob
from pipelines.stage_shared import NAMESPACE
from pipelines.stages import tokens_sink, tokens_source
from pipelines.stages.fit import FitToLengths
from pipelines.stages.mix import SampleMixture
from pipelines.stages.prepare import PrepareExamples
from pipelines.stages.read import ReadInputs
from pipelines.stages.route import PlanAndRoute
from pipelines.stages.write import WriteShardSets
from pipelines.summary import RunSummary

log = logging.getLogger("prepack.pack")


def build_pipeline(pipeline: Any, job: PreparedJob) -> None:
    """The graph: one transform per stage (each stage module's PTransform), in order."""
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


def run_pipeline(job: PreparedJob, beam_args: list[str]) -> tuple[RunSummary, dict[str, Any]]:
    """Runs the Beam graph; returns the workers' run summary and the job's metrics. Raises JobError
    with one line (nothing published) when the output is not writable or the pipeline fails."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    config = job.config
    beam_args = _local_beam_args(job, beam_args)
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
