"""One rule for every subcommand that writes files: an existing output is replaced only with
--overwrite, and the refusal comes before any work. `prepack pack` asks it about its shard
sets and tokenized set, preflight and report about their files; each command asks once."""

from __future__ import annotations

from collections.abc import Sequence

from prepack.format.manifest import ManifestError
from prepack.format.layout import manifest_path, run_record_path, tokens_manifest_path
from prepack.hostile_input.untrusted import MAX_METADATA_FILE_BYTES
from prepack.published import NotAddable, kept_lengths
from prepack.storage import storage_for


def refusal(paths: Sequence[str], doing: str, other_ways: str = "", overwriting: str = "") -> str | None:
    """The one-line refusal when any of `paths` (local or gs://) exists, else None.
    `doing` completes "refusing to ..."; `other_ways` ("--no-tokens to leave it, ") are the
    ways out beside --overwrite and another --output; `overwriting` says what --overwrite does
    beside replacing it."""
    existing = [p for p in paths if storage_for(p).exists(p)]
    if not existing:
        return None
    return (f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: refusing to {doing}. "
            f"Pass --overwrite to replace it{overwriting}, {other_ways}or choose another --output")


def refuse_existing_sets(output: str, max_lengths: Sequence[int], tokens: bool) -> str | None:
    """The refusal of `prepack pack` without --overwrite: a shard set of one of `max_lengths`
    exists in `output`, or (`tokens`: the run publishes one) its tokenized set, or the lengths
    already published there cannot be kept beside the new ones (prepack/published.py); else None."""
    sets = refusal([manifest_path(output, L) for L in max_lengths], "write into an existing shard set",
                   overwriting=f" ({run_record_path(output)} then names exactly this run's lengths)")
    if sets:
        return sets
    if tokens:
        found = refusal([tokens_manifest_path(output)], "write over an existing tokenized set", "--no-tokens to leave it, ")
        if found:
            return found
    return _not_addable(output, max_lengths)


def _not_addable(output: str, max_lengths: Sequence[int]) -> str | None:
    """The published lengths' check a run without --overwrite makes again under the output lock."""
    store = storage_for(output)

    def read(path: str) -> bytes | None:
        found = store.read(path, MAX_METADATA_FILE_BYTES)
        return None if found is None else found.data

    try:
        kept_lengths(output, read(run_record_path(output)), max_lengths, read)
    except NotAddable as e:
        return str(e)
    except ManifestError as e:  # a record or manifest over the size cap: refused unread
        return f"{e}; refusing to add lengths to {output}: pass --overwrite, or choose another --output"
    return None
