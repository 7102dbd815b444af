"""A Gemma3 270M-shaped LoRA train step in plain JAX, for timing attention kinds inside a whole step on a device.

Why not `prepack train`'s own step: the device machine that runs benchmarks/bench_attention.py
has jax and numpy and nothing else (no flax, Tunix, qwix or optax to install: it reaches no
network), so the step is written here from Tunix 0.1.7's Gemma3 (tunix/models/gemma3/model.py)
with Gemma3 270M's shapes: 18 layers in the pattern 5 sliding-window (512) + 1 global, D 640,
4 query heads and 1 KV head of 256, MLP 2048 (GeGLU), vocabulary 262,144 with the tied
embedding as output projection; RMSNorms before and after attention and MLP and on q and k;
RoPE (base 10k local, 1M global); queries scaled by head_dim^-0.5. LoRA rank 16 on q, kv, o,
gate, up and down (float32 adapters, cast to bfloat16 as train/step/precision.py does); the base is
bfloat16 and frozen. The loss is train/step/chunked_loss.py's: 1,024-token checkpointed chunks of the
output projection, float32 log-sum-exp. --remat layer checkpoints each layer (as
train/step/layer_scan.py). The attention step is the variable: `dense` is Tunix's (bf16 logits,
`where(mask, logits, K_MASK)` with the block-causal mask and the sliding band, softmax, cast),
`flash` is train/attention_kernels/flash_attention.py, `blocked` train/attention_kernels/blocked_attention.py, `splash` the splash
kernel (TPU). One step = value and gradient of the loss in the LoRA adapters, and an SGD update.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int = 18
    local_per_global: int = 5  # Gemma3: 5 local layers, then 1 global
    embed_dim: int = 640
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 256
    hidden_dim: int = 2048
    vocab: int = 262144
    window: int = 512
    rank: int = 16
    loss_chunk: int = 1024

    def window_of(self, layer: int) -> int | None:
        return None if layer % (self.local_per_global + 1) == self.local_per_global else self.window


GEMMA3_270M = Shape()
# A small one with the same structure, for a run of the script on a CPU (interpret mode).
SMOKE = Shape(layers=6, embed_dim=64, heads=4, kv_heads=1, head_dim=16, hidden_dim=128, vocab=512, window=32, rank=4,
              loss_chunk=256)

PROJECTIONS = ("q", "kv", "o", "gate", "up", "down")


def _shapes(s: Shape) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each projection's (input dims, output dims) per token."""
    return {"q": ((s.embed_dim,), (s.heads, s.head_dim)), "kv": ((s.embed_dim,), (2, s.kv_heads, s.head_dim)),
            "o": ((s.heads, s.head_dim), (s.embed_dim,)), "gate": ((s.embed_dim,), (s.hidden_dim,)),
            "up": ((s.embed_dim,), (s.hidden_dim,)), "down": ((s.hidden_dim,), (s.embed_dim,))}


