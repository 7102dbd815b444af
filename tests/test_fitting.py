"""prepack.packing.fitting.fit_length: the one overlong rule the job's fit stage and preflight run,
checked against the rule's parts (fit_at_length, cut_pieces) on random examples."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from prepack.packing.fitting import fit_length
from prepack.packing.packer import DropReason, Fit, OverlongPolicy, cut_pieces

masks = st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=40), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(masks, st.integers(2, 24), st.sampled_from(list(OverlongPolicy)), st.sampled_from([None, 1, 3]))
def test_every_example_is_kept_dropped_or_cut_once_and_counted(raw, max_length, policy, window_context):
    examples = [np.asarray(m, np.uint8) for m in raw]
    lengths = np.array([len(m) for m in examples])
    result = fit_length(lengths, examples.__getitem__, max_length, policy,
                        window_context if policy is OverlongPolicy.WINDOW else None)
    kept = set(np.flatnonzero(result.kept).tolist())
    dropped = {j for j, _ in result.dropped_whole()}
    cut = set(result.cuts)
    assert kept | dropped | cut == set(range(len(examples))) and not (kept & dropped or kept & cut or dropped & cut)
    assert kept >= set(np.flatnonzero(lengths <= max_length).tolist())
    counts = result.counts()
    piece_drops = sum(r is not None for c in result.cuts.values() for _, r in c)
    assert sum(counts.dropped.values()) == len(dropped) + piece_drops
    pieces = sum(len(c) for c in result.cuts.values())
    assert (counts.split_pieces + counts.window_pieces, counts.split + counts.windowed) == (pieces, len(cut))
    for j, pieces_of in result.cuts.items():
        assert pieces_of == cut_pieces(examples[j], max_length, policy, window_context if policy is OverlongPolicy.WINDOW else None)
    for j in np.flatnonzero(result.fit == Fit.TRUNCATED).tolist():  # a target survives within L, and is counted
        assert result.targets_within[j] == np.count_nonzero(examples[j][1:max_length]) > 0
    for j, reason in result.dropped_whole():
        assert reason is (DropReason.TOO_LONG if policy is OverlongPolicy.DROP else DropReason.NO_TARGETS_AFTER_TRUNCATION)
