"""--overlong window (issue 33): the pure rule (prepack.packing.packer.window_pieces) on hand-built
masks and as a property, and the job on the shipped chat sample."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepack.packing import packer
from prepack.packing.packer import WindowPiece, piece_id, window_context_tokens, window_pieces


def trained(mask, pieces) -> list[int]:
    """The example positions the kept pieces train, in piece order: a piece's loss mask less its
    first token (the row builder zeroes a segment's first target)."""
    mask = np.asarray(mask, dtype=np.uint8)
    out = []
    for piece in pieces:
        if piece.kept:
            at, m = piece.positions(), piece.loss_mask(mask)
            out += at[1:][m[1:] == 1].tolist()
    return out


def targets_after_first(mask) -> list[int]:
    return [j for j, m in enumerate(mask) if m and j >= 1]


# ----------------------------------------------------------------------------- by hand


def test_single_turn_prompt_longer_than_n_replays_its_last_n_tokens():
    mask = [0] * 6 + [1] * 20  # prompt 0..5, reply 6..25
    pieces = window_pieces(np.array(mask), 10, 4)
    assert pieces == [WindowPiece(0, 0, 0, 10), WindowPiece(2, 6, 10, 16), WindowPiece(2, 6, 16, 22),
                      WindowPiece(2, 6, 22, 26)]
    assert trained(mask, pieces) == targets_after_first(mask)
    assert all(p.length <= 10 for p in pieces)


def test_single_turn_prompt_shorter_than_n_is_replayed_whole():
    mask = [0] * 6 + [1] * 20
    pieces = window_pieces(np.array(mask), 10, 8)
    assert pieces == [WindowPiece(0, 0, 0, 10), WindowPiece(0, 6, 10, 14), WindowPiece(0, 6, 14, 18),
                      WindowPiece(0, 6, 18, 22), WindowPiece(0, 6, 22, 26)]
    assert trained(mask, pieces) == targets_after_first(mask)


def test_multi_turn_a_later_reply_replays_the_turn_it_answers():
    # prompt 0..3, reply 4..9, user turn 10..12, reply 13..20, a loss-0 token 21 at the end.
    mask = [0] * 4 + [1] * 6 + [0] * 3 + [1] * 8 + [0]
    pieces = window_pieces(np.array(mask), 8, 8)
    assert pieces == [WindowPiece(0, 0, 0, 8),  # trains 4..7
                      WindowPiece(0, 4, 8, 12),  # reply 1's prompt, then 8, 9 and the start of the next turn
                      WindowPiece(10, 13, 13, 18),  # reply 2 from its start: the turn it answers is its context
                      WindowPiece(10, 13, 18, 22)]  # the rest of reply 2 (its last token 20) and the loss-0 end
    assert trained(mask, pieces) == targets_after_first(mask)
    # The contiguous window piece is the plain range; the others name context and body.
    assert [piece_id("x", p.start, p.end, (p.context_start, p.context_end)) for p in pieces] == [
        "x#0:8", "x#0:4+8:12", "x#10:18", "x#10:13+18:22"]


def test_a_context_of_l_tokens_or_more_drops_the_piece_and_the_next_reply_goes_on():
    mask = [0] * 12 + [1] * 10  # the prompt alone is longer than L 8; N 10 keeps 10 of it
    assert window_pieces(np.array(mask), 8, 10) == [WindowPiece(2, 12, 12, 22, kept=False)]
    # First reply fits in [0, L); the second's prompt (9 tokens) leaves no room at L 8 with N 9.
    mask = [0, 1, 1, 1] + [0] * 9 + [1] * 3
    pieces = window_pieces(np.array(mask), 8, 9)
    assert pieces == [WindowPiece(0, 0, 0, 8), WindowPiece(4, 13, 13, 16, kept=False)]
    assert trained(mask, pieces) == [1, 2, 3]
    # With N < L nothing is ever dropped: the same example at N 7 trains every target.
    pieces = window_pieces(np.array(mask), 8, 7)
    assert all(p.kept for p in pieces) and trained(mask, pieces) == targets_after_first(mask)


def test_a_reply_with_no_prompt_replays_the_token_before_it():
    mask = [1] * 20  # the example starts with a target: no prompt
    pieces = window_pieces(np.array(mask), 8, 2)
    assert pieces == [WindowPiece(0, 0, 0, 8), WindowPiece(7, 8, 8, 15), WindowPiece(14, 15, 15, 20)]
    assert trained(mask, pieces) == targets_after_first(mask)  # 1..19, each once


def test_no_first_piece_when_l_holds_only_prompt_and_no_piece_for_trailing_loss_0_tokens():
    mask = [0] * 10 + [1] * 3 + [0] * 20
    assert window_pieces(np.array(mask), 8, 2) == [WindowPiece(8, 10, 10, 16)]


def test_default_context_is_a_quarter_of_l_and_at_least_one():
    assert window_context_tokens(256) == 64 and window_context_tokens(2) == 1 and window_context_tokens(256, 100) == 100
    with pytest.raises(ValueError, match="context_tokens at least 1"):
        window_pieces(np.zeros(9, np.uint8), 8, 0)


def test_fit_rule_routes_longer_examples_to_window():
    fit = packer.fit_at_length(np.array([3, 9]), 8, packer.OverlongPolicy.WINDOW)
    assert fit.tolist() == [packer.Fit.WHOLE, packer.Fit.WINDOW]


# ----------------------------------------------------------------------------- as a property


def prompt_of(mask: list[int], position: int) -> tuple[int, int]:
    """The loss-0 run just before the target run holding `position`, written out by walking."""
    reply = position
    while reply > 0 and mask[reply - 1]:
        reply -= 1
    prompt = reply
    while prompt > 0 and not mask[prompt - 1]:
        prompt -= 1
    return prompt, reply


@st.composite
def masks(draw):
    runs = draw(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), min_size=1, max_size=12))
    return [int(t) for t, k in runs for _ in range(k)]


@settings(max_examples=300, deadline=None)
@given(masks(), st.integers(2, 48), st.integers(1, 60))
def test_window_pieces_train_each_target_once_and_start_with_their_context(mask, max_length, n_context):
    if len(mask) <= max_length:
        mask = mask + [0] * (max_length + 1 - len(mask))
    pieces = window_pieces(np.array(mask, dtype=np.uint8), max_length, n_context)
    kept = [p for p in pieces if p.kept]
    assert all(0 < p.length <= max_length for p in kept)
    lost = {j for p in pieces if not p.kept for j in range(p.start, p.end) if mask[j]}
    got = trained(mask, pieces)
    assert sorted(got) == got and len(set(got)) == len(got)  # in order, each once
    assert got == [j for j in targets_after_first(mask) if j not in lost]
    if n_context < max_length:
        assert not lost  # exactly the example's targets after its first token
    for p in pieces:
        if p == WindowPiece(0, 0, 0, max_length):
            continue
        assert p.start >= max_length and mask[p.start]  # every later piece starts its body on a target
        prompt, reply = prompt_of(mask, p.start)
        if reply == 0:
            assert (p.context_start, p.context_end) == (p.start - 1, p.start)
        else:
            assert (p.context_start, p.context_end) == (max(prompt, reply - n_context), reply)
            assert not any(mask[p.context_start:p.context_end])  # the prompt is loss 0 in the example
        assert p.loss_mask(np.array(mask, np.uint8))[:p.context_tokens].sum() == 0
        assert p.kept == (p.context_tokens < max_length)
    ids = [piece_id("e", p.start, p.end, (p.context_start, p.context_end)) for p in kept]
    assert len(set(ids)) == len(ids)