def init(s: Shape, seed: int = 0):
    """(base bf16 weights, LoRA float32 adapters): random, per layer stacked on a leading axis."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)

    def draw(shape, scale, dtype):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale, dtype)

    base = {"embed": draw((s.vocab, s.embed_dim), 0.02, jnp.bfloat16), "final_norm": jnp.zeros((s.embed_dim,), jnp.bfloat16)}
    lora = {}
    for name, (i, o) in _shapes(s).items():
        base[name] = draw((s.layers, *i, *o), 0.02, jnp.bfloat16)
        lora[name + "_a"] = draw((s.layers, math.prod(i), s.rank), 0.02, jnp.float32)
        lora[name + "_b"] = draw((s.layers, s.rank, math.prod(o)), 0.02, jnp.float32)  # nonzero: gradients flow through A too
    for norm, dim in (("pre_attn", s.embed_dim), ("post_attn", s.embed_dim), ("pre_ffw", s.embed_dim),
                      ("post_ffw", s.embed_dim), ("q_norm", s.head_dim), ("k_norm", s.head_dim)):
        base[norm] = jnp.zeros((s.layers, dim), jnp.bfloat16)
    return base, lora


def _rms(x, scale):
    import jax.numpy as jnp

    var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x * (1.0 + scale.astype(jnp.float32)) * jnp.reciprocal(jnp.sqrt(var + 1e-6))).astype(x.dtype)


def _rope(x, positions, base):
    import jax.numpy as jnp

    half = x.shape[-1] // 2
    freq = base ** (2 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
    angle = positions[..., None].astype(jnp.float32) / freq  # [B, L, half]
    sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def _project(x, w, a, b, s: Shape, name: str):
    """x [B, L, *in] -> [B, L, *out]: the frozen bf16 weight plus the bf16-cast LoRA update (alpha = 2 r)."""
    import jax.numpy as jnp

    i, o = _shapes(s)[name]
    flat = x.reshape(*x.shape[:2], math.prod(i))
    y = flat @ w.reshape(math.prod(i), math.prod(o))
    y = y + ((flat @ a.astype(x.dtype)) @ b.astype(x.dtype)) * jnp.asarray(2.0, x.dtype)
    return y.reshape(*x.shape[:2], *o)


def _layer(x, p, l, seg, positions, window, s: Shape, attend):
    import jax
    import jax.numpy as jnp

    h = _rms(x, p["pre_attn"])
    q = _project(h, p["q"], l["q_a"], l["q_b"], s, "q")
    kv = _project(h, p["kv"], l["kv_a"], l["kv_b"], s, "kv")
    k, v = kv[:, :, 0], kv[:, :, 1]
    base = 10_000.0 if window else 1_000_000.0
    q = _rope(_rms(q, p["q_norm"]), positions, base) * jnp.asarray(s.head_dim ** -0.5, q.dtype)
    k = _rope(_rms(k, p["k_norm"]), positions, base)
    out = attend(q, k, v, seg, window)
    x = x + _rms(_project(out, p["o"], l["o_a"], l["o_b"], s, "o"), p["post_attn"])
    h = _rms(x, p["pre_ffw"])
    gate = jax.nn.gelu(_project(h, p["gate"], l["gate_a"], l["gate_b"], s, "gate"))
    up = _project(h, p["up"], l["up_a"], l["up_b"], s, "up")
    return x + _rms(_project(gate * up, p["down"], l["down_a"], l["down_b"], s, "down"), p["post_ffw"])


def block_causal_mask(seg, window: int | None = None):
    """[B, L, L] bool: loaders/mask.py's block-causal mask (pad queries see themselves), and on a
    local layer Tunix's sliding band triu(-w + 1) * tril(w - 1); jax.numpy only."""
    import jax.numpy as jnp

    length = seg.shape[-1]
    q, k = seg[:, :, None], seg[:, None, :]
    causal = jnp.tril(jnp.ones((length, length), bool))
    eye = jnp.eye(length, dtype=bool)
    mask = ((q == k) & causal & (q != 0)) | (eye & (q == 0))
    if window is not None:
        ones = jnp.ones((length, length), bool)
        mask &= (jnp.triu(ones, -window + 1) & jnp.tril(ones, window - 1))[None]
    return mask


