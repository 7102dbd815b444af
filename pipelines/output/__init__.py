"""The job's output layer: where everything goes (prepack/format/layout.py), local disks and gs://
behind the core's one storage interface (prepack/storage), one writer at a time (lock), and publishing any staged set
with fencing (commit). Shard sets and the tokenized set publish through the same Commit.

Stages write only under their staging folders (prepack.format.layout names them) and never
import from here; the launcher (pipelines/launch/job.py) takes the lock, looks, and commits.
"""

from pipelines.output.commit import Commit, Seen, StagedSet, length_place, look, tokens_place
from pipelines.output.lock import LockHeld, LockLost, OutputLock, read_lock
from pipelines.output.staging import (Leftovers, cleanup_run, find_leftovers, keep_failed_dead_letters, probe,
                                      remove_leftovers)
from prepack.published import NotAddable
from prepack.storage import SwitchRefused, storage_for

__all__ = [
    "Commit", "Leftovers", "LockHeld", "LockLost", "NotAddable", "OutputLock", "Seen", "StagedSet", "SwitchRefused", "cleanup_run",
    "find_leftovers", "keep_failed_dead_letters", "length_place", "probe", "look", "read_lock", "remove_leftovers", "storage_for",
    "tokens_place",
]
