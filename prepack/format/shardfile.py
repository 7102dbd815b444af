"""Writing one ArrayRecord shard file of encoded rows, and naming shards.

Used by the Beam writer (which then copies the local file to its destination)
and by tests that need a shard set without running the job.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable

from prepack.format.manifest import ShardInfo

# group_size:1 keeps one record per chunk, so a random read decodes one row.
# It is written explicitly: array_record <= 0.8.3 defaults to 65536.
DEFAULT_WRITER_OPTIONS = "group_size:1,zstd:3"


def shard_name(index: int, count: int, sha256: str | None = None) -> str:
    """rows-00000-of-00004.array_record; with the file's sha256 (as the pipeline publishes):
    rows-00000-of-00004-<first 12 hex digits>.array_record, a name no other content takes."""
    suffix = f"-{sha256[:12]}" if sha256 else ""
    return f"rows-{index:05d}-of-{count:05d}{suffix}.array_record"


def write_shard(local_path: str, records: Iterable[bytes], options: str = DEFAULT_WRITER_OPTIONS) -> ShardInfo:
    """Writes records to a local ArrayRecord file; returns its row count, size and sha256."""
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(local_path, options)
    num_rows = 0
    try:
        for record in records:
            writer.write(record)
            num_rows += 1
    finally:
        writer.close()
    digest = hashlib.sha256()
    with open(local_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return ShardInfo(
        path=os.path.basename(local_path), num_rows=num_rows, num_bytes=os.path.getsize(local_path), sha256=digest.hexdigest()
    )
