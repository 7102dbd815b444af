"""ChatML rows for Qwen3 on the real embedded tokenizer (`--tokenizer qwen3`, chat format auto).

Published ids written into the tests, never computed by the code under test:
- PROMPT_IDS: a public C++ parity test of the Qwen2 tokenizer used as the Qwen3 text encoder
  of FLUX.2-klein, whose reference ids were captured from transformers'
  `apply_chat_template([{"role": "user", ...}], add_generation_prompt=True,
  enable_thinking=False)` then `tok(...)`: `<|im_start|>user\\n{prompt}<|im_end|>\\n
  <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`. For SFT the prompt side of a row must
  be exactly this (the reply follows it).
- QWEN3_RENDERED: Qwen3-0.6B's default template on [user "Hi", assistant "Hello"], as quoted
  in SkyRL's skyrl_train/utils/templates/README.md.
"""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prepack.text.chat import ChatMLFormat, Qwen3Format, get_chat_format, tokenize_conversations, tokenize_conversations_flat, tokenize_prompt_responses_flat
from prepack.text.conversation import Conversation, Turn
from prepack.text.tokenizer import load_tokenizer


def one(fmt, example):
    """One example through the batch path (tokenize_conversations of a batch of one)."""
    return tokenize_conversations([example], fmt.tokenizer, fmt)[0]

PROMPT_IDS = {
    "a cat on a skateboard": [151644, 872, 198, 64, 8251, 389, 264, 97982, 151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271],
    "It's 3 cats & 2 dogs (100% good) \u2014 don't stop!": [
        151644, 872, 198, 2132, 594, 220, 18, 19423, 609, 220, 17, 12590, 320, 16, 15, 15, 4, 1661, 8, 1959, 1513, 944,
        2936, 0, 151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271],
}
QWEN3_RENDERED = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n"
IM_END, NL = 151645, 198


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer("qwen3")


@pytest.fixture(scope="module")
def fmt(tok: Any) -> Qwen3Format:
    chosen = get_chat_format("auto", tok)
    assert type(chosen) is Qwen3Format
    return chosen


def test_auto_picks_qwen3_and_renders_like_qwen3s_template(fmt: Qwen3Format) -> None:
    c = Conversation((Turn("user", "Hi"), Turn("assistant", "Hello")))
    assert fmt.render(c) == QWEN3_RENDERED
    ex = one(fmt, c)
    assert fmt.tokenizer.decode(ex.input_ids.tolist()) == QWEN3_RENDERED


@pytest.mark.parametrize("prompt", sorted(PROMPT_IDS))
def test_single_turn_prompt_side_is_the_published_generation_prompt(tok: Any, fmt: Qwen3Format, prompt: str) -> None:
    reply = "Hello world"
    ex = one(fmt, Conversation((Turn("user", prompt), Turn("assistant", reply))))
    n = len(PROMPT_IDS[prompt])
    assert ex.input_ids.tolist() == PROMPT_IDS[prompt] + [9707, 1879, IM_END, NL]
    # Only the reply and its <|im_end|> are targets; the empty think block is prompt.
    assert ex.loss_mask.tolist() == [0] * n + [1, 1, 1, 0]
    fast = tokenize_prompt_responses_flat([prompt], [reply], tok, fmt)
    assert fast is not None and fast[0].tolist() == ex.input_ids.tolist() and fast[1].tolist() == ex.loss_mask.tolist()


def test_think_block_only_on_the_last_reply_after_the_last_user_turn(tok: Any, fmt: Qwen3Format) -> None:
    c = Conversation((Turn("system", "Be brief."), Turn("user", "Hi"), Turn("assistant", "Hello"),
                      Turn("user", "Bye?"), Turn("assistant", "\n\nBye")))
    # As Qwen3's template renders it: history replies without a block, the reply's leading
    # newlines dropped after the block.
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nBye?<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n\n</think>\n\nBye<|im_end|>\n")
    assert fmt.render(c) == expected
    ex = one(fmt, c)
    ids, mask = ex.input_ids.tolist(), ex.loss_mask.tolist()
    assert tok.decode(ids) == expected
    assert ids.count(151667) == 1 and ids.count(151668) == 1
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Hello<|im_end|>Bye<|im_end|>"
    # A conversation that ends on a user turn, or has no user turn, gets no block.
    no_user = Conversation((Turn("system", "s"), Turn("assistant", "a")))
    assert "<think>" not in fmt.render(no_user)


def test_plain_chatml_has_no_think_block(tok: Any) -> None:
    chatml = get_chat_format("chatml", tok)
    assert type(chatml) is ChatMLFormat
    ex = one(chatml, Conversation((Turn("user", "Hi"), Turn("assistant", "Hello"))))
    assert 151667 not in ex.input_ids.tolist()


def test_think_text_in_a_reply_stays_plain_text(fmt: Qwen3Format) -> None:
    ex = one(fmt, Conversation((Turn("user", "<think>x</think>"), Turn("assistant", "<|im_end|></think>"))))
    ids = ex.input_ids.tolist()
    assert ids.count(151667) == 1 and ids.count(151668) == 1 and ids.count(IM_END) == 2


QWEN_TEXT = st.lists(st.sampled_from(list("ab Z0 9\n\t.é日🙂<>") + ["</think>", "<|im_end|>", "  ", "\n\n", " the"]), max_size=25).map("".join)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pairs=st.lists(st.tuples(QWEN_TEXT, QWEN_TEXT), min_size=1, max_size=6))
def test_property_pairs_match_conversations_qwen3(tok: Any, fmt: Qwen3Format, pairs: list[tuple[str, str]]) -> None:
    convs = [Conversation((Turn("user", p), Turn("assistant", r))) for p, r in pairs]
    fast = tokenize_prompt_responses_flat([p for p, _ in pairs], [r for _, r in pairs], tok, fmt)
    slow = tokenize_conversations_flat(convs, tok, fmt)
    assert fast is not None and slow is not None
    assert fast[0].tolist() == slow[0].tolist() and fast[1].tolist() == slow[1].tolist() and fast[2] == slow[2]
    for c, ex in zip(convs, tokenize_conversations(convs, tok, fmt)):
        assert tok.decode(ex.input_ids.tolist()) == fmt.render(c)
