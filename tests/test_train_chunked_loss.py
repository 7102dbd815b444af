"""--loss-chunk-tokens: the chunked loss equals the full-logits loss (train/step/chunked_loss.py).

On tiny random Gemma3 (tied embedding), tiny Qwen3 tied and untied (lm_head), with LoRA whose
B matrices are random too (qwix's zero B would make every A gradient zero and hide an error):
loss, aux, per-source sums and LoRA gradients equal the full-logits reference, in float32 to
rounding and in bfloat16 within its noise. Chunk sizes that do not divide B*L are included
(the padding tail must not count).

The float32 models have one layer: the chunked loss and the full-logits one differ only after
the last layer (its hidden states, the output projection and the targets), and one layer's
attention and MLP adapters carry the gradients back through the same code as six; each layer
more only adds compile time. The bfloat16 models keep their depth: their tolerances are the
rounding measured on them (with one layer XLA fuses the programs differently, and one per-source
sum of tiny Gemma3 moved 1.8e-3). Each model and its float32 full-logits reference are built once
per module and shared by the tests that read them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from testkit import train_batches as testing
from train.model import models
from train.step import chunked_loss, loss as loss_lib, model_inputs, precision

VOCAB = 96
LENGTHS = (11, 7, 13, 3, 9, 5)
PLAN = ((0, 1, 3), (2, 4, 5))
MAX_LENGTH = 32

CASES = {
    "tiny-gemma3": ("tiny-gemma3", {"sliding_window_size": 4}),
    "tiny-qwen3": ("tiny-qwen3", {}),
    "tiny-qwen3-untied": ("tiny-qwen3", {"use_tied_embedding": False}),
    "tiny-llama3": ("tiny-llama3", {}),  # one chunk size only: test_llama3_chunked_loss_...
}
FLOAT32_LAYERS = {"num_layers": 1}  # see the module docstring


@functools.cache  # built once (qwix's discovery run compiles); no test changes a model
def lora_model(case: str, dtype: str = "float32") -> nnx.Module:
    name, overrides = CASES[case]
    overrides = {**overrides, **FLOAT32_LAYERS} if dtype == "float32" else overrides or None
    built = models.build_model(name, vocab_size=VOCAB, seed=1, dtype=dtype, config_overrides=overrides)
    model = models.apply_lora(built.model, built.spec, rank=4, seed=3)
    state = nnx.state(model, nnx.LoRAParam)
    rng = np.random.default_rng(5)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), state))
    return model


def mixture_batch() -> dict:
    batch = testing.packed_batch(testing.make_examples(LENGTHS, VOCAB, seed=2), PLAN, MAX_LENGTH)
    seg = batch["segment_ids"]
    batch["source_ids"] = np.where(seg == 0, 0, (seg + np.arange(len(seg))[:, None]) % 3 + 1).astype(np.int32)
    return batch


def loss_and_grads(loss_fn, model, batch, dtype):
    fn = precision.in_compute_dtype(loss_fn, dtype)
    grad_fn = nnx.jit(nnx.value_and_grad(fn, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True))
    inputs = model_inputs.make_gen_model_input_fn()(batch)
    (loss, aux), grads = grad_fn(model, **inputs)
    return float(loss), jax.tree.map(np.asarray, aux), [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]


@functools.cache  # the float32 full-logits reference, once per case
def f32_reference(case: str) -> tuple[float, dict, list[np.ndarray]]:
    return loss_and_grads(loss_lib.masked_loss_fn_with_aux, lora_model(case), mixture_batch(), jnp.float32)


@pytest.fixture(scope="module", params=["tiny-gemma3", "tiny-qwen3", "tiny-qwen3-untied"])
def f32_case(request):
    return request.param, lora_model(request.param), mixture_batch(), f32_reference(request.param)


@pytest.mark.parametrize("chunk", [64, 37, 1000])
def test_float32_chunked_loss_aux_and_gradients_equal_full_logits(f32_case, chunk: int) -> None:
    name, model, batch, (ref_loss, ref_aux, ref_grads) = f32_case
    loss, aux, grads = loss_and_grads(chunked_loss.make_chunked_loss_fn(chunk), model, batch, jnp.float32)
    assert loss == pytest.approx(ref_loss, rel=1e-6), name
    assert set(aux) == set(ref_aux) >= {"nll_by_source", "targets_by_source"}
    for key in ref_aux:
        np.testing.assert_allclose(aux[key], ref_aux[key], rtol=1e-5, atol=1e-5, err_msg=f"{name} {key}")
    assert len(grads) == len(ref_grads) > 0
    scale = max(float(np.max(np.abs(g))) for g in ref_grads)
    assert scale > 0
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-5 * scale, rtol=1e-4, err_msg=name)


def test_llama3_chunked_loss_and_gradients_equal_full_logits() -> None:
    """A third family (train/families/llama3.py): Tunix's Llama3 forward sows no hidden states, so the
    layer-scan class runs its loop to give them; its head is the tied embedding."""
    model, batch = lora_model("tiny-llama3"), mixture_batch()
    ref_loss, _, ref_grads = loss_and_grads(loss_lib.masked_loss_fn_with_aux, model, batch, jnp.float32)
    loss, _, grads = loss_and_grads(chunked_loss.make_chunked_loss_fn(37), model, batch, jnp.float32)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    scale = max(float(np.max(np.abs(g))) for g in ref_grads)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=1e-5 * scale, rtol=1e-4)


@pytest.mark.parametrize("case", ["tiny-gemma3", "tiny-qwen3-untied"])
def test_bfloat16_chunked_loss_and_gradients_equal_full_logits_within_noise(case: str) -> None:
    model, batch = lora_model(case, "bfloat16"), mixture_batch()
    ref_loss, ref_aux, ref_grads = loss_and_grads(loss_lib.masked_loss_fn_with_aux, model, batch, jnp.bfloat16)
    loss, aux, grads = loss_and_grads(chunked_loss.make_chunked_loss_fn(40), model, batch, jnp.bfloat16)
    # XLA fuses the bfloat16 projection differently in the two programs (measured: 6e-5 relative
    # on the loss); bfloat16's own rounding is 4e-3, so 1e-3 is well within its noise.
    assert loss == pytest.approx(ref_loss, rel=1e-3)
    np.testing.assert_allclose(aux["nll_by_source"], ref_aux["nll_by_source"], rtol=1e-3)
    np.testing.assert_array_equal(aux["targets_by_source"], ref_aux["targets_by_source"])
    ref = np.concatenate([g.ravel() for g in ref_grads])
    got = np.concatenate([g.ravel() for g in grads])
    # bfloat16 backward passes differ in summation order: within 2% of the gradient's norm.
    assert np.linalg.norm(got - ref) <= 0.02 * np.linalg.norm(ref)


def test_a_wrong_target_shift_fails_the_equality_check() -> None:
    """Negative control: scoring each position's own token (no shift) is caught by the comparison."""
    model, batch = lora_model("tiny-gemma3"), mixture_batch()
    ref_loss = f32_reference("tiny-gemma3")[0]
    inputs = model_inputs.make_gen_model_input_fn()(batch)

    @nnx.jit  # one program; run eagerly, each of its ops compiled on its own (over a hundred)
    def unshifted_loss(model, input_tokens, input_mask, positions, attention_mask):
        h = chunked_loss.final_hidden_states(model, input_tokens, positions, attention_mask)
        _, weights = loss_lib.shifted_targets(input_tokens, input_mask)
        nll = chunked_loss.chunked_token_nll(h, chunked_loss.output_projection(model), input_tokens, 64)
        return loss_lib.mean_and_aux(nll, weights)[0]

    unshifted = float(unshifted_loss(model, *(inputs[k] for k in ("input_tokens", "input_mask", "positions", "attention_mask"))))
    assert abs(unshifted - ref_loss) > 0.1


