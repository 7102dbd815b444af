"""`--lora-kernel fused` (train/step/fused_lora.py): the same adapters and the same values as qwix's LoRA.

The fused product must be invisible but for speed: the model built with it has qwix's adapter
names, shapes and initial values, computes the same loss, and gives the same gradients; sites it
does not take (the attention projections' einsums, QLoRA's quantized kernels) stay qwix's own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from testkit import train_batches as testing
from train.attention_kernels import attention
from train.model import models
from train.step import fused_lora, model_inputs
from train.step import loss as loss_lib

SHAPES = {"tiny-gemma3": "dense", "tiny-qwen3": "blocked"}


@functools.cache  # built once (qwix's discovery run compiles): the remat cases share a model and set its remat
def _model(name: str, kernel: str, dtype: str | None = None, qlora: str | None = None, layers: int = 2):
    built = models.build_model(name, vocab_size=256, seed=1, dtype=dtype, config_overrides={"num_layers": layers})
    model = models.apply_lora(built.model, built.spec, rank=4, lora_kernel=kernel, qlora=qlora, qlora_tile=None)
    attention.install(model, SHAPES[name], 64)
    rng = np.random.default_rng(0)  # B nonzero, so the adapters move the loss and every gradient is live
    nnx.update(model, jax.tree.map(lambda x: x + 0.1 * rng.normal(size=x.shape).astype(x.dtype),
                                   nnx.state(model, nnx.LoRAParam)))
    return model


def _loss_and_grads(model, kind: str):
    batch = testing.packed_batch(testing.make_examples([100, 60, 90], 256, seed=1), ((0, 1), (2,)), 192)
    inputs = model_inputs.make_gen_model_input_fn(attention=kind)(batch)
    fn = nnx.jit(nnx.value_and_grad(loss_lib.masked_loss_fn_with_aux, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True))
    (loss, _), grads = fn(model, **inputs)
    return float(loss), {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(grads)}


@pytest.mark.parametrize("name,remat", [("tiny-gemma3", False), ("tiny-qwen3", False), ("tiny-gemma3", True)])
def test_fused_lora_has_qwix_adapters_and_computes_the_same_loss_and_gradients(name, remat) -> None:
    """Also under --remat layer, where JAX traces the fused forward again outside qwix's interception. The tiny
    models' MLP (d 64, hidden 128) takes both backward forms: down's one matmul (2K > N), gate's and up's two.
    One layer: every layer computes alike (the next test counts the sites of two), and each layer more only
    adds compile time to the four programs here."""
    from train.step import memory_path

    qwix_model, fused_model = _model(name, fused_lora.QWIX, layers=1), _model(name, fused_lora.FUSED, layers=1)
    for model in (qwix_model, fused_model):
        memory_path.set_remat(model, remat)
    qwix_params = dict(nnx.to_flat_state(nnx.state(qwix_model, nnx.LoRAParam)))
    fused_params = dict(nnx.to_flat_state(nnx.state(fused_model, nnx.LoRAParam)))
    assert qwix_params.keys() == fused_params.keys() and len(qwix_params) > 0
    for k in qwix_params:
        np.testing.assert_array_equal(np.asarray(qwix_params[k][...]), np.asarray(fused_params[k][...]))
    loss, grads = _loss_and_grads(qwix_model, SHAPES[name])
    f_loss, f_grads = _loss_and_grads(fused_model, SHAPES[name])
    assert f_loss == pytest.approx(loss, rel=1e-6)
    assert grads.keys() == f_grads.keys()
    mlp = [k for k in grads if "mlp" in k]
    assert mlp and all(np.abs(grads[k]).max() > 0 for k in mlp)  # the fused sites' gradients are not zeros
    for k in grads:
        np.testing.assert_allclose(f_grads[k], grads[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _fused_calls(model, kind: str, monkeypatch) -> int:
    """How many sites trace through the fused product in one loss-and-gradients trace."""
    calls = []
    real = fused_lora.lora_linear
    monkeypatch.setattr(fused_lora, "lora_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    batch = testing.packed_batch(testing.make_examples([100, 60], 256, seed=1), ((0, 1),), 192)
    inputs = model_inputs.make_gen_model_input_fn(attention=kind)(batch)
    fn = nnx.jit(nnx.value_and_grad(loss_lib.masked_loss_fn_with_aux, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True))
    fn.lower(model, **inputs)
    monkeypatch.setattr(fused_lora, "lora_linear", real)
    return len(calls)


def test_the_fused_product_takes_the_mlp_and_leaves_the_rest_to_qwix(monkeypatch) -> None:
    """Gemma3's MLP projections are dense (three a layer, two layers: six sites); its attention projections are
    einsums and stay qwix's, and a quantized kernel (QLoRA) computes through qwix's quantized path."""
    assert _fused_calls(_model("tiny-gemma3", fused_lora.QWIX), "dense", monkeypatch) == 0
    assert _fused_calls(_model("tiny-gemma3", fused_lora.FUSED), "dense", monkeypatch) == 6
    assert _fused_calls(_model("tiny-gemma3", fused_lora.FUSED, qlora="int8"), "dense", monkeypatch) == 0


def test_the_fused_product_in_bfloat16_is_qwix_within_rounding() -> None:
    x = jax.random.normal(jax.random.key(0), (2, 8, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64, 96), jnp.bfloat16) / 8
    a = jax.random.normal(jax.random.key(2), (64, 4), jnp.float32) / 8
    b = jax.random.normal(jax.random.key(3), (4, 96), jnp.float32) / 8

    def qwix_way(x, a, b):  # qwix's dot_general site: res + delta * scale
        return (x @ w + ((x @ a.astype(x.dtype)) @ b.astype(x.dtype)) * 2.0).astype(jnp.float32).sum()

    def fused_way(x, a, b):
        return fused_lora.lora_linear(x, w, a.astype(x.dtype), b.astype(x.dtype), 2.0).astype(jnp.float32).sum()

    # Jitted: one program each (run eagerly, every op of the backward pass compiles on its own).
    want = jax.jit(jax.grad(qwix_way, argnums=(0, 1, 2)))(x, a, b)
    got = jax.jit(jax.grad(fused_way, argnums=(0, 1, 2)))(x, a, b)
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == got[2].dtype == jnp.float32
    for g, w_ in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w_, np.float32), rtol=2e-2, atol=2e-2)


def test_the_frozen_kernel_still_gets_its_true_gradient() -> None:
    """The trainer never asks for W's gradient, but a caller who does gets x^T dy, not a silent zero."""
    x = jax.random.normal(jax.random.key(0), (3, 5, 16), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (16, 12), jnp.float32)
    a = jax.random.normal(jax.random.key(2), (16, 4), jnp.float32)
    b = jax.random.normal(jax.random.key(3), (4, 12), jnp.float32)
    want = jax.jit(jax.grad(lambda w: ((x @ w + (x @ a) @ b * 0.5) ** 2).sum()))(w)
    got = jax.jit(jax.grad(lambda w: (fused_lora.lora_linear(x, w, a, b, 0.5) ** 2).sum()))(w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(want).max() > 1


def test_an_unknown_lora_kernel_is_refused_by_name() -> None:
    built = models.build_model("tiny-gemma3", vocab_size=256, seed=1, config_overrides={"num_layers": 2})
    with pytest.raises(models.ModelError, match="unknown --lora-kernel 'pallas'; choose one of qwix, fused"):
        models.apply_lora(built.model, built.spec, rank=4, lora_kernel="pallas")


def test_prepack_train_lora_kernel_fused_reaches_the_step(tmp_path, monkeypatch, capsys) -> None:
    """The option travels from the command line to the compiled step (--plan-memory compiles it)."""
    from testkit.shard_sets import TEST_TOKENIZER, build_shard_set
    from train import cli

    path = str(tmp_path / "L256")
    build_shard_set(path, num_rows=4, max_length=256, tokenizer={**TEST_TOKENIZER, "name": "tiny-test", "vocab_size": 4096})
    calls = []
    real = fused_lora.lora_linear
    monkeypatch.setattr(fused_lora, "lora_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    assert cli.main(["--model", "tiny-qwen3", "--lora-rank", "4", "--plan-memory", "--shards", path, "--batch-size", "2",
                     "--memory-budget-gib", "64", "--lora-kernel", "fused"]) == 0
    assert calls and len(calls) % 3 == 0, calls  # gate, up and down of every layer
    assert '"fits": true' in capsys.readouterr().out