def dense_attention(q, k, v, seg, mask):
    """Tunix 0.1.7 Gemma3 Attention.block's softmax(q k^T) v with GQA, for [B, L, N, H] scaled q."""
    import jax
    import jax.numpy as jnp

    from train.attention_kernels.blocked_attention import NEG_INF  # Tunix's K_MASK

    b, length, n, h = q.shape
    kv = k.shape[2]
    s = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, length, kv, n // kv, h), k).reshape(b, length, n, length)
    s = jnp.where(mask[:, :, None, :], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("BTKGS,BSKH->BTKGH", p.reshape(b, length, kv, n // kv, length), v).reshape(b, length, n, h)


def attention_fn(kind: str, tile: int):
    """(q, k, v, segment_ids, window) -> out for one attention kind."""
    if kind == "dense":
        return lambda q, k, v, seg, window: dense_attention(q, k, v, seg, block_causal_mask(seg, window))
    if kind == "flash":
        from train.attention_kernels.flash_attention import flash_attention

        return lambda q, k, v, seg, window: flash_attention(q, k, v, seg, window=window, block=tile)
    if kind == "blocked":
        from train.attention_kernels.blocked_attention import blocked_attention

        return lambda q, k, v, seg, window: blocked_attention(q, k, v, seg, tile=tile, window=window)
    if kind == "splash":
        from train.attention_kernels.attention import splash_attention

        return lambda q, k, v, seg, window: splash_attention(q, k, v, seg, window=window, block=tile)
    raise ValueError(f"unknown attention {kind!r}")


def loss_fn(lora, base, batch, s: Shape, attend, remat: bool):
    import jax
    import jax.numpy as jnp

    tokens, seg, positions, loss_mask = batch["input_ids"], batch["segment_ids"], batch["positions"], batch["loss_mask"]
    x = base["embed"][tokens] * jnp.asarray(math.sqrt(s.embed_dim), jnp.bfloat16)
    per_layer = [k for k in base if k not in ("embed", "final_norm")]
    for layer in range(s.layers):  # unrolled, as Tunix's Python loop (window and RoPE base are static per layer)
        p = {k: base[k][layer] for k in per_layer}
        l = {k: v[layer].astype(jnp.float32) for k, v in lora.items()}
        step = functools.partial(_layer, window=s.window_of(layer), s=s, attend=attend)
        step = jax.checkpoint(step) if remat else step
        x = step(x, p, l, seg, positions)
    h = _rms(x, base["final_norm"])
    b, length, d = h.shape
    n = b * length
    chunks = -(-n // s.loss_chunk)
    pad = chunks * s.loss_chunk - n
    targets = jnp.pad(jnp.roll(tokens, -1, axis=1).reshape(n), (0, pad)).reshape(chunks, s.loss_chunk)
    weights = jnp.pad((jnp.roll(loss_mask, -1, axis=1).at[:, -1].set(0)).reshape(n), (0, pad)).reshape(chunks, s.loss_chunk)
    flat = jnp.pad(h.reshape(n, d), ((0, pad), (0, 0))).reshape(chunks, s.loss_chunk, d)

    @jax.checkpoint
    def chunk_nll(args):
        hc, tc = args
        logits = (hc @ base["embed"].T).astype(jnp.float32)
        return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]

    nll = jax.lax.map(chunk_nll, (flat, targets))
    return jnp.sum(nll * weights) / (jnp.sum(weights) + 1e-8)


def make_step(s: Shape, kind: str, tile: int, remat: bool, learning_rate: float = 1e-4):
    """jit-compiled (lora, base, batch) -> (loss, new lora), the adapters donated."""
    import jax

    attend = attention_fn(kind, tile)

    def step(lora, base, batch):
        loss, grads = jax.value_and_grad(loss_fn)(lora, base, batch, s, attend, remat)
        return loss, jax.tree.map(lambda p, g: p - learning_rate * g, lora, grads)

    return jax.jit(step, donate_argnums=(0,))


def batch_from_rows(rows: np.ndarray, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tokens on these segment ids; per-segment positions; targets on every token but a segment's first."""
    rows = np.asarray(rows, np.int32)
    rng = np.random.default_rng(seed)
    idx = np.arange(rows.shape[1])
    starts = np.concatenate([np.ones((len(rows), 1), bool), rows[:, 1:] != rows[:, :-1]], axis=1)
    positions = idx[None] - np.maximum.accumulate(np.where(starts, idx[None], 0), axis=1)
    return {"input_ids": rng.integers(3, vocab, rows.shape).astype(np.int32), "segment_ids": rows,
            "positions": positions.astype(np.int32), "loss_mask": ((rows > 0) & ~starts).astype(np.int32)}
