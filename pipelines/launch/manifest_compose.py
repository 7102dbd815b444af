"""The job's last step before the commit: what it publishes, composed from the verified figures:
each length's manifest (with its mixture object and row format), the tokenized set's manifest, and
the staged sets they describe.

Writing them, in the order that lets readers see the old sets or the new ones, never a mix,
is the output layer's (pipelines/output/commit.py)."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
from typing import Any

from pipelines import output
from pipelines.configs import PackConfig
from pipelines.launch.errors import JobError
from pipelines.launch.prepare_job import PreparedJob
from pipelines.launch import token_set
from pipelines.summary import LengthStats, RunSummary, ShardSummary
from prepack.format import layout
from prepack.format.manifest import DEAD_LETTER_NAME, Manifest, ShardInfo
from prepack.format.tokenset import TokenSetManifest
from prepack.packing.mixture import recorded_choices


@dataclasses.dataclass(frozen=True)
class StagedSets:
    """What the commit publishes: each length's staged shard set, the tokenized set (when written),
    and each length's manifest `mixture` object ({} for a plain run), which the job reports."""

    lengths: dict[int, output.StagedSet]
    tokens: output.StagedSet | None
    mixtures: dict[int, dict[str, Any]]



def compose_manifest(
    config: PackConfig, max_length: int, stats: LengthStats, shards: tuple[ShardSummary, ...], job_info: dict[str, Any],
    method: str | None = None,
) -> Manifest:
    """`method`: what made the rows (the plan's: bfd, exact_fill or unpacked), the manifest's `packing`."""
    infos = [ShardInfo(path=s.path, num_rows=s.num_rows, num_bytes=s.num_bytes, sha256=s.sha256) for s in shards]
    return Manifest(
        max_length=max_length,
        num_rows=sum(s.num_rows for s in infos),
        shards=infos,
        tokenizer=job_info["tokenizer"],
        stats=stats.to_json(),
        packing=method or ("bfd" if config.rows.pack else "unpacked"),
        template=job_info["template"],
        inputs=job_info["inputs"],
        options={**config.rows.manifest_options(), "sub_buckets": job_info["sub_buckets"]},
        tool=job_info["tool"],
        dead_letter=DEAD_LETTER_NAME if stats.dead_letter_entries else None,
    )


def staged_sets(job: PreparedJob, summary: RunSummary, stats: dict[int, LengthStats]) -> StagedSets:
    """The run's staged shard sets and tokenized set, with the manifests that publish them, and each
    length's manifest `mixture` object."""
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
        manifest.use_row_format(sources=config.rows.mixture.recorded, example_targets=config.rows.cuts_pieces,
                                preference=config.rows.preference)
        if job.tokens is not None:
            manifest.lineage = token_set.lineage(job.tokens, config.run.from_tokens)
        lengths[L] = output.StagedSet(
            output.length_place(config.run.output, L), layout.staging_dir(config.run.output, L, job.run_id),
            manifest.to_json().encode("utf-8"), tuple(s.path for s in manifest.shards), manifest.dead_letter)
    if not config.run.write_tokens:
        return StagedSets(lengths, None, mixtures)
    tokens = _tokens_manifest(job, summary)
    tokens.created_at = created_at
    files = tuple(s.path for s in tokens.shards) + ((tokens.dropped,) if tokens.dropped else ())
    return StagedSets(lengths, output.StagedSet(output.tokens_place(config.run.output),
                                                layout.tokens_staging_dir(config.run.output, job.run_id),
                                                tokens.to_json().encode("utf-8"), files), mixtures)


def mixture_objects(config: PackConfig, summary: RunSummary) -> dict[int, dict[str, Any]]:
    """Each length's manifest `mixture` object (prepack.packing.mixture.mixture_manifest); {} for a plain run."""
    from prepack.packing.accounting import Tally
    from prepack.packing.mixture import mixture_manifest

    tally = Tally.from_json(summary.tally)
    objects = {L: mixture_manifest(config.rows.mixture, tally, L) for L in config.rows.max_lengths}
    return {L: o for L, o in objects.items() if o is not None}


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
    index = token_set.read_index(config.run.output, job.run_id)
    manifest = token_set.compose_manifest(summary, index, job.ctx.tasks, choices, job.job_info, job.est_records)
    s = manifest.stats
    if s["examples_read"] != s["examples_kept"] + sum(s["examples_dropped"].values()):
        raise JobError(f"accounting check failed for the tokenized set, nothing was published: examples read "
                               f"{s['examples_read']} != kept {s['examples_kept']} + dropped {sum(s['examples_dropped'].values())}")
    return manifest
