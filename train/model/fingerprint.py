"""A short id of a model's base (non-LoRA) weights, recorded with checkpoints and LoRA exports.

A checkpoint or LoRA file only makes sense on the base weights it was trained on; the
fingerprint tells them apart (other seed, other weights file, other dtype) without hashing
gigabytes.
"""

from __future__ import annotations

import hashlib
from typing import Any

# Elements taken from the first row of every base weight for the fingerprint.
FINGERPRINT_VALUES = 16


def base_fingerprint(model: Any) -> str:
    """A short id of a model's base (non-LoRA) weights: paths, shapes, dtypes and sampled values.

    The values are the first FINGERPRINT_VALUES elements of the first row of every base
    parameter, gathered in one jitted call (one compile; a per-parameter eager slice would
    compile once per shape). Exact values, not sums, so it does not depend on the mesh.
    Tells apart different random seeds, checkpoints and dtypes; it is not a full checksum.
    """
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    flat = sorted(
        ((".".join(map(str, path)), var.get_value()) for path, var in nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))),
        key=lambda kv: kv[0],
    )
    values = [v for _, v in flat]

    @jax.jit
    def sample(xs: list[Any]) -> list[Any]:
        return [x[(0,) * (x.ndim - 1)][:FINGERPRINT_VALUES] if x.ndim else x for x in xs]

    # Slices of sharded weights may themselves be sharded across hosts: gather those.
    heads = [h if h.is_fully_addressable else multihost_utils.process_allgather(h, tiled=True) for h in sample(values)]
    digest = hashlib.sha256()
    for (name, value), head in zip(flat, jax.device_get(heads)):
        digest.update(f"{name}|{tuple(value.shape)}|{value.dtype}|".encode())
        digest.update(np.ascontiguousarray(head).tobytes())
    return digest.hexdigest()[:16]
