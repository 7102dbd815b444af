"""Packed rows presented to the model wrongly: the layout bugs the parity check must catch.

Each takes the packed rows as stored (dicts of int32 [B, L] arrays) and returns what a buggy
trainer would hand the model; train/parity.py's `packed_layout` seam takes them. Shipped
code never uses these.
"""

from __future__ import annotations

import numpy as np


def plain_causal(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The attention bug: one segment id for every real token, so each segment sees the ones before it."""
    return {**rows, "segment_ids": (rows["segment_ids"] != 0).astype(np.int32)}


def cumsum_positions(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The position bug: positions count on across segments (Tunix's build_positions_from_mask)."""
    valid = rows["segment_ids"] != 0
    return {**rows, "positions": np.where(valid, np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)}


def shifted_boundary(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The boundary bug: every later segment's first token counted in the segment before it
    (the mask's boundary one token late; positions as stored)."""
    seg = rows["segment_ids"].copy()
    starts = np.zeros(seg.shape, bool)
    starts[:, 1:] = (seg[:, 1:] != seg[:, :-1]) & (seg[:, 1:] > 1)
    r, c = np.nonzero(starts)
    seg[r, c] = seg[r, c - 1]
    return {**rows, "segment_ids": seg}
