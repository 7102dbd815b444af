"""--overlong window (issue 33): the pure rule (prepack.packing.packer.window_pieces) on hand-built
masks and as a property, and the job on the shipped chat sample."""

from __future__ import annotations

from collections import Counter

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


# ----------------------------------------------------------------------------- the job, on the shipped chat sample


def expected_window_pieces(ids: list[int], mask: list[int], max_length: int, n_context: int) -> list[tuple[list, list]]:
    """--overlong window as the issue states it, written out with plain loops (not window_pieces):
    the first piece is [0, L); each next one is the prompt of the first untrained target's reply
    (the loss-0 run before the reply, its last N tokens) as loss-0 context, then the example's
    tokens from that target on, up to L. (ids, mask) of each piece."""
    pieces, done = [], 0  # done: positions before it are trained or need no training
    if any(mask[1:max_length]):
        pieces.append((ids[:max_length], mask[:max_length]))
        done = max_length
    while True:
        todo = [j for j in range(max(done, 1), len(ids)) if mask[j]]
        if not todo:
            return pieces
        p = todo[0]
        prompt, reply = prompt_of(mask, p)
        assert reply > 0  # chat examples open with loss-0 tokens
        context = list(range(max(prompt, reply - n_context), reply))
        body = list(range(p, min(len(ids), p + max_length - len(context))))
        pieces.append(([ids[j] for j in context + body], [0] * len(context) + [mask[j] for j in body]))
        done = body[-1] + 1


@pytest.fixture(scope="module")
def chat_runs(tmp_path_factory):
    """The shipped chat sample at L 64 and 256 under --overlong window (one and two workers), and
    at L 8192 with nothing overlong."""
    from prepack.text.formats import get_template
    from testkit.pipeline import IN_PROCESS, TWO_PROCESSES, tokenized
    from tests.test_pipeline import pack
    import json
    import os

    import prepack

    path = os.path.join(os.path.dirname(prepack.__file__), "sample_data", "sample_chat.jsonl")
    records = [json.loads(line) for line in open(path, encoding="utf-8")]
    root = tmp_path_factory.mktemp("window")
    base = ["--input", path, "--format", "chat", "--no-tokens"]
    pack(base + ["--max-length", "64", "256", "--overlong", "window", "--output", str(root / "one")])
    pack(base + ["--max-length", "64", "256", "--overlong", "window", "--output", str(root / "two")], runner=TWO_PROCESSES)
    pack(base + ["--max-length", "8192", "--output", str(root / "long")], runner=IN_PROCESS)
    template = get_template("chat")
    convs = [c for r in records for c in template.to_conversations(r)]
    return root, records, tokenized(convs)


def eot_targets(rows, eot: int) -> int:
    return sum(int(((row["input_ids"] == eot) & (row["loss_mask"] == 1)).sum()) for row in rows)


