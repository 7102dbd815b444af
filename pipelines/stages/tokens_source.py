"""`prepack pack --from-tokens DIR`: a tokenized set as the job's source.

The launcher opens the set and refuses it before any work (pipelines/launch/token_set.py).
The graph then starts from the set's files instead of reading and tokenizing: each file is
one task (Create + Reshuffle, so any runner spreads them), read in batches into the same
TokenizedBatches the tokenizer makes; the tallies, dead letters and input fingerprints of
the run that tokenized them enter as they were. Everything after that is the full run's
graph, so the shard sets are the full run's, byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.metrics.metric import Metrics

from pipelines.wire.columns import LENS, Ragged, TokenizedBatch
from pipelines.planning import stable_hash
from pipelines.stage_shared import StageClock
from prepack.packing.accounting import Tally
from pipelines.faults.failures import InputFileError
from prepack import storage
from prepack.format.tokenset import TokenSetError, TokenSetManifest, check_examples, decode_batch

NAMESPACE = "prepack"
READ_BATCH = 4096  # records per TokenizedBatch


class ReadTokenFileFn(beam.DoFn):
    """(file name, records, bytes, sha256) -> TokenizedBatches of READ_BATCH examples.

    A gs:// file is copied to a local temp file first (ArrayRecordReader opens local paths);
    the bytes are hashed on the way and the job fails if they are not the manifest's."""

    def __init__(self, folder: str, vocab_size: int = 1 << 31, num_tasks: int = 1 << 62):
        self.folder = folder
        self.vocab_size = vocab_size
        self.num_tasks = num_tasks

    def setup(self) -> None:
        self.m_examples = Metrics.counter(NAMESPACE, "tokens_set_examples_read")
        self.clock = StageClock("read_tokens")

    def process(self, element: tuple[str, int, int, str]) -> Iterator[TokenizedBatch]:
        name, num_records, num_bytes, sha256 = element
        path = f"{self.folder}/{name}"
        try:
            yield from self._read(name, path, num_records, sha256)
        except FileNotFoundError as e:
            raise InputFileError(f"{path} vanished while the job ran ({e.strerror or e}): the tokenized set changed; "
                                 "run a full `prepack pack` again") from e
        except TokenSetError as e:
            raise InputFileError(str(e)) from e

    def _read(self, name: str, path: str, num_records: int, sha256: str) -> Iterator[TokenizedBatch]:
        from array_record.python.array_record_module import ArrayRecordReader

        started = StageClock.now()
        tmp = None
        try:
            if storage.is_gcs(path):
                tmp = tempfile.mkdtemp(prefix="prepack-tokens-")
                local = os.path.join(tmp, name)
                with open(local, "wb") as dst:
                    _, digest = storage.download(path, dst)
            else:
                local = path
                digest = storage.sha256(local)
            if digest != sha256:
                raise TokenSetError(f"{path}: sha256 {digest[:12]}... is not the manifest's {sha256[:12]}...: "
                                    f"the file changed after it was published; run a full `prepack pack` again")
            try:
                reader = ArrayRecordReader(local, "readahead_buffer_size:0")
            except Exception as e:  # a file with the right sha256 is one this job wrote; say so anyway
                raise TokenSetError(f"{path}: not a readable ArrayRecord file ({e}); run a full `prepack pack` again") from e
            try:
                if reader.num_records() != num_records:
                    raise TokenSetError(f"{path}: {reader.num_records()} records, but the manifest says {num_records}")
                for lo in range(0, num_records, READ_BATCH):
                    where = f"{path} records {lo}..{min(lo + READ_BATCH, num_records) - 1}"
                    try:
                        decoded = decode_batch(reader.read(list(range(lo, min(lo + READ_BATCH, num_records)))))
                    except TokenSetError as e:
                        raise TokenSetError(f"{where}: {e}; run a full `prepack pack` again") from None
                    check_examples(decoded, self.vocab_size, self.num_tasks, where)
                    hashes = np.fromiter(map(stable_hash, decoded.example_ids), dtype=np.uint64, count=len(decoded.example_ids))
                    batch = TokenizedBatch(hashes, decoded.example_ids, decoded.locs,
                                           Ragged(decoded.lens.astype(LENS), decoded.ids, decoded.mask, decoded.pair_bounds))
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


def _vocab_size(manifest: TokenSetManifest) -> int:
    size = manifest.tokenizer.get("vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 1 << 31


def _read_dropped(path: str) -> Iterator[tuple[tuple, dict]]:
    """The dead letters of the examples dropped before fitting: ([task, record, line, sub, reason], entry)
    per line, each checked (the file is read from storage others can write)."""
    try:
        raw = storage.read_bytes(path)
        if raw is None:
            raise FileNotFoundError(f"no such file: {path}")
        text = raw.decode("utf-8")
    except (FileNotFoundError, UnicodeDecodeError) as e:
        raise InputFileError(f"{path} vanished or is damaged while the job ran ({e}); run a full `prepack pack` again") from e
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            key, entry = json.loads(line)
            ok = isinstance(entry, dict) and isinstance(key, list) and len(key) == 5 and isinstance(key[4], str) and \
                all(type(v) is int for v in key[:4])
        except (ValueError, TypeError, RecursionError):
            ok = False
        if not ok:
            raise InputFileError(f"{path} line {number}: not a dead-letter entry of a tokenized set; the set is damaged: "
                                 "run a full `prepack pack` again")
        yield (tuple(key), entry)


def read_tokens(pipeline: Any, manifest: TokenSetManifest, folder: str) -> tuple[Any, list, list, Any]:
    """(examples, [dead letters of examples dropped before fitting], [tallies], input fingerprints):
    what the full run's reading and tokenizing steps hand to the rest of the graph."""
    files = [(s.path, s.num_rows, s.num_bytes, s.sha256) for s in manifest.shards]
    examples = (
        pipeline
        | "ListTokenFiles" >> beam.Create(files)
        | "SpreadTokenFiles" >> beam.Reshuffle()
        | "ReadTokens" >> beam.ParDo(ReadTokenFileFn(folder, _vocab_size(manifest), len(manifest.job["tasks"])))
    )
    dropped_path = f"{folder}/{manifest.dropped}" if manifest.dropped else None
    dropped = (
        pipeline
        | "ListDropped" >> beam.Create([dropped_path] if dropped_path else [])
        | "ReadDropped" >> beam.FlatMap(_read_dropped)
    )
    # A set stored before its split and window counts were cleared still holds them: cleared here too.
    tally = Tally.from_json(manifest.job["tally"]).clear_per_length()
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


__all__ = ["ReadTokenSet", "read_tokens"]
