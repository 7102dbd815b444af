"""A run's staging files: removed on every exit the run can catch; leftovers of killed runs found.

A run writes only under its staging prefixes (OUTPUT/.staging-<run>/ and
OUTPUT/L<L>/.staging-<run>/) until it publishes. A run killed with SIGKILL (or a
machine lost) cannot clean up; the next run into the output, once it holds the
lock (so no other run is live there), lists what such runs left:
- other runs' staging folders,
- manifest temp files (`manifest.json.tmp-*`, from older versions of this tool),
- shard files in OUTPUT/L<L>/ that no manifest names (moved in by a run killed
  before it switched the manifest, or old files of a run killed before deleting them),
- a lock's renew temp or takeover marker.
It reports them in one line; with --clean-stale it removes them.
"""

from __future__ import annotations

import dataclasses
import json
import os

from pipelines import outputs, swap
from prepack.manifest import MANIFEST_NAME


def cleanup_run(output: str, max_lengths: tuple[int, ...], run_id: str) -> None:
    """Best effort: removes this run's staging prefixes (never anything published), and
    length folders this run created and left empty."""
    for L in max_lengths:
        try:
            outputs.delete_tree(swap.staging_dir(output, L, run_id))
            outputs.remove_if_empty(swap.length_dir(output, L))
        except Exception:
            pass
    try:
        outputs.delete_tree(swap.run_staging_dir(output, run_id))
    except Exception:
        pass


@dataclasses.dataclass
class Leftovers:
    paths: list[str]
    num_bytes: int

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
    data = outputs.read_bytes(f"{folder}/{MANIFEST_NAME}")
    if data is None:
        return set()
    try:
        return {s["path"] for s in json.loads(data.decode("utf-8")).get("shards", [])}
    except Exception:
        return set()


def find_leftovers(output: str, run_id: str) -> Leftovers:
    """What earlier runs left under `output` (call while holding its lock)."""
    mine = f"/.staging-{run_id}"
    found: list[str] = []
    named: dict[str, set[str]] = {}
    sizes = 0
    for path in outputs.list_files(output):
        rel = path[len(output.rstrip("/")) + 1:]
        parts = rel.split("/")
        if mine in "/" + rel or path.endswith("/" + ".lock"):
            continue
        stale = False
        if any(p.startswith(".staging-") for p in parts):
            stale = True
        elif parts[-1].startswith((f"{MANIFEST_NAME}.tmp-", ".lock.renew-", ".lock.takeover")):
            stale = True
        elif len(parts) == 2 and parts[0].startswith("L") and swap.SHARD_FILE.match(parts[1]):
            folder = f"{output}/{parts[0]}"
            if folder not in named:
                named[folder] = _named_by_manifest(folder)
            stale = parts[1] not in named[folder]
        if stale:
            found.append(path)
            if not outputs.is_gcs(path):
                try:
                    sizes += os.path.getsize(path)
                except OSError:
                    pass
    return Leftovers(sorted(found), sizes)


def remove_leftovers(leftovers: Leftovers) -> None:
    outputs.delete(leftovers.paths)
    folders = {p.split("/.staging-")[0] + "/.staging-" + p.split("/.staging-")[1].split("/")[0]
               for p in leftovers.paths if "/.staging-" in p}
    for folder in sorted(folders):
        outputs.delete_tree(folder)
