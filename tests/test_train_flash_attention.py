"""--attention flash (train/attention_kernels/flash_attention.py): the fused Pallas kernel against dense, in interpret mode.

Both forms of the kernel run here in Pallas interpret mode on the CPU: the GPU form (Triton's
layout, 1-D statistics; what a CPU runs) and the TPU form (scalar-prefetched block ranges,
Mosaic's vector shapes). Outputs and the gradients of q, k and v equal a dense softmax with the
project's block-causal mask in float32 (~1e-5), on packed and unpacked rows, global and windowed
(Gemma3's local layers), grouped query heads (4:1 as Gemma3 270M, 2:1 as Qwen3, 8:2, and 1:1); bfloat16
within its noise. The TPU form sums a KV head's query heads inside its dk/dv kernel: the grouped cases
fail if that sum goes wrong (zeroing the accumulators at every head fails three; tried once).
Skipping is checked, not assumed: values that only skipped blocks hold are NaN, and
every output and gradient the skip rule says cannot see them stays finite. Lowering for the real
backends (Triton for "cuda", Mosaic for "tpu") runs on this CPU too; compiling and timing them
needs the device (benchmarks/bench_attention.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loaders import block_causal_mask_jax
from train.attention_kernels import blocked_attention as ba
from train.attention_kernels import flash_attention as fa


def dense_reference(q, k, v, seg, window=None):
    b, length, n, h = q.shape
    kv = k.shape[2]
    s = jnp.einsum("btkgh,bskh->btkgs", q.reshape(b, length, kv, n // kv, h), k, precision="highest",
                   preferred_element_type=jnp.float32).reshape(b, length, n, length)
    mask = block_causal_mask_jax(seg)
    if window:
        ones = jnp.ones((length, length), bool)
        mask &= (jnp.triu(ones, -window + 1) & jnp.tril(ones, window - 1))[None]
    p = jax.nn.softmax(jnp.where(mask[:, :, None, :], s, ba.NEG_INF), -1).astype(v.dtype)
    return jnp.einsum("btkgs,bskh->btkgh", p.reshape(b, length, kv, n // kv, length), v,
                      precision="highest").reshape(b, length, n, h)


def rows(length: int) -> np.ndarray:
    """A packed row (three segments of uneven length, then padding) and an unpacked one (one segment)."""
    cut = [length // 6, length // 3, length // 5]
    packed = np.concatenate([np.full(c, i + 1) for i, c in enumerate(cut)] + [np.zeros(length - sum(cut))])
    return np.stack([packed, np.ones(length)]).astype(np.int32)


def qkv(length, heads, kv_heads, head_dim, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((2, length, heads, head_dim), (2, length, kv_heads, head_dim), (2, length, kv_heads, head_dim))
    return tuple(jnp.asarray(rng.normal(size=s), dtype) for s in shapes)


def flash(style, block, window):
    return lambda q, k, v, seg: fa.flash_attention(q, k, v, seg, window=window, block=block, style=style, interpret=True)


def grads(f, q, k, v, seg):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, seg).astype(jnp.float32))), argnums=(0, 1, 2)))(q, k, v)


@functools.partial(jax.jit, static_argnums=0)
def output_and_grads(f, q, k, v, seg):
    """f's output and the gradients `grads` takes, from one program (one compile, not one for the output
    and one for the gradients); f is static: the same f on the same shapes compiles once."""
    def loss(q, k, v):
        out = f(q, k, v, seg)
        return jnp.sum(jnp.sin(out.astype(jnp.float32))), out

    gradients, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, gradients


# (style, L, block, window, query heads, KV heads, head_dim): the GPU form at small blocks (what
# a CPU runs), the TPU form at its 128-lane blocks; Gemma3's 4:1 heads with and without a window,
# Qwen3's 2:1, and head_dims that pad (12 -> 16 on the GPU form; 160 -> 256 on the TPU form). The
# TPU form's dk/dv kernel steps through a KV head's query heads in its grid: 2, 4, 4 over 2 KV
# heads (8:2), and one (1:1).
CASES = [
    ("gpu", 64, 8, None, 4, 1, 16),
    ("gpu", 64, 16, 12, 4, 1, 16),
    ("gpu", 64, 8, 5, 4, 2, 12),
    ("tpu", 256, 128, None, 4, 2, 16),
    ("tpu", 256, 128, 100, 4, 1, 160),
    ("tpu", 256, 128, None, 8, 2, 16),
    ("tpu", 256, 128, 60, 2, 2, 128),
]


@pytest.mark.parametrize("style,length,block,window,heads,kv_heads,head_dim", CASES)
def test_float32_outputs_and_gradients_equal_dense(style, length, block, window, heads, kv_heads, head_dim) -> None:
    q, k, v = qkv(length, heads, kv_heads, head_dim)
    seg = jnp.asarray(rows(length))
    got, got_grads = output_and_grads(flash(style, block, window), q, k, v, seg)
    expected, want = output_and_grads(functools.partial(dense_reference, window=window), q, k, v, seg)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    for name, g, w in zip("qkv", got_grads, want):
        np.testing.assert_allclose(g, w, atol=2e-5 * float(jnp.max(jnp.abs(w))), err_msg=f"d{name}")


def pallas_calls(jaxpr):
    """(kernel name, equation) of each pallas_call in a jaxpr, nested jaxprs included."""
    from jax.extend.core import jaxprs_in_params

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn.params["name"], eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from pallas_calls(sub)


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (8, 2)])
def test_tpu_backward_writes_kv_gradients_once_and_reads_statistics_as_rows(heads, kv_heads) -> None:
    """The TPU dk/dv kernel sums a KV head's query heads in VMEM and writes dk, dv once, [B, K, L, H] in k's
    dtype: no float32 gradient per query head for the wrapper to sum (on a v5e, that partial write, sum and
    convert was memory traffic). Both backward kernels read the statistics as float32 [B, N, 8, L] rows, no
    [B, N, L, 128] lane broadcast."""
    q, k, v = qkv(256, heads, kv_heads, 16, jnp.bfloat16)
    seg = jnp.asarray(rows(256))
    jaxpr = jax.make_jaxpr(lambda q, k, v: grads(flash("tpu", 128, None), q, k, v, seg))(q, k, v).jaxpr
    calls = dict(pallas_calls(jaxpr))
    assert sorted(calls) == ["flash_dkv", "flash_dq", "flash_forward"]
    kv_grad = jax.core.ShapedArray((2, kv_heads, 256, 16), jnp.bfloat16)
    assert [x.aval for x in calls["flash_dkv"].outvars] == [kv_grad, kv_grad]
    for name in ("flash_dq", "flash_dkv"):
        statistics = [x.aval.shape for x in calls[name].invars if x.aval.dtype == jnp.float32]
        assert statistics == [(2, heads, 8, 256)] * 2, name


@pytest.mark.parametrize("style,length,block", [("gpu", 64, 16), ("tpu", 256, 128)])
def test_bfloat16_is_within_bfloat16s_noise_of_float32(style, length, block) -> None:
    """In bf16 the kernel is no further from the float32 result than dense computed in bf16 is."""
    q, k, v = qkv(length, 4, 1, 16, jnp.float32, seed=1)
    seg = jnp.asarray(rows(length))
    exact = dense_reference(q, k, v, seg, 12)
    bf = tuple(x.astype(jnp.bfloat16) for x in (q, k, v))
    ours, g_ours = output_and_grads(flash(style, block, 12), *bf, seg)
    theirs, g_theirs = output_and_grads(functools.partial(dense_reference, window=12), *bf, seg)
    ours, theirs = ours.astype(jnp.float32), theirs.astype(jnp.float32)
    assert ours.dtype == jnp.float32 and float(jnp.max(jnp.abs(ours - exact))) <= 2 * float(jnp.max(jnp.abs(theirs - exact)))
    for a, b in zip(g_ours, g_theirs):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 0.03 * np.linalg.norm(b)


@pytest.mark.parametrize("style,length,block", [("gpu", 64, 8), ("tpu", 512, 128)])
def test_skipped_blocks_are_never_read(style, length, block) -> None:
    """The first segment fills the first two blocks; its keys and values are NaN. A kernel that read
    those blocks for any later query block (even masked: 0 x NaN is NaN) would spread the NaN."""
    seg = np.full((2, length), 2, np.int32)
    seg[:, :2 * block] = 1
    q, k, v = qkv(length, 4, 1, 16)
    k, v = (x.at[:, :2 * block].set(jnp.nan) for x in (k, v))
    f = flash(style, block, None)
    out, (dq, dk, dv) = output_and_grads(f, q, k, v, jnp.asarray(seg))
    assert bool(jnp.isnan(out[:, :2 * block]).all()) and bool(jnp.isfinite(out[:, 2 * block:]).all())
    for g in (dq, dk, dv):
        assert bool(jnp.isfinite(g[:, 2 * block:]).all())
    # The control: one segment over the whole row needs every block, and the NaN reaches all of it (the same program).
    assert bool(jnp.isnan(output_and_grads(f, q, k, v, jnp.ones((2, length), jnp.int32))[0]).all())


def test_dropping_a_needed_key_block_fails_the_equality_check(monkeypatch) -> None:
    q, k, v = qkv(64, 4, 1, 16)
    seg = jnp.asarray(rows(64))
    real = ba.key_tile_ranges
    monkeypatch.setattr(fa, "key_tile_ranges", lambda s, t, w=None: (real(s, t, w)[1], real(s, t, w)[1]))
    err = float(jnp.max(jnp.abs(flash("gpu", 8, None)(q, k, v, seg) - dense_reference(q, k, v, seg))))
    assert err > 1e-2


def test_query_tile_ranges_invert_the_key_tile_ranges() -> None:
    """The dk/dv kernel's query blocks for key block j are exactly those whose key range holds j."""
    rng = np.random.default_rng(3)
    for window in (None, 20):
        lengths = rng.integers(1, 40, size=12)
        seg = np.repeat(np.arange(1, 13), lengths)[:128]
        seg = np.pad(seg, (0, 128 - len(seg)))[None].astype(np.int32)
        first = np.asarray(ba.key_tile_ranges(jnp.asarray(seg), 8, window)[0])[0]
        last = np.asarray(ba.query_tile_ranges(jnp.asarray(first[None])))[0]
        for j in range(16):
            assert [i for i in range(16) if first[i] <= j <= i] == list(range(j, last[j] + 1))


