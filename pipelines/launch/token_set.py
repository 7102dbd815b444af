"""The launcher's side of the tokenized set (OUTPUT/tokens/). Before the pipeline, for
`--from-tokens DIR`: open the set and refuse it before any work when its manifest is missing or
of another version, when a file it lists is missing or has another size, or when the run asks for
other token choices (inputs, format, template options, chat format, tokenizer); then the run's
config with the set's choices, its read tasks, and the lineage each shard set records. After a
full run: the manifest of the set its writers staged (pipelines/stages/tokens_sink.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from typing import Any

from pipelines.configs import PackConfig
from pipelines.stages.tokens_sink import INDEX_NAME
from pipelines.summary import RunSummary, TokenIndex
from pipelines.wire.records import TaskMeta
from prepack import storage
from prepack.format.layout import RUN_RECORD_NAME, tokens_staging_dir
from prepack.format.manifest import MANIFEST_NAME, ManifestError, ShardInfo
from prepack.format.run_record import RunRecord, RunRecordError
from prepack.format.tokenset import TOKENS_DIR, TokenSetError, TokenSetManifest
from prepack.packing.accounting import Tally


def open_token_set(folder: str) -> TokenSetManifest:
    """The set's manifest, after checking that every file it lists is there with its size."""
    path = f"{folder}/{MANIFEST_NAME}"
    raw = _read_metadata(path)
    if raw is None:
        raise TokenSetError(f"{path} not found: {folder} is not a tokenized set (a `prepack pack` run publishes one "
                            f"as OUTPUT/tokens unless --no-tokens), or its run did not finish")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenSetError(f"{path}: not UTF-8 text, not a tokenized set's manifest; run a full `prepack pack` again") from None
    manifest = TokenSetManifest.from_json(text, source=path)
    _check_run_record(folder, path, hashlib.sha256(raw).hexdigest())
    try:
        tasks_of(manifest)
    except TypeError as e:
        raise TokenSetError(f"{path}: job.tasks is damaged ({e}); run a full `prepack pack` again") from None
    names = [s.path for s in manifest.shards] + ([manifest.dropped] if manifest.dropped else [])
    sizes = _sizes(folder, names)
    for info in manifest.shards:
        size = sizes.get(info.path)
        if size is None:
            raise TokenSetError(f"{folder}/{info.path} is listed in {path} but missing: the tokenized set is incomplete; "
                                f"run a full `prepack pack` again")
        if size != info.num_bytes:
            raise TokenSetError(f"{folder}/{info.path} has {size} bytes, but {path} says {info.num_bytes}: the file does "
                                f"not belong to this tokenized set; run a full `prepack pack` again")
    if manifest.dropped and sizes.get(manifest.dropped) is None:
        raise TokenSetError(f"{folder}/{manifest.dropped} is listed in {path} but missing; run a full `prepack pack` again")
    return manifest


def _check_run_record(folder: str, path: str, digest: str) -> None:
    """OUTPUT/tokens is the tokenized set OUTPUT/published.json names (its manifest's sha256),
    when the record names one: an edit of the manifest (say, of its tokenizer identity) would
    otherwise be carried into every shard set packed from it. A guard against accidents only:
    whoever can write the bucket can rewrite both files."""
    parent, _, name = folder.rstrip("/").rpartition("/")
    if name != TOKENS_DIR or not parent:
        return
    record_path = f"{parent}/{RUN_RECORD_NAME}"
    raw = _read_metadata(record_path)
    if raw is None:
        return
    try:
        named = RunRecord.from_json(raw.decode("utf-8", errors="replace"), record_path).tokens_manifest_sha256
    except RunRecordError as e:
        raise TokenSetError(str(e)) from None
    if named is not None and named != digest:
        raise TokenSetError(
            f"{path} is not the tokenized set {record_path} names (its sha256 is {digest[:12]}..., the record names "
            f"{named[:12]}...): the manifest was edited or replaced after its run; restore it, or run a full `prepack pack` again")


def _read_metadata(path: str) -> bytes | None:
    """A manifest or run record, size-capped (prepack.storage.read_metadata); TokenSetError over the cap."""
    try:
        return storage.read_metadata(path)
    except ManifestError as e:
        raise TokenSetError(str(e)) from None


def _sizes(folder: str, names: list[str]) -> dict[str, int]:
    return {n: size for n, size in storage.file_sizes(folder, names).items() if size is not None}


def reconcile(config: PackConfig, manifest: TokenSetManifest, folder: str) -> PackConfig:
    """The run's config with the token choices of the set; raises TokenSetError (one line)
    when the user asked for other ones."""
    problem = manifest.mismatch(dict(config.run.requested))
    if problem:
        raise TokenSetError(f"{problem} ({folder}/{MANIFEST_NAME}): packing it would need other tokens. Drop the "
                            f"option to pack the tokenized set as it is, or run a full `prepack pack` with --input")
    c = manifest.choices
    rows = dataclasses.replace(
        config.rows, inputs=tuple(c["inputs"]), format=c["format"], template_options=tuple(sorted(c["template_options"].items())),
        chat_format=c["chat_format"], tokenizer=c["tokenizer"], tfds_data_dir=c.get("tfds_data_dir"),
        train_reasoning=c.get("train_reasoning", "yes") == "yes", expand_turns=c.get("expand_turns", False) is True,
        mixture=_remix(config, c.get("mixture"), folder),
    )
    _check_inputs_covered(rows, manifest, folder)
    return dataclasses.replace(config, rows=rows)


