"""`prepack pack --from-tokens DIR`: a tokenized set as the job's source.

The launcher opens the set and refuses it before any work when its manifest is missing or
of another version, when a file it lists is missing or has another size, or when the run
asks for other token choices (inputs, format, template options, chat format, tokenizer).
The graph then starts from the set's files instead of reading and tokenizing: each file is
one task (Create + Reshuffle, so any runner spreads them), read in batches into the same
TokenizedBatches the tokenizer makes; the tallies, dead letters and input fingerprints of
the run that tokenized them enter as they were. Everything after that is the full run's
graph, so the shard sets are the full run's, byte for byte.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.metrics.metric import Metrics

from pipelines.columns import LENS, Ragged, TokenizedBatch
from pipelines.options import PackConfig
from pipelines.planning import stable_hash
from pipelines.records import TaskMeta
from pipelines.stage import StageClock
from prepack.accounting import Tally
from prepack.manifest import MANIFEST_NAME
from prepack.tokenset import TokenSetError, TokenSetManifest, decode_batch

NAMESPACE = "prepack"
READ_BATCH = 4096  # records per TokenizedBatch
COPY_BLOCK = 8 << 20


def _fs():
    from apache_beam.io.filesystems import FileSystems

    return FileSystems


def open_token_set(folder: str) -> TokenSetManifest:
    """The set's manifest, after checking that every file it lists is there with its size."""
    fs = _fs()
    path = f"{folder}/{MANIFEST_NAME}"
    if not fs.exists(path):
        raise TokenSetError(f"{path} not found: {folder} is not a tokenized set (a `prepack pack` run publishes one "
                            f"as OUTPUT/tokens unless --no-tokens), or its run did not finish")
    with fs.open(path) as f:
        manifest = TokenSetManifest.from_json(f.read().decode("utf-8"), source=path)
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


def _sizes(folder: str, names: list[str]) -> dict[str, int]:
    try:
        found = _fs().match([f"{folder}/*"])[0].metadata_list
    except Exception:
        found = []
    by_name = {m.path.rsplit("/", 1)[-1]: m.size_in_bytes for m in found}
    return {n: by_name[n] for n in names if n in by_name}


def reconcile(config: PackConfig, manifest: TokenSetManifest, folder: str) -> PackConfig:
    """The run's config with the token choices of the set; raises TokenSetError (one line)
    when the user asked for other ones."""
    problem = manifest.mismatch(dict(config.requested))
    if problem:
        raise TokenSetError(f"{problem} ({folder}/{MANIFEST_NAME}): packing it would need other tokens. Drop the "
                            f"option to pack the tokenized set as it is, or run a full `prepack pack` with --input")
    c = manifest.choices
    return dataclasses.replace(
        config, inputs=tuple(c["inputs"]), format=c["format"], template_options=tuple(sorted(c["template_options"].items())),
        chat_format=c["chat_format"], tokenizer=c["tokenizer"], tfds_data_dir=c.get("tfds_data_dir"),
        mixture=_remix(config, c.get("mixture"), folder),
    )


def _remix(config: PackConfig, recorded: dict[str, Any] | None, folder: str):
    """The mixture to pack the set with: --mixture's new weights over the set's own sources, or
    the set's recorded mixture; raises TokenSetError (one line) for other sources."""
    from prepack.mixture import Mixture, MixtureError

    if recorded is None:
        if config.mixture is not None:
            raise TokenSetError(f"--mixture {config.mixture.path}: the tokenized set {folder} was not made from a mixture; "
                                "run a full `prepack pack --mixture` instead")
        return None
    try:
        made = Mixture.from_description(recorded)
    except MixtureError as e:
        raise TokenSetError(f"{folder}/{MANIFEST_NAME}: {e}") from None
    if config.mixture is None:
        return made
    problem = made.same_sources(config.mixture)
    if problem:
        raise TokenSetError(f"--mixture {config.mixture.path}: {problem} ({folder}/{MANIFEST_NAME}); re-mixing changes "
                            "weights, weight_of and max_repeats only: run a full `prepack pack --mixture` for other sources")
    return config.mixture


def tasks_of(manifest: TokenSetManifest) -> tuple[TaskMeta, ...]:
    return tuple(TaskMeta(**t) for t in manifest.job["tasks"])


def lineage(manifest: TokenSetManifest, folder: str) -> dict[str, Any]:
    """What a shard set made from the set records about it."""
    return {"from_tokens": folder, "tokens_created_at": manifest.created_at,
            "tokens_manifest_sha256": hashlib.sha256(manifest.to_json().encode("utf-8")).hexdigest()}


