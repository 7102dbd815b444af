"""--loss-kernel fused: the loss head as one attention-shaped kernel (train/step/fused_head.py).

Off a TPU the kernel runs in Pallas interpret mode, so these tests check what it computes, not
its speed: on bfloat16 projections (tied [V, D] and untied [D, V], a vocabulary that is and one
that is not a multiple of the key block) the chunked loss's NLL and dL/dh through the fused
kernel equal the XLA path's within bfloat16's rounding; a wrong target row (the gather the kernel
relies on) fails that check; the option's refusals are one line each.
"""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from train.run_config.config import TrainConfig, TrainError
from train.step import chunked_loss, fused_head, memory_path

D, N = 128, 384


def _case(vocab: int, transposed: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = (vocab, D) if transposed else (D, vocab)
    matrix = jnp.asarray(rng.normal(size=shape) * 0.3, jnp.bfloat16)
    h = jnp.asarray(rng.normal(size=(2, N // 2, D)), jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, vocab, size=(2, N // 2)), jnp.int32)
    weights = jnp.asarray(rng.random((2, N // 2)) < 0.6, jnp.float32)
    return chunked_loss.Projection(matrix, transposed, jnp.bfloat16), h, targets, weights


def _loss_and_dh(projection, h, targets, weights, kernel):
    def loss(x):
        nll = chunked_loss.chunked_token_nll(x, projection, targets, 128, weights, kernel)
        return jnp.sum(nll * weights), nll

    (_, nll), dh = jax.value_and_grad(loss, has_aux=True)(h)
    return np.asarray(nll, np.float32), np.asarray(dh, np.float32)


@pytest.mark.parametrize("vocab,transposed", [(1024, True), (1000, True), (640, False)])
def test_fused_head_equals_the_xla_path_within_bfloat16(vocab: int, transposed: bool) -> None:
    case = _case(vocab, transposed)
    nll_x, dh_x = _loss_and_dh(*case, fused_head.XLA)
    nll_f, dh_f = _loss_and_dh(*case, fused_head.FUSED)
    weights = np.asarray(case[3])
    # The XLA path rounds its logits to bfloat16 before the float32 log-sum-exp; the kernel keeps
    # them in float32: NLLs of ~7 differ by bfloat16's rounding of logits (~2^-8 relative).
    assert np.max(np.abs((nll_f - nll_x) * weights)) < 0.06
    assert np.max(np.abs(dh_f - dh_x)) < 0.02 * np.max(np.abs(dh_x))
    assert np.all(dh_f[weights == 0] == 0)  # no target: no gradient, as through XLA


def test_a_wrong_target_row_fails_the_equality(monkeypatch: pytest.MonkeyPatch) -> None:
    case = _case(1024, True)
    nll_x, dh_x = _loss_and_dh(*case, fused_head.XLA)
    real_take = jnp.take
    monkeypatch.setattr(fused_head.jnp, "take", lambda a, idx, axis=None: real_take(a, (idx + 1) % a.shape[0], axis=axis))
    nll_f, dh_f = _loss_and_dh(*case, fused_head.FUSED)
    weights = np.asarray(case[3])
    assert np.max(np.abs((nll_f - nll_x) * weights)) > 0.5


def _ops_by_place(jaxpr) -> tuple[list[str], list[str]]:
    """The primitives of a traced step, at any depth: (outside every loop, inside a loop's body)."""
    outside, inside = [], []

    def walk(j, in_loop: bool) -> None:
        for eqn in j.eqns:
            (inside if in_loop else outside).append(eqn.primitive.name)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub, in_loop or eqn.primitive.name in ("while", "scan"))

    walk(jaxpr, False)
    return outside, inside


@pytest.mark.parametrize("vocab,transposed", [(1000, True), (640, False)])
def test_the_projection_is_prepared_once_outside_the_chunk_loop(vocab: int, transposed: bool) -> None:
    """A padded (1000 rows, no multiple of the 512-key block) or transposed projection: no pad and no
    transpose runs per chunk (each would copy the whole [V, D] projection; on a v5e that made Qwen3's
    --loss-chunk-tokens 512 step slower than 1024's)."""
    projection, h, targets, weights = _case(vocab, transposed)
    jaxpr = jax.make_jaxpr(lambda x: jax.grad(lambda y: jnp.sum(
        chunked_loss.chunked_token_nll(y, projection, targets, 128, weights, fused_head.FUSED) * weights))(x))(h).jaxpr
    outside, inside = _ops_by_place(jaxpr)
    assert "pallas_call" in inside  # the kernel runs per chunk
    assert "pad" not in inside and "transpose" not in inside
    assert ("pad" if transposed else "transpose") in outside  # made once, before the loop


@pytest.mark.parametrize("overrides,message", [
    (dict(loss_kernel="fused", dtype="float32"), "--loss-kernel fused cannot run with a float32 projection"),
    (dict(loss_kernel="fused", loss_chunk_tokens=0), "--loss-kernel fused computes the chunked loss"),
    (dict(loss_kernel="fused", loss_chunk_tokens=1000), "--loss-kernel fused cannot run with --loss-chunk-tokens 1000"),
    (dict(loss_kernel="pallas"), "unknown --loss-kernel 'pallas'"),
])
def test_loss_kernel_refusals(overrides: dict, message: str) -> None:
    cfg = TrainConfig(shards="s", model="tiny", lora_rank=2, batch_size=1, steps=1, **{"dtype": "bfloat16", **overrides})
    with pytest.raises(TrainError, match=message.replace("(", r"\(")):
        memory_path.check_loss_kernel(cfg)


def test_auto_is_fused_only_on_a_tpu_and_only_where_exact() -> None:
    assert fused_head.use_fused("auto", jnp.bfloat16, None, backend="tpu")
    assert not fused_head.use_fused("auto", jnp.float32, None, backend="tpu")
    assert not fused_head.use_fused("auto", jnp.bfloat16, 30.0, backend="tpu")
    assert not fused_head.use_fused("auto", jnp.bfloat16, None, backend="cpu")
    assert fused_head.use_fused("fused", jnp.bfloat16, None, backend="cpu")
