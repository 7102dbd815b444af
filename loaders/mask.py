"""The block-causal attention mask of packed rows, in numpy and in jax.numpy.

mask[b, q, k] is True where query token q may attend to key token k:
- within a segment: causal, k <= q;
- across segments: never;
- into padding (segment_id 0): never, from a real token;
- from padding: a pad query attends to itself only.

Why pad queries get their own diagonal rather than an all-False row: a row
with no allowed key makes softmax divide by zero, and some attention
implementations turn that into NaNs that then leak into gradients through
masked sums (0 * NaN = NaN). Attending to itself keeps every softmax row
finite; pad outputs are discarded by loss_mask/valid_mask anyway.

Segments are told apart by equal segment_ids, so any layout works, not only
the contiguous 1..k of the row format. The jax version is jit-compatible and
meant to be built on the device inside a jitted step, from the [B, L]
segment_ids, instead of moving B*L*L bytes from the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _block_causal(xp: Any, segment_ids: Any) -> Any:
    length = segment_ids.shape[-1]
    q = segment_ids[..., :, None]
    k = segment_ids[..., None, :]
    causal = xp.tril(xp.ones((length, length), dtype=bool))
    eye = xp.eye(length, dtype=bool)
    # Same segment and causal, excluding pad queries; then the diagonal for pad queries.
    return ((q == k) & causal & (q != 0)) | (eye & (q == 0))


def block_causal_mask(segment_ids: np.ndarray) -> np.ndarray:
    """bool [..., L, L] mask from int [..., L] segment_ids (usually [B, L] -> [B, L, L])."""
    segment_ids = np.asarray(segment_ids)
    if segment_ids.ndim < 1:
        raise ValueError("segment_ids needs at least one axis (the sequence)")
    return _block_causal(np, segment_ids)


def block_causal_mask_jax(segment_ids: Any) -> Any:
    """The same mask in jax.numpy; jit-compatible (shapes are static). Imports jax on first use."""
    import jax.numpy as jnp

    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.ndim < 1:
        raise ValueError("segment_ids needs at least one axis (the sequence)")
    return _block_causal(jnp, segment_ids)