class ReadTokenFileFn(beam.DoFn):
    """(file name, records, bytes, sha256) -> TokenizedBatches of READ_BATCH examples.

    A gs:// file is copied to a local temp file first (ArrayRecordReader opens local paths);
    the bytes are hashed on the way and the job fails if they are not the manifest's."""

    def __init__(self, folder: str):
        self.folder = folder

    def setup(self) -> None:
        self.m_examples = Metrics.counter(NAMESPACE, "tokens_set_examples_read")
        self.clock = StageClock("read_tokens")

    def process(self, element: tuple[str, int, int, str]) -> Iterator[TokenizedBatch]:
        from array_record.python.array_record_module import ArrayRecordReader

        name, num_records, num_bytes, sha256 = element
        path = f"{self.folder}/{name}"
        started = StageClock.now()
        tmp = None
        try:
            digest = hashlib.sha256()
            if "://" in path:
                tmp = tempfile.mkdtemp(prefix="prepack-tokens-")
                local = os.path.join(tmp, name)
                with _fs().open(path) as src, open(local, "wb") as dst:
                    for block in iter(lambda: src.read(COPY_BLOCK), b""):
                        digest.update(block)
                        dst.write(block)
            else:
                local = path
                with open(local, "rb") as f:
                    for block in iter(lambda: f.read(COPY_BLOCK), b""):
                        digest.update(block)
            if digest.hexdigest() != sha256:
                raise TokenSetError(f"{path}: sha256 {digest.hexdigest()[:12]}... is not the manifest's {sha256[:12]}...: "
                                    f"the file changed after it was published; run a full `prepack pack` again")
            reader = ArrayRecordReader(local, "readahead_buffer_size:0")
            try:
                if reader.num_records() != num_records:
                    raise TokenSetError(f"{path}: {reader.num_records()} records, but the manifest says {num_records}")
                for lo in range(0, num_records, READ_BATCH):
                    decoded = decode_batch(reader.read(list(range(lo, min(lo + READ_BATCH, num_records)))))
                    hashes = np.fromiter(map(stable_hash, decoded.example_ids), dtype=np.uint64, count=len(decoded.example_ids))
                    batch = TokenizedBatch(hashes, decoded.example_ids, decoded.locs,
                                           Ragged(decoded.lens.astype(LENS), decoded.ids, decoded.mask))
                    self.m_examples.inc(len(batch))
                    self.clock.add(StageClock.now() - started)
                    yield batch
                    started = StageClock.now()
            finally:
                reader.close()
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
        self.clock.add(StageClock.now() - started)


def _read_dropped(path: str) -> Iterator[tuple[tuple, dict]]:
    with _fs().open(path) as f:
        for line in f.read().decode("utf-8").splitlines():
            if line.strip():
                key, entry = json.loads(line)
                yield (tuple(key), entry)


def read_tokens(pipeline: Any, manifest: TokenSetManifest, folder: str) -> tuple[Any, list, list, Any]:
    """(examples, [dead letters of examples dropped before fitting], [tallies], input fingerprints):
    what the full run's reading and tokenizing steps hand to the rest of the graph."""
    files = [(s.path, s.num_rows, s.num_bytes, s.sha256) for s in manifest.shards]
    examples = (
        pipeline
        | "ListTokenFiles" >> beam.Create(files)
        | "SpreadTokenFiles" >> beam.Reshuffle()
        | "ReadTokens" >> beam.ParDo(ReadTokenFileFn(folder))
    )
    dropped_path = f"{folder}/{manifest.dropped}" if manifest.dropped else None
    dropped = (
        pipeline
        | "ListDropped" >> beam.Create([dropped_path] if dropped_path else [])
        | "ReadDropped" >> beam.FlatMap(_read_dropped)
    )
    tally = Tally.from_json(manifest.job["tally"])
    tallies = pipeline | "StoredTally" >> beam.Create([tally])
    fingerprints = pipeline | "StoredFingerprints" >> beam.Create([tuple(f) for f in manifest.job["fingerprints"]])
    return examples, [dropped], [tallies], fingerprints

class ReadTokenSet(beam.PTransform):
    """A tokenized set as one transform: -> {"examples", "bad" (examples dropped before fitting),
    "tally" (the stored Tally), "fingerprints"}, what the read and prepare stages give a full run."""

    def __init__(self, manifest: TokenSetManifest, folder: str):
        super().__init__()
        self.manifest, self.folder = manifest, folder

    def expand(self, pbegin: Any) -> dict[str, Any]:
        examples, (dropped,), (tally,), fingerprints = read_tokens(pbegin, self.manifest, self.folder)
        return {"examples": examples, "bad": dropped, "tally": tally, "fingerprints": fingerprints}


__all__ = ["ReadTokenSet", "TokenSetError", "lineage", "open_token_set", "read_tokens", "reconcile", "tasks_of"]
