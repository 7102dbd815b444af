"""One shard set's manifest, composed from the run's figures, its shards and the job's identity.

Writing it, in the order that lets readers see the old sets or the new ones, never a mix,
is the output layer's (pipelines/output/commit.py)."""

from __future__ import annotations

from typing import Any

from pipelines.configs import PackConfig
from pipelines.summary import LengthStats, ShardSummary
from prepack.format.manifest import DEAD_LETTER_NAME, Manifest, ShardInfo


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
