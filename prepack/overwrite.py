"""One rule for every subcommand that writes files: an existing output is replaced only with
--overwrite, and the refusal comes before any work. `prepack pack` asks it about its shard
sets and tokenized set, preflight and report about their files; each command asks once."""

from __future__ import annotations

from collections.abc import Sequence

from prepack.format.layout import manifest_path, tokens_manifest_path
from prepack.storage import storage_for


def refusal(paths: Sequence[str], doing: str, other_ways: str = "") -> str | None:
    """The one-line refusal when any of `paths` (local or gs://) exists, else None.
    `doing` completes "refusing to ..."; `other_ways` ("--no-tokens to leave it, ") are the
    ways out beside --overwrite and another --output."""
    existing = [p for p in paths if storage_for(p).exists(p)]
    if not existing:
        return None
    return (f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: refusing to {doing}. "
            f"Pass --overwrite to replace it, {other_ways}or choose another --output")


def refuse_existing_sets(output: str, max_lengths: Sequence[int], tokens: bool) -> str | None:
    """The refusal of `prepack pack` without --overwrite: a shard set of one of `max_lengths`
    exists in `output`, or (`tokens`: the run publishes one) its tokenized set; else None."""
    sets = refusal([manifest_path(output, L) for L in max_lengths], "write into an existing shard set")
    if sets or not tokens:
        return sets
    return refusal([tokens_manifest_path(output)], "write over an existing tokenized set", "--no-tokens to leave it, ")