def _check_inputs_covered(rows: Any, manifest: TokenSetManifest, folder: str) -> None:
    """A recorded mixture's sources name exactly the set's inputs, in order, and every read task
    an input of them: each example's source is looked up by its input index (a mixture listing
    1 of 2 sources was an IndexError traceback in the launcher)."""
    where = f"{folder}/{MANIFEST_NAME}"
    if rows.mixture.recorded and rows.mixture.inputs() != tuple(rows.inputs):
        raise TokenSetError(
            f"{where}: choices.mixture's sources name the inputs {_listed(rows.mixture.inputs())}, but the set's inputs "
            f"(choices.inputs) are {_listed(rows.inputs)}: the manifest was edited or is damaged; restore it, or run a full "
            "`prepack pack --mixture` again")
    for k, task in enumerate(manifest.job["tasks"]):
        if task["input_index"] >= len(rows.inputs):
            raise TokenSetError(
                f"{where}: job.tasks[{k}].input_index {task['input_index']} names no input of the set's "
                f"{len(rows.inputs)}: the manifest was edited or is damaged; run a full `prepack pack` again")


def _listed(specs: Iterable[str]) -> str:
    from prepack.hostile_input.untrusted import shown

    return shown(list(specs), 160)


def _remix(config: PackConfig, recorded: dict[str, Any] | None, folder: str):
    """The mixture to pack the set with: --mixture's new weights over the set's own sources, or
    the set's recorded mixture; raises TokenSetError (one line) for other sources."""
    from prepack.packing.mixture import Mixture, MixtureError

    if recorded is None:
        if config.rows.mixture.recorded:
            raise TokenSetError(f"--mixture {config.rows.mixture.path}: the tokenized set {folder} was not made from a mixture; "
                                "run a full `prepack pack --mixture` instead")
        return None
    try:
        made = Mixture.from_description(recorded, "choices.mixture")
    except MixtureError as e:
        raise TokenSetError(f"{folder}/{MANIFEST_NAME}: {e}; restore the manifest, or run a full `prepack pack --mixture`") from None
    if not config.rows.mixture.recorded:  # no --mixture given: the set's own
        return made
    problem = made.same_sources(config.rows.mixture)
    if problem:
        raise TokenSetError(f"--mixture {config.rows.mixture.path}: {problem} ({folder}/{MANIFEST_NAME}); re-mixing changes "
                            "weights, weight_of and max_repeats only: run a full `prepack pack --mixture` for other sources")
    return config.rows.mixture


def tasks_of(manifest: TokenSetManifest) -> tuple[TaskMeta, ...]:
    return tuple(TaskMeta(**t) for t in manifest.job["tasks"])


def lineage(manifest: TokenSetManifest, folder: str) -> dict[str, Any]:
    """What a shard set made from the set records about it."""
    return {"from_tokens": folder, "tokens_created_at": manifest.created_at,
            "tokens_manifest_sha256": hashlib.sha256(manifest.to_json().encode("utf-8")).hexdigest()}


def stored_tally(tally_json: dict[str, Any]) -> Tally:
    """The run's counts that do not depend on the max length (what a later run starts from)."""
    return Tally.from_json(tally_json).clear_per_length()  # a mixture's sources too; their sampling is redone


def compose_manifest(summary: RunSummary, index: TokenIndex, tasks: Iterable[TaskMeta],
                     choices: dict[str, Any], job_info: dict[str, Any], est_records: int) -> TokenSetManifest:
    """The manifest of the tokenized set a full run wrote (its files from the writers' index)."""
    tally = stored_tally(summary.tally)
    files = index.files
    num_examples = sum(f.num_rows for f in files)
    tokens = sum(f.tokens for f in files)
    num_bytes = sum(f.num_bytes for f in files)
    stats = {
        "records_read": tally.records_read,
        "records_filtered": dict(sorted(tally.filtered.items())),
        "examples_read": tally.examples_read,
        "examples_kept": num_examples,
        "examples_dropped": tally.examples_dropped(0),  # no per-length reasons are left in it
        "tokens": tokens,
        "bytes": num_bytes,
        "bytes_per_token": num_bytes / tokens if tokens else 0.0,
    }
    return TokenSetManifest(
        shards=[ShardInfo(path=f.path, num_rows=f.num_rows, num_bytes=f.num_bytes, sha256=f.sha256) for f in files],
        num_examples=num_examples,
        tokens=tokens,
        target_tokens=sum(f.target_tokens for f in files),
        choices=choices,
        tokenizer=job_info["tokenizer"],
        template=job_info["template"],
        inputs=job_info["inputs"],
        stats=stats,
        job={"tasks": [dict(vars(t)) for t in tasks], "fingerprints": [list(f) for f in summary.fingerprints], "tally": tally.to_json(),
             "est_records": est_records},
        dropped=index.dropped_name if index.dropped_entries else None,
        tool=job_info["tool"],
    )


def read_index(output: str, run_id: str) -> TokenIndex:
    path = f"{tokens_staging_dir(output, run_id)}/{INDEX_NAME}"
    data = storage.read_bytes(path)
    if data is None:
        raise FileNotFoundError(path)
    return TokenIndex.from_json(data.decode("utf-8"))
