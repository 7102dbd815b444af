"""A run's staging files: removed on every exit the run can catch; leftovers of killed runs found.

A run writes only under its staging prefixes (OUTPUT/.staging-<run>/ and
OUTPUT/L<L>/.staging-<run>/) until it publishes. A run killed with SIGKILL (or a
machine lost) cannot clean up; the next run into the output, once it holds the
lock (so no other run is live there), lists what such runs left:
- other runs' staging folders,
- manifest temp files (`manifest.json.tmp-*`, from older versions of this tool),
- shard files in OUTPUT/L<L>/ that no manifest names (moved in by a run killed
  before it switched the manifest, or old files of a run killed before deleting them),
- a lock's renew temp or takeover marker (from older versions of this tool).
It reports them in one line; with --clean-stale it removes them.
"""

from __future__ import annotations

import dataclasses
import json

from pipelines.output.lock import LockLost, OutputLock
from prepack.storage import Version, storage_for
from prepack.format import layout
from prepack.format.manifest import ManifestError
from prepack.hostile_input.untrusted import MAX_METADATA_FILE_BYTES


def cleanup_run(output: str, max_lengths: tuple[int, ...], run_id: str) -> None:
    """Best effort: removes this run's staging prefixes (never anything published), and the
    length and tokens folders this run created and left empty."""
    store = storage_for(output)
    folders = [(layout.staging_dir(output, L, run_id), layout.length_dir(output, L)) for L in max_lengths]
    folders.append((layout.tokens_staging_dir(output, run_id), layout.tokens_dir(output)))
    for staged, final in folders:
        try:
            store.delete_tree(staged)
            store.remove_if_empty(final)
        except Exception:
            pass
    try:
        store.delete_tree(layout.run_staging_dir(output, run_id))
    except Exception:
        pass


def probe(output: str, run_id: str) -> None:
    """Writes and deletes a small file in the run's staging, so a bad bucket or a read-only
    folder fails before the pipeline runs (raises the storage's error)."""
    store = storage_for(output)
    path = layout.join(layout.run_staging_dir(output, run_id), "probe")
    store.write(path, b"ok")
    store.delete([path])


def keep_failed_dead_letters(output: str, max_lengths: tuple[int, ...], run_id: str, lock: OutputLock) -> list[str]:
    """On a failed run (too many bad records), moves each length's staged dead letter beside
    (not into) the published set, as dead_letter.failed.jsonl; returns the paths kept."""
    store = storage_for(output)
    kept = []
    for L in max_lengths:
        staged = layout.join(layout.staging_dir(output, L, run_id), layout.DEAD_LETTER_NAME)
        target = layout.join(layout.length_dir(output, L), layout.FAILED_DEAD_LETTER_NAME)
        try:
            if store.exists(staged):
                lock.check()
                store.delete([target])
                store.move([staged], [target])
                kept.append(target)
        except LockLost:
            raise
        except Exception:
            pass
    return kept


@dataclasses.dataclass
class Leftovers:
    paths: list[str]
    num_bytes: int
    versions: dict[str, Version] = dataclasses.field(default_factory=dict)  # as found, under the lock

    def describe(self, output: str) -> str:
        staging = sorted({p.split("/.staging-")[0] + "/.staging-" + p.split("/.staging-")[1].split("/")[0]
                          for p in self.paths if "/.staging-" in p})
        others = [p for p in self.paths if "/.staging-" not in p]
        parts = []
        if staging:
            parts.append(f"{len(staging)} staging folder{'s' if len(staging) != 1 else ''} ({staging[0]}"
                         f"{' ...' if len(staging) > 1 else ''})")
        if others:
            parts.append(f"{len(others)} unpublished file{'s' if len(others) != 1 else ''} ({others[0]}"
                         f"{' ...' if len(others) > 1 else ''})")
        return f"{output} holds leftovers of earlier killed runs: {', '.join(parts)}, {self.num_bytes / 1e6:,.1f} MB"


def _named_by_manifest(folder: str) -> set[str]:
    try:
        found = storage_for(folder).read(layout.join(folder, layout.MANIFEST_NAME), MAX_METADATA_FILE_BYTES)
    except ManifestError:  # over the cap: it names nothing this run can trust
        return set()
    if found is None:
        return set()
    try:
        return {s["path"] for s in json.loads(found.data.decode("utf-8")).get("shards", [])}
    except Exception:
        return set()


def find_leftovers(output: str, run_id: str) -> Leftovers:
    """What earlier runs left under `output` (call while holding its lock)."""
    store = storage_for(output)
    mine = f"/{layout.STAGING_PREFIX}{run_id}"
    found: list[str] = []
    named: dict[str, set[str]] = {}
    sizes = 0
    for path in store.list_files(output):
        rel = path[len(output.rstrip("/")) + 1:]
        parts = rel.split("/")
        if mine in "/" + rel or rel == layout.LOCK_NAME:
            continue
        stale = False
        if any(p.startswith(layout.STAGING_PREFIX) for p in parts):
            stale = True
        elif parts[-1].startswith((f"{layout.MANIFEST_NAME}.tmp-", ".lock.renew-", ".lock.takeover")):
            stale = True  # from older versions of this tool
        elif len(parts) == 2 and parts[0].startswith("L") and layout.SHARD_FILE.match(parts[1]):
            folder = f"{output}/{parts[0]}"
            if folder not in named:
                named[folder] = _named_by_manifest(folder)
            stale = parts[1] not in named[folder]
        if stale:
            found.append(path)
            sizes += store.size(path)
    return Leftovers(sorted(found), sizes, {p: store.version(p) for p in found})


def remove_leftovers(leftovers: Leftovers, lock: OutputLock) -> None:
    """Deletes what find_leftovers found, each file at the version it had then, after checking
    that this run still owns the output: a run that lost its lease meanwhile deletes nothing, and
    a file published since under a leftover's (content-addressed) name has another version."""
    store = storage_for(leftovers.paths[0]) if leftovers.paths else None
    if store is None:
        return
    lock.check()
    for path in leftovers.paths:
        store.delete_if(path, leftovers.versions[path])
    folders = {p.split("/.staging-")[0] + "/.staging-" + p.split("/.staging-")[1].split("/")[0]
               for p in leftovers.paths if "/.staging-" in p}
    for folder in sorted(folders):
        store.delete_tree(folder)
