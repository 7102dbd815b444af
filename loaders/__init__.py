"""Training-side reader of published shard sets: Grain batches, no packing work on the host.

    view = loaders.open_shards("gs://bucket/sets/v1/L2048", expected_max_length=2048, tokenizer=tok)
    ds = loaders.make_dataset(view, batch_size=8, seed=0)      # shard_index/count: JAX's by default
    it = iter(ds); batch = next(it)                             # dict of int32 [8, 2048] arrays
    mask = loaders.block_causal_mask_jax(batch["segment_ids"])  # inside a jitted step

Names that need Grain (make_dataset, HostPlan) are imported on first use, so
`import loaders` stays light for the mask and for `prepack inspect`. Nothing
here imports apache_beam; jax is imported only by block_causal_mask_jax and
resolve_host (and by Grain itself, when installed alongside it).
"""

from __future__ import annotations

from typing import Any

from loaders.checkpoint import orbax_restore_args, orbax_save_args, restore_iterator_state, save_iterator_state
from loaders.mask import block_causal_mask, block_causal_mask_jax
from loaders.shards import ShardSetError, ShardView, open_shards
from loaders.published import published_lengths
from prepack.format.manifest import ManifestError

_LAZY = {
    "make_dataset": "loaders.dataset",
    "HostPlan": "loaders.dataset",
    "resolve_host": "loaders.dataset",
    "ensure_absl_flags_parsed": "loaders.dataset",
}

__all__ = [
    "open_shards",
    "published_lengths",
    "ShardView",
    "ShardSetError",
    "ManifestError",
    "make_dataset",
    "HostPlan",
    "resolve_host",
    "ensure_absl_flags_parsed",
    "block_causal_mask",
    "block_causal_mask_jax",
    "save_iterator_state",
    "restore_iterator_state",
    "orbax_save_args",
    "orbax_restore_args",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loaders' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
