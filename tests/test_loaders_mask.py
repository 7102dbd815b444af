"""block_causal_mask against a brute-force reference, and the jax version against numpy."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders import block_causal_mask, block_causal_mask_jax


def reference_mask(segment_ids: np.ndarray) -> np.ndarray:
    """The definition, one (query, key) pair at a time."""
    batch, length = segment_ids.shape
    mask = np.zeros((batch, length, length), dtype=bool)
    for b in range(batch):
        for q in range(length):
            for k in range(length):
                sq, sk = segment_ids[b, q], segment_ids[b, k]
                if sq == 0:
                    mask[b, q, k] = q == k  # padding attends to itself only
                else:
                    mask[b, q, k] = sq == sk and k <= q
    return mask


@st.composite
def packed_segment_ids(draw, length: int | None = None, batch: int | None = None) -> np.ndarray:
    """Row-format layouts: segments 1..k of random lengths, then padding."""
    length = length or draw(st.integers(1, 24))
    rows = []
    for _ in range(batch or draw(st.integers(1, 3))):
        lengths, used = [], 0
        while used < length and draw(st.booleans()):
            n = draw(st.integers(1, length - used))
            lengths.append(n)
            used += n
        row = np.zeros(length, dtype=np.int32)
        start = 0
        for k, n in enumerate(lengths, start=1):
            row[start : start + n] = k
            start += n
        rows.append(row)
    return np.stack(rows)


@settings(max_examples=150, deadline=None)
@given(packed_segment_ids())
def test_matches_reference_on_packed_layouts(segment_ids):
    mask = block_causal_mask(segment_ids)
    assert mask.dtype == bool and mask.shape == segment_ids.shape + (segment_ids.shape[1],)
    np.testing.assert_array_equal(mask, reference_mask(segment_ids))
    # Every query row allows at least one key, so softmax never sees an all-masked row.
    assert mask.any(axis=-1).all()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=6, max_size=6), min_size=1, max_size=3))
def test_matches_reference_on_any_ids(rows):
    # Non-contiguous and repeated ids too: segments are told apart by equality alone.
    segment_ids = np.asarray(rows, dtype=np.int32)
    np.testing.assert_array_equal(block_causal_mask(segment_ids), reference_mask(segment_ids))


def test_worked_example():
    mask = block_causal_mask(np.array([[1, 1, 2, 2, 2, 0]]))[0].astype(int)
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]


import jax

_jitted_mask = jax.jit(block_causal_mask_jax)


@settings(max_examples=40, deadline=None)
@given(packed_segment_ids(length=16, batch=4))
def test_jax_equals_numpy(segment_ids):
    # One shape, so the jitted function compiles once.
    np.testing.assert_array_equal(np.asarray(_jitted_mask(segment_ids)), block_causal_mask(segment_ids))


def test_jax_under_jit():
    segment_ids = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=np.int32)
    masked = jax.jit(lambda s: block_causal_mask_jax(s))(segment_ids)
    assert masked.dtype == jax.numpy.bool_ and masked.shape == (2, 8, 8)
    np.testing.assert_array_equal(np.asarray(masked), block_causal_mask(segment_ids))
