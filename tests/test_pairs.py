"""Preference pairs as packing units (prepack/packing/pairs.py): where the sides lie, how a pair is
cut to a max length, what it trains."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from prepack.packing import pairs


@st.composite
def batches(draw):
    n = draw(st.integers(1, 6))
    prompts = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    chosen = draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    rejected = draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    lens = np.array([2 * p + c + r for p, c, r in zip(prompts, chosen, rejected)])
    bounds = np.array([[p, p + c] for p, c in zip(prompts, chosen)])
    # Targets: the completions (prompt tokens never), some tokens of each left out.
    masks = []
    for p, c, r in zip(prompts, chosen, rejected):
        for side in (c, r):
            masks.append(np.concatenate([np.zeros(p, np.uint8), np.asarray(draw(st.lists(st.integers(0, 1), min_size=side,
                                                                                            max_size=side)), np.uint8)]))
    return lens, bounds, np.concatenate(masks), draw(st.integers(2, 120))


@settings(max_examples=200, deadline=None)
@given(batches())
def test_a_cut_pair_keeps_both_prompts_and_fills_the_row(batch):
    lens, bounds, mask, L = batch
    c, r = pairs.cut_lengths(lens, bounds, L)
    whole_c, whole_r = pairs.side_lengths(lens, bounds)
    fits = lens <= L
    assert (c[fits] == whole_c[fits]).all() and (r[fits] == whole_r[fits]).all()  # a pair that fits is whole
    assert (c <= whole_c).all() and (r <= whole_r).all() and (c + r <= np.maximum(lens.clip(max=L), 0)).all()
    room = (~fits) & (L >= 2 * bounds[:, 0] + 2)
    assert (c[room] + r[room] == L).all()  # a cut pair with room for its prompts holds exactly L tokens
    assert (c[room] >= bounds[room, 0]).all() and (r[room] >= bounds[room, 0]).all()  # never the prompt
    # The cut tokens are each side's prefix, in order: chosen's first c, then rejected's first r.
    flat, new_lens, new_bounds = pairs.cut_index(lens, bounds, np.arange(len(lens)), L)
    starts = np.cumsum(lens) - lens
    want = np.concatenate([np.concatenate([np.arange(s, s + ci), np.arange(s + b[1], s + b[1] + ri)])
                           for s, b, ci, ri in zip(starts, bounds, c, r)])
    assert np.array_equal(flat, want) and np.array_equal(new_lens, c + r) and np.array_equal(new_bounds[:, 1], c)


@settings(max_examples=200, deadline=None)
@given(batches())
def test_a_pair_trains_as_much_as_both_sides_and_only_when_both_do(batch):
    lens, bounds, mask, L = batch
    for end in (None, L):
        c, r = pairs.cut_lengths(lens, bounds, end)
        got = pairs.targets_after_first(lens, mask, bounds, end)
        starts = np.cumsum(lens) - lens
        for k, (s, b) in enumerate(zip(starts, bounds)):
            chosen = int(mask[s + 1:s + c[k]].sum())
            rejected = int(mask[s + b[1] + 1:s + b[1] + r[k]].sum())
            assert got[k] == (chosen + rejected if min(chosen, rejected) > 0 else 0)


def test_the_rule_in_numbers():
    # prompt 2; completions 10 and 10; L 16: 12 completion tokens left, 6 each.
    assert [x.tolist() for x in pairs.cut_lengths(np.array([24]), np.array([[2, 12]]), 16)] == [[8], [8]]
    # prompt 2; completions 10 and 2; L 12: the short side keeps its 2, the long one the other 6.
    assert [x.tolist() for x in pairs.cut_lengths(np.array([16]), np.array([[2, 12]]), 12)] == [[8], [4]]
