"""Preference pairs as packing units: the one rule for where a pair's sides lie, how it is cut to a
max length, and what it trains.

A pair (format `preference`) travels through the job as one example: its chosen side's tokens, then
its rejected side's. `bounds` [pairs, 2] says where: (prompt, split), the tokens of the prompt both
sides start with, and the chosen side's length. The planner places a pair by its whole length, so
its two sides always land in one row, as adjacent segments (docs/row_format.md, versions 5 and 6).

Under --overlong truncate a pair longer than the max length L keeps its prompt on both sides and
cuts the ends of its completions: each side gets its own completion when that is at most half of
what is left after the two prompts, and the other side the rest (so the cut pair holds exactly L
tokens). Both sides must keep a target after their first token, else the pair is dropped
(no_targets_after_truncation). Under --overlong drop a longer pair is dropped (too_long).
"""
from __future__ import annotations

import numpy as np

__all__ = ["side_lengths", "cut_lengths", "targets_after_first", "cut_index"]


def side_lengths(lens: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(chosen, rejected) tokens of each whole pair."""
    lens = np.asarray(lens, dtype=np.int64)
    split = np.asarray(bounds, dtype=np.int64)[:, 1]
    return split, lens - split


def cut_lengths(lens: np.ndarray, bounds: np.ndarray, max_length: int | np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(chosen, rejected) tokens of each pair cut to `max_length` (the truncate rule above; a pair
    that fits is whole). A pair whose two prompts leave no room gets its prompts alone, cut to
    fit (it trains nothing: the fit drops it)."""
    chosen, rejected = side_lengths(lens, bounds)
    if max_length is None:
        return chosen, rejected
    prompt = np.asarray(bounds, dtype=np.int64)[:, 0]
    limit = np.broadcast_to(np.asarray(max_length, dtype=np.int64), chosen.shape)
    over = chosen + rejected > limit
    if not over.any():
        return chosen, rejected
    budget = np.maximum(limit - 2 * prompt, 0)  # completion tokens both sides may keep
    c1, c2 = chosen - prompt, rejected - prompt
    a = np.minimum(c1, np.maximum(budget - c2, budget // 2))
    b = np.minimum(c2, budget - a)
    room = np.maximum(limit // 2, 1)  # no room for the prompts: each side's start, up to half the row
    cut_c = np.where(budget > 0, prompt + a, np.minimum(chosen, room))
    cut_r = np.where(budget > 0, prompt + b, np.minimum(rejected, limit - cut_c))
    return np.where(over, cut_c, chosen), np.where(over, cut_r, rejected)


def targets_after_first(lens: np.ndarray, mask: np.ndarray, bounds: np.ndarray,
                        max_length: int | None = None) -> np.ndarray:
    """Per pair, cut to `max_length` when given: its two sides' targets after each side's first
    token (a segment's first token is never a target), added up, and 0 unless both sides have some:
    a pair trains only when both sides do, and then as much as both (a mixture's target-token weight)."""
    whole_c, whole_r = side_lengths(lens, bounds)
    cut_c, cut_r = cut_lengths(lens, bounds, max_length)
    side_lens = np.stack([whole_c, whole_r], axis=1).ravel()  # the mask holds each pair's sides in turn
    kept = np.stack([cut_c, cut_r], axis=1).ravel()
    side_starts = np.cumsum(side_lens) - side_lens
    sums = np.concatenate([[0], np.cumsum(np.asarray(mask, dtype=np.int64))])
    first = side_starts + np.minimum(side_lens, 1)
    per_side = sums[np.maximum(side_starts + kept, first)] - sums[first]
    per_side = per_side.reshape(-1, 2)
    return np.where(per_side.min(axis=1) > 0, per_side.sum(axis=1), 0)


def cut_index(lens: np.ndarray, bounds: np.ndarray, take: np.ndarray,
              max_length: int | np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pairs `take`, each cut to `max_length`: (flat positions of their kept tokens in the
    batch's arrays, their new lengths, their new bounds)."""
    take = np.asarray(take, dtype=np.int64)
    lens = np.asarray(lens, dtype=np.int64)
    bounds = np.asarray(bounds, dtype=np.int64)
    starts = np.cumsum(lens) - lens
    sub_lens, sub_bounds = lens[take], bounds[take]
    cut_c, cut_r = cut_lengths(sub_lens, sub_bounds, max_length)
    split = sub_bounds[:, 1]
    # Two runs per pair: [start, start + cut_c) and [start + split, start + split + cut_r).
    run_starts = np.stack([starts[take], starts[take] + split], axis=1).ravel()
    run_lens = np.stack([cut_c, cut_r], axis=1).ravel()
    out_starts = np.cumsum(run_lens) - run_lens
    flat = np.repeat(run_starts - out_starts, run_lens) + np.arange(int(run_lens.sum()), dtype=np.int64)
    new_bounds = np.stack([np.minimum(sub_bounds[:, 0], cut_c), cut_c], axis=1)
    return flat, cut_c + cut_r, new_bounds