def test_window_on_the_chat_sample_trains_what_l8192_trains(chat_runs):
    """Done when of issue 33: at L 256 (and at L 64, where 158 of the 200 examples are longer than
    L) window trains as many target tokens, and as many end-of-turn targets, as the same
    examples at L 8192 where nothing is overlong; the rows hold exactly the pieces the issue's rule
    makes; the stats and the accounting identity hold; one and two workers write the same bytes."""
    from prepack.format import rowformat
    from prepack.format.manifest import without_volatile
    from prepack.text.tokenizer import load_tokenizer
    from testkit.pipeline import read_shard_set, segment_key, segments_in, shard_bytes

    root, _, examples = chat_runs
    eot = load_tokenizer("gemma3").token_to_id("<end_of_turn>")
    long_manifest, long_rows = read_shard_set(str(root / "long" / "L8192"))
    assert long_manifest.stats["examples_written"] == len(examples) == 200
    for L in (64, 256):
        manifest, rows = read_shard_set(str(root / "one" / f"L{L}"))
        stats = manifest.stats
        assert stats["target_tokens"] == long_manifest.stats["target_tokens"] == sum(
            int(np.count_nonzero(np.asarray(e.loss_mask)[1:])) for e in examples)
        assert eot_targets(rows, eot) == eot_targets(long_rows, eot) > 0
        want, windowed, pieces, replayed = Counter(), 0, 0, 0
        for e in examples:
            ids, mask = [int(t) for t in e.input_ids], [int(m) for m in e.loss_mask]
            if len(ids) <= L:
                want[segment_key(ids, mask)] += 1
                continue
            cut = expected_window_pieces(ids, mask, L, L // 4)
            windowed, pieces = windowed + 1, pieces + len(cut)
            replayed += sum(piece_mask.index(1) for _, piece_mask in cut[1:])  # the context: loss 0 up to the first target
            for piece_ids, piece_mask in cut:
                want[segment_key(piece_ids, piece_mask)] += 1
        for row in rows:
            rowformat.check_row(row, L)
            for k in range(1, int(row["segment_ids"].max()) + 1):
                at = np.flatnonzero(row["segment_ids"] == k)
                assert row["positions"][at].tolist() == list(range(len(at)))  # positions restart in each piece
        assert segments_in(rows) == want
        assert (stats["examples_windowed"], stats["window_pieces"]) == (windowed, pieces)
        assert (windowed > 100) == (L == 64) and stats["context_tokens_replayed"] == (replayed if L == 64 else 0)
        assert (stats["examples_read"] - stats["examples_windowed"] + stats["window_pieces"]
                == stats["examples_written"] + sum(stats["examples_dropped"].values()))
        assert manifest.options["overlong"] == "window" and manifest.options["window_context_tokens"] is None
        assert shard_bytes(str(root / "one" / f"L{L}")) == shard_bytes(str(root / "two" / f"L{L}"))
        a, b = (root / k / f"L{L}" / "manifest.json" for k in ("one", "two"))
        assert without_volatile(a.read_text()) == without_volatile(b.read_text())


def test_every_piece_of_a_windowed_chat_example_holds_its_prompt(chat_runs):
    """On real text: each piece after the first of a windowed example starts with the prompt its
    reply answers (the user turn, whole when it fits in N tokens, else its last N), the pieces'
    targets put together are exactly the example's targets after its first token, and the last
    piece trains the end-of-turn token."""
    from prepack.text.tokenizer import load_tokenizer

    _, records, examples = chat_runs
    tok = load_tokenizer("gemma3")
    eot = tok.token_to_id("<end_of_turn>")
    L, n_context = 64, 16
    seen = 0
    for record, e in zip(records, examples):
        ids, mask = np.asarray(e.input_ids), np.asarray(e.loss_mask)
        if len(ids) <= L:
            continue
        pieces = window_pieces(mask, L, n_context)
        assert all(p.kept for p in pieces)
        got = [int(ids[j]) for j in trained(mask, pieces)]
        assert got == [int(t) for t, m in zip(ids[1:], mask[1:]) if m]
        last = pieces[-1]
        assert int(ids[last.positions()[-1 - list(mask[last.positions()][::-1]).index(1)]]) == eot
        users = [m["content"] for m in record["messages"] if m["role"] == "user"]
        for p in pieces[1:]:
            context = tok.decode([int(t) for t in ids[p.context_start:p.context_end]])
            prompt, reply = prompt_of(mask.tolist(), p.start)
            answered = tok.decode([int(t) for t in ids[prompt:reply]])
            assert any(u in answered for u in users)  # the prompt is the user turn the reply answers
            assert answered.endswith(context) and (context == answered or p.context_tokens == n_context)
            seen += 1
    assert seen > 100


@pytest.mark.parametrize("argv, message", [
    (["--window-context-tokens", "0"], "--window-context-tokens must be a whole number of at least 1, got '0'"),
    (["--window-context-tokens", "-3"], "--window-context-tokens must be a whole number of at least 1, got '-3'"),
    (["--window-context-tokens", "2.5"], "--window-context-tokens must be a whole number of at least 1, got '2.5'"),
    (["--window-context-tokens", "many"], "--window-context-tokens must be a whole number of at least 1, got 'many'"),
])
def test_a_bad_window_context_is_refused_in_one_line(tmp_path, capsys, argv, message):
    from pipelines.launch import cli

    assert cli.main(["--sample", "--output", str(tmp_path), "--overlong", "window", *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"prepack pack: {message}"]


def test_window_context_without_window_is_refused_in_one_line(tmp_path, capsys):
    from pipelines.launch import cli

    assert cli.main(["--sample", "--output", str(tmp_path), "--overlong", "split", "--window-context-tokens", "8"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "prepack pack: --window-context-tokens applies to --overlong window only (got --overlong split); "
        "add --overlong window or leave it out"]


def test_a_context_too_long_for_l_is_dropped_with_its_reason_and_dead_lettered(tmp_path):
    """--window-context-tokens at least L: a reply whose prompt is L tokens or more gets no piece;
    its piece is counted as window_context_too_long, dead-lettered, and the identity still holds."""
    import json

    from tests.test_pipeline import pack
    from testkit.pipeline import read_shard_set, write_jsonl

    long_prompt = " ".join(f"word{i}" for i in range(60))
    records = [{"messages": [{"role": "user", "content": long_prompt}, {"role": "assistant", "content": "Yes. " * 20}]},
               {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}]
    path = write_jsonl(str(tmp_path / "chat.jsonl"), records)
    out = tmp_path / "out"
    pack(["--input", path, "--format", "chat", "--max-length", "48", "--overlong", "window", "--window-context-tokens",
          "48", "--output", str(out), "--no-tokens"])
    manifest, rows = read_shard_set(str(out / "L48"))
    stats = manifest.stats
    assert stats["examples_dropped"] == {"window_context_too_long": 1}
    assert (stats["examples_windowed"], stats["window_pieces"], stats["examples_written"]) == (1, 1, 1)
    assert (stats["examples_read"] - stats["examples_windowed"] + stats["window_pieces"]
            == stats["examples_written"] + sum(stats["examples_dropped"].values()))
    assert manifest.options["window_context_tokens"] == 48
    (entry,) = [json.loads(line) for line in (out / "L48" / "dead_letter.jsonl").read_text().splitlines()]
    assert entry["reason"] == "window_context_too_long" and "give --window-context-tokens below 48" in entry["message"]