def test_chunk_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="chunk_tokens must be positive, got 0"):
        chunked_loss.make_chunked_loss_fn(0)


def _sparse_targets(b: int, length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Targets and weights where most positions are no target and whole chunks hold none."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(0, VOCAB, size=(b, length)).astype(np.int32)
    weights = np.zeros((b, length), np.float32)
    weights[0, 3:9] = 1.0  # the first row's few targets; the second row has none
    weights[0, 20] = 2.0
    return targets, weights


def test_targets_first_chunks_and_the_fused_vjp_equal_the_checkpointed_chunks() -> None:
    """Same weighted NLL and dL/dh as the chunked loss before (every position projected, checkpointed),
    with chunks of no target skipped: float32 to rounding."""
    from testkit.reference import checkpointed_chunked_token_nll

    model = lora_model("tiny-gemma3")
    projection = chunked_loss.output_projection(model)
    b, length, d = 2, 32, int(model.config.embed_dim)
    h = jnp.asarray(np.random.default_rng(1).normal(size=(b, length, d)), jnp.float32)
    targets, weights = _sparse_targets(b, length, 2)
    scale = jnp.asarray(np.random.default_rng(3).uniform(0.5, 2.0, size=(b, length)), jnp.float32)

    def new(x):
        return jnp.sum(chunked_loss.chunked_token_nll(x, projection, jnp.asarray(targets), 8, jnp.asarray(weights)) * weights * scale)

    def old(x):
        return jnp.sum(checkpointed_chunked_token_nll(x, projection, jnp.asarray(targets), 8) * weights * scale)

    new_loss, new_grad = jax.jit(jax.value_and_grad(new))(h)
    old_loss, old_grad = jax.jit(jax.value_and_grad(old))(h)
    assert float(new_loss) == pytest.approx(float(old_loss), rel=1e-6)
    np.testing.assert_allclose(np.asarray(new_grad), np.asarray(old_grad), rtol=1e-5, atol=1e-7)
    assert np.abs(np.asarray(new_grad)[1]).max() == 0.0  # no target in row 1: no gradient into it
    nll = np.asarray(chunked_loss.chunked_token_nll(h, projection, jnp.asarray(targets), 8, jnp.asarray(weights)))
    reference = np.asarray(checkpointed_chunked_token_nll(h, projection, jnp.asarray(targets), 8))
    np.testing.assert_allclose(nll[weights != 0], reference[weights != 0], rtol=1e-6)
    # 8 chunks of 8 positions; the 7 targets sorted first fill one: the other 7 chunks give 0, never projected.
    assert np.count_nonzero(nll) == 8 and set(np.flatnonzero(nll[0])) >= set(range(3, 9))


def test_chunks_without_a_target_never_project() -> None:
    """Counted at run time: the projection of a chunk runs (a host callback inside it fires) only
    when the chunk holds a target, in the forward pass and not again in the backward pass."""
    import dataclasses

    calls: list[int] = []

    @dataclasses.dataclass(frozen=True)
    class Counting(chunked_loss.Projection):
        def logits(self, hc):
            jax.debug.callback(lambda: calls.append(1))
            return super().logits(hc)

    model = lora_model("tiny-gemma3")
    p = chunked_loss.output_projection(model)
    projection = Counting(p.matrix, p.transposed, p.dtype, p.softcap)
    h = jnp.zeros((2, 32, int(model.config.embed_dim)), jnp.float32)
    targets, weights = _sparse_targets(2, 32, 2)
    grad = jax.jit(jax.grad(lambda x: jnp.sum(chunked_loss.chunked_token_nll(x, projection, jnp.asarray(targets), 8,
                                                                           jnp.asarray(weights)) * weights)))
    jax.block_until_ready(grad(h))
    jax.effects_barrier()
    assert len(calls) == 1  # 8 chunks, one with targets: projected once for loss and gradient together
