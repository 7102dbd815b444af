"""Launcher side of writing: checks before the run, the manifest, and atomic publishing.

The manifest is what makes a shard set exist. Publishing one max length:
1. (with --overwrite) delete the old manifest first, so no reader ever pairs an
   old manifest with new shards;
2. move the new shards and dead letter from staging into OUTPUT/L<L>/;
3. delete old shards the new set does not reuse;
4. write manifest.json (a temp name, then a rename) as the very last step.
A run that fails or is interrupted before step 4 leaves no manifest, and the
staging prefix is removed on failure.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from pipelines.options import PackConfig
from pipelines.write import SUMMARY_NAME, length_dir, run_staging_dir, staging_dir, write_bytes
from prepack.accounting import NOT_BAD_INPUT, Tally
from prepack.manifest import DEAD_LETTER_NAME, MANIFEST_NAME, Manifest, ManifestError, ShardInfo
from prepack.stats import PackingStats

FAILED_DEAD_LETTER_NAME = "dead_letter.failed.jsonl"


class JobError(RuntimeError):
    """The job cannot run or its result cannot be published; the message says why and what to do."""


def _fs():
    from apache_beam.io.filesystems import FileSystems

    return FileSystems


def manifest_path(output: str, max_length: int) -> str:
    return f"{length_dir(output, max_length)}/{MANIFEST_NAME}"


def refuse_existing(config: PackConfig) -> None:
    """Fails before any work when a shard set already exists and --overwrite was not given."""
    if config.overwrite:
        return
    existing = [manifest_path(config.output, L) for L in config.max_lengths if _fs().exists(manifest_path(config.output, L))]
    if existing:
        raise JobError(
            f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: refusing to write into an existing "
            f"shard set. Pass --overwrite to replace it, or choose another --output"
        )


def probe_output(output: str, run_id: str) -> None:
    """Writes and deletes a small file under the output, so a bad bucket or a read-only folder fails now."""
    probe = f"{run_staging_dir(output, run_id)}/probe"
    try:
        write_bytes(probe, b"ok")
        _fs().delete([probe])
    except Exception as e:
        raise JobError(f"output {output!r} is not writable ({type(e).__name__}: {e})") from e


def read_summary(output: str, run_id: str) -> dict[str, Any]:
    path = f"{run_staging_dir(output, run_id)}/{SUMMARY_NAME}"
    with _fs().open(path) as f:
        return json.loads(f.read().decode("utf-8"))


def _remove(paths: Iterable[str]) -> None:
    paths = [p for p in paths if _fs().exists(p)]
    if paths:
        _fs().delete(paths)


def _remove_prefix(prefix: str) -> None:
    """Deletes a staging folder and everything in it, local or gs://."""
    fs = _fs()
    try:
        matched = [m.path for m in fs.match([prefix + "/*"])[0].metadata_list]
    except Exception:
        matched = []
    _remove(matched)
    if not prefix.startswith("gs://"):
        _remove([prefix])


def cleanup(config: PackConfig, run_id: str) -> None:
    """Best effort: removes this run's staging prefixes (never anything published)."""
    for L in config.max_lengths:
        try:
            _remove_prefix(staging_dir(config.output, L, run_id))
        except Exception:
            pass
    try:
        _remove_prefix(run_staging_dir(config.output, run_id))
    except Exception:
        pass


# ----------------------------------------------------------------------------- figures


def length_stats(summary: dict[str, Any], max_length: int, pack: bool = True) -> dict[str, Any]:
    """The manifest's `stats` for one max length, from the run summary."""
    tally = Tally.from_json(summary["tally"])
    per = summary["lengths"][str(max_length)]
    shards = per["shards"]
    plan = per["plan"]
    written = sum(s["segments"] for s in shards)
    rows = sum(s["num_rows"] for s in shards)
    packing = PackingStats(
        max_length=max_length,
        examples=written,
        tokens=sum(s["tokens"] for s in shards),
        target_tokens=sum(s["target_tokens"] for s in shards),
        rows=rows,
        min_segments_per_row=min((s["min_segments"] for s in shards), default=0),
        max_segments_per_row=max((s["max_segments"] for s in shards), default=0),
    ).as_dict()
    packing.pop("max_length")
    packing.pop("examples")
    examples_read = tally.examples_read
    return {
        "records_read": tally.records_read,
        "records_filtered": dict(sorted(tally.filtered.items())),
        "examples_read": examples_read,
        "examples_written": written,
        "examples_dropped": tally.examples_dropped(max_length),
        "examples_truncated": tally.truncated.get(max_length, 0),
        "bad_records": tally.bad,
        "bad_fraction": tally.bad / examples_read if examples_read else 0.0,
        "global_bfd_rows": plan["num_rows"] if pack else None,
        "planned_examples": plan["num_examples"],
        "dead_letter_entries": per["dead_letter_entries"],
        **packing,
    }


