"""One rule for every subcommand that writes files: an existing output is replaced only with
--overwrite (as `prepack pack` does for shard sets), and the refusal comes before any work."""

from __future__ import annotations

import os
from collections.abc import Sequence


def refusal(paths: Sequence[str], what: str) -> str | None:
    """The one-line refusal when any of `paths` exists (local files), else None."""
    existing = [p for p in paths if os.path.exists(p)]
    if not existing:
        return None
    return (f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: refusing to replace {what}. "
            "Pass --overwrite to replace it, or choose another --output")
