"""Packed rows presented to the model wrongly: the layout bugs the parity check must catch.

Each takes the packed rows as stored (dicts of int32 [B, L] arrays) and returns what a buggy
trainer would hand the model; train/verification/parity.py's `packed_layout` seam takes them. Shipped
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


def one_key_leak(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The smallest attention leak: every later segment sees one key of the segment before it
    (that segment's last token is counted in the next one; positions as stored). The moved
    token predicts the next segment's first token, never a target, so only the later segment's
    log p can move, and only by that one key."""
    seg = rows["segment_ids"].copy()
    ends = np.zeros(seg.shape, bool)
    ends[:, :-1] = (seg[:, :-1] != seg[:, 1:]) & (seg[:, 1:] > 1) & (seg[:, :-1] > 0)
    r, c = np.nonzero(ends)
    seg[r, c] = seg[r, c + 1]
    return {**rows, "segment_ids": seg}