def check_stats(stats: dict[str, Any], max_length: int, plan: dict[str, Any]) -> list[str]:
    """Accounting problems (empty when all is well): every example read is written or dropped."""
    problems = []
    dropped = sum(stats["examples_dropped"].values())
    if stats["examples_read"] != stats["examples_written"] + dropped:
        problems.append(
            f"L={max_length}: examples read {stats['examples_read']} != written {stats['examples_written']} "
            f"+ dropped {dropped}"
        )
    if stats["examples_written"] != plan["num_examples"]:
        problems.append(f"L={max_length}: {stats['examples_written']} examples in rows, but the plan placed {plan['num_examples']}")
    if stats["rows"] != plan["num_rows"]:
        problems.append(f"L={max_length}: {stats['rows']} rows written, but the plan has {plan['num_rows']}")
    return problems


def bad_fraction_error(stats: dict[str, Any], config: PackConfig, failed_paths: list[str]) -> str | None:
    if stats["bad_fraction"] <= config.max_bad_fraction or not stats["bad_records"]:
        return None
    bad_reasons = {k: v for k, v in stats["examples_dropped"].items() if k not in NOT_BAD_INPUT}
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(bad_reasons.items(), key=lambda kv: (-kv[1], kv[0])))
    where = f"; they are listed in {failed_paths[0]}" if failed_paths else ""
    return (
        f"{stats['bad_records']} of {stats['examples_read']} examples read are bad records "
        f"({stats['bad_fraction']:.2%}, more than --max-bad-fraction {config.max_bad_fraction:g}): {reasons}. "
        f"Nothing was published{where}. Fix the inputs, or raise --max-bad-fraction to skip them"
    )


# ----------------------------------------------------------------------------- publishing


def compose_manifest(
    config: PackConfig, max_length: int, stats: dict[str, Any], shards: list[dict], job_info: dict[str, Any]
) -> Manifest:
    infos = [ShardInfo(path=s["path"], num_rows=s["num_rows"], num_bytes=s["num_bytes"], sha256=s["sha256"]) for s in shards]
    return Manifest(
        max_length=max_length,
        num_rows=sum(s.num_rows for s in infos),
        shards=infos,
        tokenizer=job_info["tokenizer"],
        stats=stats,
        packing="bfd" if config.pack else "unpacked",
        template=job_info["template"],
        inputs=job_info["inputs"],
        options={**config.manifest_options(), "sub_buckets": job_info["sub_buckets"]},
        tool=job_info["tool"],
        dead_letter=DEAD_LETTER_NAME if stats["dead_letter_entries"] else None,
    )


def _old_shards(final_dir: str) -> list[str]:
    path = f"{final_dir}/{MANIFEST_NAME}"
    if not _fs().exists(path):
        return []
    try:
        with _fs().open(path) as f:
            old = Manifest.from_json(f.read().decode("utf-8"), source=path)
        return [f"{final_dir}/{s.path}" for s in old.shards]
    except (ManifestError, OSError):
        return []


def publish_length(config: PackConfig, run_id: str, manifest: Manifest, created_at: str) -> str:
    """Moves one max length's staged files into place and writes its manifest last."""
    fs = _fs()
    final = length_dir(config.output, manifest.max_length)
    staged = staging_dir(config.output, manifest.max_length, run_id)
    old_shards = _old_shards(final)
    _remove([f"{final}/{MANIFEST_NAME}"])  # from here on the folder is not a shard set
    sources = [f"{staged}/{s.path}" for s in manifest.shards]
    targets = [f"{final}/{s.path}" for s in manifest.shards]
    staged_dead = f"{staged}/{DEAD_LETTER_NAME}"
    if manifest.dead_letter:
        sources.append(staged_dead)
        targets.append(f"{final}/{DEAD_LETTER_NAME}")
    _remove([t for t in targets if fs.exists(t)])
    if sources:
        fs.rename(sources, targets)
    if not manifest.dead_letter:
        _remove([f"{final}/{DEAD_LETTER_NAME}"])
    _remove([f"{final}/{FAILED_DEAD_LETTER_NAME}"])
    _remove(sorted(set(old_shards) - set(targets)))
    manifest.created_at = created_at
    tmp = f"{final}/{MANIFEST_NAME}.tmp-{run_id}"
    write_bytes(tmp, manifest.to_json().encode("utf-8"))
    fs.rename([tmp], [f"{final}/{MANIFEST_NAME}"])
    _remove_prefix(staged)
    return f"{final}/{MANIFEST_NAME}"


def keep_failed_dead_letters(config: PackConfig, run_id: str) -> list[str]:
    """On a bad-fraction failure, keeps each length's dead letter beside (not in) the shard set."""
    kept = []
    for L in config.max_lengths:
        staged = f"{staging_dir(config.output, L, run_id)}/{DEAD_LETTER_NAME}"
        target = f"{length_dir(config.output, L)}/{FAILED_DEAD_LETTER_NAME}"
        try:
            if _fs().exists(staged):
                _remove([target])
                _fs().rename([staged], [target])
                kept.append(target)
        except Exception:
            pass
    return kept


def rows_over(value: int, bound: int) -> float:
    return value / bound if bound else math.nan
