"""Which lengths a `prepack pack` run publishes in OUTPUT/published.json: one rule, asked before
any work (prepack/overwrite.py) and again under the output lock (pipelines/output/commit.py).

- With --overwrite the record names exactly this run's lengths (and its tokenized set).
- Without it, a run adds its lengths to those already published: every length the existing
  record names stays named with the sha256 it records, so a new max length later
  (`--from-tokens OUT/tokens --max-length 4096 --output OUT`) never takes L512 out of a
  trainer's view. A length already published is refused (its manifest exists: the overwrite
  rule), and so is an output whose record no longer matches its manifests (a publish that was
  interrupted, or a file edited since): adding to it would name a mix; `--overwrite` repairs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prepack.format import layout
from prepack.format.run_record import PublishedManifest, RunRecord, RunRecordError, sha256_hex

_WAYS_OUT = "pass --overwrite to publish only this run's lengths, or choose another --output"


class NotAddable(ValueError):
    """The output's published lengths cannot be kept beside this run's; the message is one line."""


def kept_lengths(output: str, record: bytes | None, adding: Sequence[int],
                 read_manifest: Callable[[str], bytes | None]) -> dict[int, PublishedManifest]:
    """The entries of the output's run record (`record`: its bytes, None when there is none) that
    a run adding `adding` without --overwrite keeps, each checked against the manifest it names
    (`read_manifest(path)`: that file's bytes, or None). Raises NotAddable (one line) when the
    record is unreadable, names a length being added, or does not match a manifest it names."""
    if record is None:
        return {}
    path = layout.run_record_path(output)
    try:
        parsed = RunRecord.from_json(record.decode("utf-8", errors="replace"), path)
    except RunRecordError as e:
        raise NotAddable(f"{e}; refusing to add lengths to {output}: {_WAYS_OUT}") from None
    again = sorted(set(adding) & set(parsed.lengths))
    if again:
        names = ", ".join(f"L{L}" for L in again)
        raise NotAddable(f"{names} {'is' if len(again) == 1 else 'are'} already published in {path}: refusing to "
                         f"replace {'it' if len(again) == 1 else 'them'} without --overwrite; {_WAYS_OUT}")
    for L, entry in sorted(parsed.lengths.items()):
        manifest = read_manifest(layout.join(output, entry.manifest))
        if manifest is None or sha256_hex(manifest) != entry.sha256:
            raise NotAddable(f"{layout.join(output, entry.manifest)} is not the manifest {path} names (a publish was "
                             f"interrupted, or the file was changed since): refusing to add lengths beside it; {_WAYS_OUT}")
    return dict(parsed.lengths)
