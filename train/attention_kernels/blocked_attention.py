"""`--attention blocked`: flash-style attention from [B, L] segment ids, in plain JAX.

Queries and keys are cut into tiles of T positions. Each query tile visits key tiles with an
online softmax (running max, normaliser and weighted sum in float32), and the mask of a
tile pair is built from the two tiles' segment ids and indices: same segment, causal, and
(Gemma3's local layers) within the sliding window. No [L, L] mask or score matrix exists.

Tiles that no segment spans are skipped. Rows store contiguous segments, so a query tile's
queries can only see keys of its own segments, which all start at or after the first
position of its lowest segment: with `first[i]` = the start of the segment at position i,
query tile q needs key tiles k with first[q*T] // T <= k <= q (and, for a window w, also
k >= (q*T - w + 1) // T). So the work per query tile is a contiguous range of key tiles,
and the whole row costs about the sum of its segments' triangles rather than L^2 / 2.

The range is data-dependent but its length is bounded statically (by the window for local
layers, by L / T otherwise), so each query tile runs a `lax.scan` of that static length over
key tiles first, first + 1, ...; each step computes its tile under a `lax.cond` only while it
is inside the range (key tile <= query tile), so a tile outside it costs a branch, not a tile
step. The scans run inside `lax.map`s over query tiles and rows; the tile step and each query
tile are checkpointed, so the backward pass recomputes each tile's scores instead of storing
them. Padding (segment 0) attends to itself only, as the dense path's mask does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# Gemma3's masked-logit value; a row that is fully masked inside a tile contributes nothing.
NEG_INF = -2.3819763e38


@dataclasses.dataclass(frozen=True)
class TileWork:
    pairs_computed: int
    pairs_dense: int  # tile pairs a causal dense attention covers: nq * (nq + 1) / 2 per row

    @property
    def fraction(self) -> float:
        return self.pairs_computed / self.pairs_dense if self.pairs_dense else 0.0


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, L] index of the first position of each position's segment (contiguous segments)."""
    length = segment_ids.shape[-1]
    idx = jnp.arange(length, dtype=jnp.int32)
    new = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], dtype=bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return jax.lax.cummax(jnp.where(new, idx[None, :], 0), axis=1)


