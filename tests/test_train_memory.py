"""Tunix's own train step: packed against unpacked batches of the same examples (loss and
gradient), and the compiled memory of our loss against Tunix's default (XLA's plan,
`.lower(...).compile().memory_analysis()`, for the exact step PeftTrainer jits).
Numbers are printed for the report (pytest -s).
"""

from __future__ import annotations

import numpy as np
import optax
import pytest

from testkit import train_batches as testing
from train.measurement import compiled
from train.model import models
from train.step import loss as loss_lib, model_inputs


def _trainer(name: str, vocab: int, loss_fn, overrides=None):
    from tunix.sft import peft_trainer

    built = models.build_model(name, vocab_size=vocab, config_overrides=overrides)
    model = models.apply_lora(built.model, built.spec, rank=4)
    t = peft_trainer.PeftTrainer(model, optax.adamw(1e-3), peft_trainer.TrainingConfig(eval_every_n_steps=10, max_steps=1))
    t.with_gen_model_input_fn(model_inputs.make_gen_model_input_fn())
    t.with_loss_fn(loss_fn, has_aux=True)
    return t


def _one_train_step(batch: dict) -> tuple[float, float]:
    """(loss, gradient norm) of one step of Tunix's own jitted train step, from a fresh model."""
    from flax import nnx

    t = _trainer("tiny-qwen3", 256, loss_lib.masked_loss_fn_with_aux)
    step = nnx.jit(t.create_train_step_fn())
    loss, _, grad_norm = step(t.model, t.optimizer, model_inputs.device_fields(batch))
    return float(loss), float(grad_norm)


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_packed_and_unpacked_batches_train_the_same_through_the_trainer_step() -> None:
    """The same ten examples, packed into 4 rows and one per row (10 rows), through the real
    train step (gen_model_input_fn, our loss, value_and_grad): the same loss and the same
    gradient, so packing changes how many rows a step holds, not what it learns from them."""
    max_length, vocab = 64, 256
    examples = testing.make_examples([30, 9, 17, 22, 5, 40, 12, 28, 8, 19], vocab, seed=3)
    plan = ((0, 3, 8), (5, 1, 4), (7, 6, 2), (9,))
    packed = testing.packed_batch(examples, plan, max_length)
    unpacked = testing.unpacked_batch(examples, max_length)
    assert packed["input_ids"].shape == (4, max_length) and unpacked["input_ids"].shape == (10, max_length)
    assert packed["loss_mask"].sum() == unpacked["loss_mask"].sum()
    loss_packed, grad_packed = _one_train_step(packed)
    loss_unpacked, grad_unpacked = _one_train_step(unpacked)
    print(f"\nloss packed {loss_packed:.7f} unpacked {loss_unpacked:.7f}; grad norm {grad_packed:.7g} {grad_unpacked:.7g}")
    assert np.isfinite(loss_packed) and grad_packed > 0
    assert loss_packed == pytest.approx(loss_unpacked, rel=1e-5)
    assert grad_packed == pytest.approx(grad_unpacked, rel=1e-4)


def test_masked_loss_plans_less_memory_than_tunix_default_at_gemma3_vocab() -> None:
    vocab = 262_144  # Gemma3's
    batch_size, max_length = 2, 64
    examples = testing.make_examples([40, 20, 60], vocab, seed=4)
    batch = testing.packed_batch(examples, ((0, 1), (2,)), max_length)
    overrides = {"num_layers": 1}  # the loss is what differs; one layer keeps the compile short
    ours = compiled.train_step_memory(_trainer("tiny-gemma3", vocab, loss_lib.masked_loss_fn_with_aux, overrides), batch)
    theirs = compiled.train_step_memory(
        _trainer("tiny-gemma3", vocab, loss_lib.with_aux(loss_lib.tunix_default_loss_fn()), overrides), batch
    )
    logits_bytes = batch_size * max_length * vocab * 4
    print(
        f"\nvocab {vocab}, [B={batch_size}, L={max_length}], f32 logits = {compiled.fmt_bytes(logits_bytes)}\n"
        f"  temp: ours {compiled.fmt_bytes(ours.temp_bytes)}  tunix default {compiled.fmt_bytes(theirs.temp_bytes)}"
        f"  ({theirs.temp_bytes / logits_bytes:.2f} vs {ours.temp_bytes / logits_bytes:.2f} logits-sized buffers)"
    )
    assert ours.temp_bytes < theirs.temp_bytes
    # The default's float32 one-hot is itself a logits-sized buffer; ours should save at least that much.
    assert theirs.temp_bytes - ours.temp_bytes >= 0.9 * logits_bytes


def test_masked_loss_equals_tunix_default_on_random_logits() -> None:
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(3, 16, 1000)) * 4, jnp.float32)
    tokens = jnp.asarray(rng.integers(0, 1000, size=(3, 16)), jnp.int32)
    mask = jnp.asarray(rng.integers(0, 2, size=(3, 16)), jnp.int32)
    model = testing.FixedLogits(logits)
    ours = loss_lib.masked_loss_fn(model, tokens, mask, None, None)
    theirs = loss_lib.tunix_default_loss_fn()(model, tokens, mask, None, None)
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    # Gradients with respect to the logits agree as well.
    g_ours = jax.grad(lambda l: loss_lib.masked_loss_fn(testing.FixedLogits(l), tokens, mask, None, None))(logits)
    g_theirs = jax.grad(lambda l: loss_lib.tunix_default_loss_fn()(testing.FixedLogits(l), tokens, mask, None, None))(logits)
    np.testing.assert_allclose(np.asarray(g_ours), np.asarray(g_theirs), atol=1e-7)
    # bf16 logits: ours computes in float32.
    ours_bf16 = loss_lib.masked_loss_fn(testing.FixedLogits(logits.astype(jnp.bfloat16)), tokens, mask, None, None)
    assert ours_bf16.dtype == jnp.float32
