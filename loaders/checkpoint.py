"""Saving and restoring the loader's position, alone or inside an Orbax checkpoint.

The iterator state is a small JSON dict of positions (plus the pipeline
settings, which make_dataset's iterator checks on restore). It is only valid
for the same, unchanged shard set: published shard sets are immutable, so put
their version in their path rather than overwriting them.

Standalone (one file per host; local, gcsfuse or gs://):

    it = iter(loaders.make_dataset(path, batch_size=8, seed=0))
    ...
    loaders.save_iterator_state(it, f"{ckpt_dir}/data-{jax.process_index()}.json")
    # after a restart, with the same make_dataset arguments:
    it = iter(loaders.make_dataset(path, batch_size=8, seed=0))
    loaders.restore_iterator_state(it, f"{ckpt_dir}/data-{jax.process_index()}.json")

With Orbax, next to the model state (Grain's handler writes
process_<i>-of-<n>.json per host into the step's "data" item):

    import orbax.checkpoint as ocp, grain
    mngr = ocp.CheckpointManager(ckpt_dir)
    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state), data=grain.checkpoint.CheckpointSave(it)))
    mngr.wait_until_finished()
    restored = mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=grain.checkpoint.CheckpointRestore(it)))
    # `it` now yields the batch that followed step; orbax_save_args/orbax_restore_args below
    # return the same two Grain arguments.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from prepack import storage


class StatefulIterator(Protocol):
    def get_state(self) -> dict[str, Any]: ...
    def set_state(self, state: dict[str, Any]) -> None: ...


def save_iterator_state(iterator: StatefulIterator, path: str) -> None:
    """Writes iterator.get_state() as JSON to `path` (local, gcsfuse or gs://)."""
    storage.write_text(str(path), json.dumps(iterator.get_state(), indent=1, sort_keys=True) + "\n")


def restore_iterator_state(iterator: StatefulIterator, path: str) -> None:
    """Sets the iterator to the state saved at `path`; its next batch is the one that followed the save."""
    text = storage.read_text(str(path))
    if text is None:
        raise FileNotFoundError(f"no iterator state at {path}")
    try:
        state = json.loads(text)
    except (ValueError, RecursionError) as e:  # also a 5,001-digit integer, or nesting 100,000 deep
        raise ValueError(f"{path}: not a JSON iterator state ({e})") from e
    iterator.set_state(state)


def orbax_save_args(iterator: StatefulIterator):
    """Orbax CheckpointArgs that save the iterator (grain.checkpoint.CheckpointSave)."""
    import grain

    return grain.checkpoint.CheckpointSave(iterator)


def orbax_restore_args(iterator: StatefulIterator):
    """Orbax CheckpointArgs that restore into the iterator (grain.checkpoint.CheckpointRestore)."""
    import grain

    return grain.checkpoint.CheckpointRestore(iterator)