def test_bad_shapes_are_refused_with_one_line() -> None:
    q, k, v = qkv(64, 4, 1, 16)
    seg = jnp.asarray(rows(64))
    with pytest.raises(ValueError, match="a sequence length that is a multiple of its block 24, got 64"):
        fa.flash_attention(q, k, v, seg, block=24, interpret=True)
    with pytest.raises(ValueError, match="on a TPU needs blocks that are multiples of 128, got 32"):
        fa.flash_attention(q, k, v, seg, block=32, style="tpu", interpret=True)
    with pytest.raises(ValueError, match="unknown flash style 'cuda'"):
        fa.flash_attention(q, k, v, seg, style="cuda", interpret=True)


@pytest.mark.parametrize("style,platform,block,heads,kv_heads,head_dim,window", [
    ("gpu", "cuda", 64, 4, 1, 256, None),  # Gemma3 270M, global and local layers
    ("gpu", "cuda", 64, 4, 1, 256, 512),
    ("gpu", "cuda", 128, 16, 8, 128, None),  # Qwen3 0.6B
    ("tpu", "tpu", 128, 4, 1, 256, 512),
    ("tpu", "tpu", 128, 16, 8, 128, None),
])
def test_kernels_lower_for_their_backend(style, platform, block, heads, kv_heads, head_dim, window) -> None:
    """Forward and backward lower through Pallas's Triton (GPU) or Mosaic (TPU) lowering from this CPU:
    the kernel bodies use only what those lowerings accept. (Compiling them needs the device.)"""
    q = jax.ShapeDtypeStruct((2, 1024, heads, head_dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 1024, kv_heads, head_dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 1024), jnp.int32)

    def f(q, k, v, seg):
        return fa.flash_attention(q, k, v, seg, window=window, block=block, style=style, interpret=False)

    def step(q, k, v, seg):
        return jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, seg).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

    text = jax.jit(step).trace(q, k, k, seg).lower(lowering_platforms=(platform,)).as_text()
    target = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    assert text.count(target) >= 3  # forward, dq, dk/dv