def key_tile_ranges(segment_ids: jax.Array, tile: int, window: int | None = None) -> tuple[jax.Array, jax.Array]:
    """[B, nq] first and last (inclusive) key tile each query tile needs."""
    b, length = segment_ids.shape
    nq = length // tile
    starts = segment_starts(segment_ids)[:, ::tile]  # the lowest segment of each tile starts here
    q = jnp.arange(nq, dtype=jnp.int32)[None, :]
    first = starts // tile
    if window is not None:
        first = jnp.maximum(first, jnp.maximum(q * tile - window + 1, 0) // tile)
    # Padding (segment 0) is the row's tail and attends to itself only: its own tile.
    first = jnp.where(segment_ids[:, ::tile] == 0, q, first)
    return first.astype(jnp.int32), jnp.broadcast_to(q, (b, nq))


def query_tile_ranges(first: jax.Array) -> jax.Array:
    """[B, nk] last (inclusive) query tile that needs each key tile, from key_tile_ranges' `first`.

    Key tile j is needed by the query tiles i >= j with first[i] <= j. `first` never decreases
    along a row of contiguous segments (segment starts, the window's bound and the padded tail
    all grow with i), so those are j..last[j]; on rows that break that rule the range only
    grows (it spans every such i), which costs work, never correctness.
    """
    nq = first.shape[-1]
    i = jnp.arange(nq, dtype=jnp.int32)
    needs = (first[:, :, None] <= i[None, None, :]) & (i[None, :, None] >= i[None, None, :])  # [B, i, j]
    return jnp.max(jnp.where(needs, i[None, :, None], 0), axis=1).astype(jnp.int32)


def max_key_tiles(length: int, tile: int, window: int | None) -> int:
    """The static bound on a query tile's key-tile range: all tiles, or those a window reaches."""
    nq = length // tile
    return nq if window is None else min(nq, (window - 1 + tile - 1) // tile + 1)


def tile_work(segment_ids: np.ndarray, tile: int, window: int | None = None) -> TileWork:
    """Tile pairs blocked attention computes for these rows, against a causal dense pass."""
    first, last = (np.asarray(x) for x in key_tile_ranges(jnp.asarray(segment_ids), tile, window))
    b, nq = first.shape
    return TileWork(int((last - first + 1).sum()), b * nq * (nq + 1) // 2)


def _tile_step(q, k, v, q_seg, k_seg, q_idx, k_idx, window, carry):
    """One key tile for one query tile: masked scores, online-softmax update."""
    m, l, acc = carry
    s = jnp.einsum("tkgh,skh->kgts", q, k, preferred_element_type=jnp.float32)
    causal = k_idx[None, :] <= q_idx[:, None]
    allowed = causal & (q_seg[:, None] == k_seg[None, :]) & ((q_seg[:, None] != 0) | (q_idx[:, None] == k_idx[None, :]))
    if window is not None:
        allowed &= q_idx[:, None] - k_idx[None, :] < window
    s = jnp.where(allowed[None, None], s, NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(allowed[None, None], jnp.exp(s - m_new[..., None]), 0.0)
    scale = jnp.exp(m - m_new)
    l_new = l * scale + p.sum(axis=-1)
    acc_new = acc * scale[..., None] + jnp.einsum("kgts,skh->kgth", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l_new, acc_new


def blocked_attention(query: jax.Array, key: jax.Array, value: jax.Array, segment_ids: jax.Array, *,
                      tile: int = 512, window: int | None = None) -> jax.Array:
    """softmax(q k^T + mask) v for [B, L, N, H] queries and [B, L, K, H] keys/values (N = K * G).

    query must already be scaled. The mask: same segment id, key index <= query index, and
    (window given) query index - key index < window; padding (id 0) sees itself only, as
    loaders.block_causal_mask_jax. Returns [B, L, N, H] in value's dtype.
    """
    b, length, n, h = query.shape
    kv_heads = key.shape[2]
    groups = n // kv_heads
    tile = min(tile, length)
    if length % tile:
        raise ValueError(f"sequence length {length} is not a multiple of the attention tile {tile}")
    nq = length // tile
    span = max_key_tiles(length, tile, window)
    first, _ = key_tile_ranges(segment_ids, tile, window)
    qt = query.reshape(b, nq, tile, kv_heads, groups, h)
    kt = key.reshape(b, nq, tile, kv_heads, h)
    vt = value.reshape(b, nq, tile, kv_heads, h)
    seg = segment_ids.reshape(b, nq, tile)
    idx = jnp.arange(length, dtype=jnp.int32).reshape(nq, tile)
    step = jax.checkpoint(functools.partial(_tile_step, window=window))

    def one_row(args):
        q_row, k_row, v_row, seg_row, first_row = args

        # Checkpointed per query tile: the backward pass reruns its key loop rather than
        # keeping every tile's online-softmax state for the whole layer.
        @jax.checkpoint
        def one_query_tile(qi):
            q, q_seg, q_idx = q_row[qi], seg_row[qi], idx[qi]
            init = (jnp.full((kv_heads, groups, tile), NEG_INF, jnp.float32),
                    jnp.zeros((kv_heads, groups, tile), jnp.float32),
                    jnp.zeros((kv_heads, groups, tile, h), jnp.float32))

            def body(carry, j):
                ki = first_row[qi] + j
                # lax.cond (not a select): a key tile outside the range is not computed at all.
                carry = jax.lax.cond(
                    ki <= qi,
                    lambda c: step(q, k_row[ki], v_row[ki], q_seg, seg_row[ki], q_idx, idx[ki], carry=c),
                    lambda c: c, carry)
                return carry, None

            (m, l, acc), _ = jax.lax.scan(body, init, jnp.arange(span, dtype=jnp.int32))
            out = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [K, G, T, H]
            return out.transpose(2, 0, 1, 3).reshape(tile, n, h)

        return jax.lax.map(one_query_tile, jnp.arange(nq, dtype=jnp.int32))

    out = jax.lax.map(one_row, (qt, kt, vt, seg, first))
    return out.reshape(b, length, n, h).astype(value.dtype)
