"""Which max lengths an output publishes: OUTPUT/published.json.

`prepack pack` switches each length's manifest.json atomically, one length after
another, and writes published.json (each length's manifest path and sha256) after
the last switch (docs/manifest.md, "Publishing and readers"). A single length's
folder is always a complete set; a trainer that uses several lengths of one run
checks here that they belong together.
"""

from __future__ import annotations

import hashlib

from prepack import storage
from loaders.shards import ShardSetError
from prepack.format.layout import RUN_RECORD_NAME
from prepack.format.manifest import ManifestError
from prepack.format.run_record import RunRecord, RunRecordError


def published_lengths(output: str) -> dict[int, str]:
    """max length -> shard set folder, for the lengths OUTPUT/published.json names (each checked).

    Raises ShardSetError when there is no run record, or when a length's manifest is not the
    one the record names: a run is publishing right now, or one was interrupted midway (its
    lengths then mix two runs; run `prepack pack --overwrite` again)."""
    output = str(output).rstrip("/")
    record_path = storage.join(output, RUN_RECORD_NAME)
    text = _read(record_path)
    if text is None:
        raise ShardSetError(f"no {RUN_RECORD_NAME} in {output}: no run has published all its lengths here")
    try:
        record = RunRecord.from_json(text, record_path)
    except RunRecordError as e:
        raise ShardSetError(str(e)) from e
    out = {}
    for L, entry in sorted(record.lengths.items()):
        manifest_path = storage.join(output, entry.manifest)
        manifest = _read(manifest_path)
        digest = None if manifest is None else hashlib.sha256(manifest.encode("utf-8")).hexdigest()
        if digest != entry.sha256:
            raise ShardSetError(
                f"{manifest_path} is not the manifest {record_path} names (run {record.run_id}): the lengths in "
                f"{output} are being published, or a publish was interrupted and they mix two runs; "
                "wait for the run, or run `prepack pack --overwrite` again"
            )
        out[L] = manifest_path.rsplit("/", 1)[0]
    return out


def _read(path: str) -> str | None:
    """A record or manifest (size-capped, UTF-8: prepack.storage.read_text); ShardSetError, one line, if not."""
    try:
        return storage.read_text(path)
    except ShardSetError:
        raise
    except ManifestError as e:
        raise ShardSetError(str(e)) from None
