"""Switching an output from its old shard sets to a run's new ones, so readers see one or the other.

Order (docs/manifest.md, "Publishing and readers"):
1. the new shards go from staging into OUTPUT/L<L>/ beside the old ones. Shard
   names carry the file's sha256 (rows-00000-of-00004-<12 hex>.array_record), so
   a new file never replaces an old file of other content: the old manifest's
   files stay complete and readable;
2. each length's manifest.json is switched in one atomic step: on gs:// an upload
   with ifGenerationMatch (the generation this run saw when it took the lock; 0
   when there was none), locally a link (new) or rename (over the old one) from a
   temp file in the run's staging folder, never inside the published set. If the
   manifest changed since (another writer), the switch is refused;
3. the dead letter is moved in, and OUTPUT/published.json, the run record naming
   each length's manifest and its sha256, is written: all lengths of one run are
   published when the record matches every manifest it names;
4. only then are old files no manifest names deleted.
A run stopped anywhere leaves each length's manifest old or new, with all its
files; before step 3 completes, published.json does not match, which readers
(loaders.open_run) report as an incomplete publish.

`fault_point(name)` is called between the steps: a no-op that tests replace to
kill or race the run at a chosen moment.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from pipelines import outputs
from prepack.manifest import DEAD_LETTER_NAME, MANIFEST_NAME, Manifest

RUN_RECORD_NAME = "published.json"
FAILED_DEAD_LETTER_NAME = "dead_letter.failed.jsonl"
SHARD_FILE = re.compile(r"^rows-\d{5}-of-\d{5}(-[0-9a-f]{12})?\.array_record$")


def fault_point(name: str) -> None:
    """Called between publishing steps; tests replace it to inject a kill or a race."""


def length_dir(output: str, max_length: int) -> str:
    return f"{output}/L{max_length}"


def staging_dir(output: str, max_length: int, run_id: str) -> str:
    return f"{length_dir(output, max_length)}/.staging-{run_id}"


def run_staging_dir(output: str, run_id: str) -> str:
    return f"{output}/.staging-{run_id}"


def manifest_path(output: str, max_length: int) -> str:
    return f"{length_dir(output, max_length)}/{MANIFEST_NAME}"


@dataclasses.dataclass(frozen=True)
class Seen:
    """The version of each length's manifest when the run took the lock (compare-and-swap basis)."""

    manifests: dict[int, Any]


def look(output: str, max_lengths: tuple[int, ...]) -> Seen:
    return Seen({L: outputs.version(manifest_path(output, L)) for L in max_lengths})


def existing_manifests(output: str, max_lengths: tuple[int, ...]) -> list[str]:
    return [manifest_path(output, L) for L in max_lengths if outputs.exists(manifest_path(output, L))]


def refusal(output: str, max_lengths: tuple[int, ...]) -> str | None:
    """The message refusing to write over existing shard sets (without --overwrite), or None."""
    existing = existing_manifests(output, max_lengths)
    if not existing:
        return None
    return (f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: refusing to write into an existing "
            f"shard set. Pass --overwrite to replace it, or choose another --output")


def _names_in(folder: str) -> set[str]:
    prefix = folder.rstrip("/") + "/"
    return {p[len(prefix):] for p in outputs.list_files(folder) if "/" not in p[len(prefix):]}


def _move(fs: Any, sources: list[str], targets: list[str]) -> None:
    if sources:
        fs.rename(sources, targets)


def publish(
    output: str, run_id: str, manifests: dict[int, Manifest], seen: Seen, overwrite: bool,
    progress: dict[int, str] | None = None, tokens_manifest_sha256: str | None = None,
) -> dict[int, str]:
    """Steps 1-4 above; returns max length -> manifest path. Raises SwitchRefused if another
    writer changed a manifest since the run started. `progress` receives each length as its
    manifest is switched, so a caller interrupted midway can say which are."""
    from apache_beam.io.filesystems import FileSystems as fs

    # 1. New shards beside the old set.
    for L, manifest in sorted(manifests.items()):
        final, staged = length_dir(output, L), staging_dir(output, L, run_id)
        present = _names_in(final)
        sources, targets = [], []
        for shard in manifest.shards:
            if shard.path in present:  # same name, same sha256: the very same bytes are in place
                continue
            sources.append(f"{staged}/{shard.path}")
            targets.append(f"{final}/{shard.path}")
        _move(fs, sources, targets)
    fault_point("shards_in_place")

    # 2. One atomic switch per length.
    switched: dict[int, str] = {} if progress is None else progress
    for L, manifest in sorted(manifests.items()):
        path = manifest_path(output, L)
        expected = seen.manifests.get(L, outputs.absent_version(path)) if overwrite else outputs.absent_version(path)
        tmp = f"{run_staging_dir(output, run_id)}/{MANIFEST_NAME}.L{L}"
        try:
            outputs.switch(path, manifest.to_json().encode("utf-8"), expected, tmp=tmp)
        except outputs.SwitchRefused as e:
            done = ", ".join(f"L{k}" for k in switched) or "none"
            raise outputs.SwitchRefused(
                f"{e}; refusing to replace it (lengths already switched by this run: {done}). "
                f"Make sure one run at a time writes {output}"
            ) from e
        switched[L] = path
        fault_point(f"manifest_switched:L{L}")

    # 3. Dead letters, then the run record.
    for L, manifest in sorted(manifests.items()):
        final, staged = length_dir(output, L), staging_dir(output, L, run_id)
        if manifest.dead_letter:
            outputs.delete([f"{final}/{DEAD_LETTER_NAME}"])
            _move(fs, [f"{staged}/{DEAD_LETTER_NAME}"], [f"{final}/{DEAD_LETTER_NAME}"])
    record = {
        "run_id": run_id,
        "lengths": {
            str(L): {"manifest": f"L{L}/{MANIFEST_NAME}", "sha256": hashlib.sha256(m.to_json().encode("utf-8")).hexdigest()}
            for L, m in sorted(manifests.items())
        },
    }
    if tokens_manifest_sha256 is not None:  # OUTPUT/tokens/manifest.json's sha256: --from-tokens checks it
        record["tokens_manifest_sha256"] = tokens_manifest_sha256
    record_path = f"{output}/{RUN_RECORD_NAME}"
    outputs.switch(record_path, json.dumps(record, indent=2, sort_keys=True).encode("utf-8"),
                   outputs.version(record_path), tmp=f"{run_staging_dir(output, run_id)}/{RUN_RECORD_NAME}")
    fault_point("run_record_written")

    # 4. Old files, now named by no manifest.
    for L, manifest in sorted(manifests.items()):
        final = length_dir(output, L)
        keep = {s.path for s in manifest.shards}
        old = [f"{final}/{n}" for n in _names_in(final) if SHARD_FILE.match(n) and n not in keep]
        if not manifest.dead_letter:
            old.append(f"{final}/{DEAD_LETTER_NAME}")
        old.append(f"{final}/{FAILED_DEAD_LETTER_NAME}")
        outputs.delete(old)
    return switched
