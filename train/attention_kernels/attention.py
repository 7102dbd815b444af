"""`--attention dense|blocked|flash|splash`: the models' attention from [B, L] segment ids.

dense   Tunix's own attention with the [B, L, L] block-causal mask (train/step/model_inputs.py).
blocked train/attention_kernels/blocked_attention.py: tiles, online softmax, skips tiles no segment spans (plain JAX).
flash   train/attention_kernels/flash_attention.py: one fused Pallas kernel, forward and backward, that visits
        only the key blocks a query block's segments reach (Triton on GPU, Mosaic on TPU,
        Pallas interpret mode elsewhere).
splash  JAX's splash kernel (jax.experimental.pallas.ops.tpu.splash_attention) with
        SegmentIds; on a backend other than TPU it runs in Pallas interpret mode (tests).

For blocked, flash and splash the model's `attention_mask` argument carries the [B, L] segment ids
instead of a mask: Gemma3, Qwen3 and Llama3 (Tunix 0.1.7) hand `attention_mask` unchanged to every
layer's Attention, so each layer's Attention is switched to a subclass of its family's (`install`,
`segment_class`) whose `block` reads the ids there. Its projections, norms and RoPE are the parent
module's own submodules and functions, applied by the family's module (`Family.attention_inputs`;
so qwix's LoRA on q/k/v/o applies; install after apply_lora); only the softmax(q k^T) v step is
replaced. Gemma3's local layers pass their sliding window.

Tunix's Qwen3 flash path (`use_flash_attention`) is not used: in 0.1.7 it calls
`make_splash_mha` without `interpret` (so it cannot run off TPU), needs a mesh with `fsdp`
and `tp` axes, and the positional model call used by the losses cannot pass `segment_ids`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

if TYPE_CHECKING:  # the kernels need only jax (benchmarks/bench_attention.py runs them where flax is absent)
    from flax import nnx

from train import families
from train.attention_kernels.blocked_attention import blocked_attention
from train.families import Family

DENSE, BLOCKED, FLASH, SPLASH = "dense", "blocked", "flash", "splash"
KINDS = (DENSE, BLOCKED, FLASH, SPLASH)
PROFILE_SCOPE = "segment_attention"
DEFAULT_TILE = 512  # splash's block
# blocked's tile, by measurement on a CPU (docs/benchmarks.md, "The blocked tile on a CPU"): over
# Gemma3 270M's layers 256 took 0.16x / 0.23x dense's time at L 4096 / 8192, 128 0.28x / 0.34x
# (its scan steps through every tile a query tile could reach), 512 0.22x / 0.24x.
BLOCKED_TILE = 256
SPLASH_LANES = 128  # the splash kernel's key blocks are multiples of the TPU lane count


def default_tile(kind: str, backend: str | None = None) -> int:
    """The tile (blocked) or block (flash, splash) a kind uses unless --attention-tile says."""
    if kind == FLASH:
        from train.attention_kernels.flash_attention import default_block

        return default_block(backend)
    return BLOCKED_TILE if kind == BLOCKED else DEFAULT_TILE


def default_kind(backend: str | None = None) -> str:
    """Per backend (docs/benchmarks.md, "The attention default per backend"): flash on TPU,
    dense on GPU, blocked on CPU and anything else.

    TPU v5e, `prepack train` on Gemma3 270M (docs/benchmarks.md, "On a TPU v5e"): flash's step
    equals splash's at (8, 2048) (0.198 s and 0.197 s) and is 0.92x it at (2, 8192) (0.200 s
    against 0.218 s); attention alone, flash takes 0.2x splash's time on global layers at L16384
    (splash steps through every block of its static causal mask; flash visits only the blocks a
    row's segments reach). So flash at every length on a TPU.

    GPU: measured on an H200 (jax 0.11.2), the attention alone fwd + bwd on typical packed rows,
    dense took about 0.1x blocked's time on global layers and 0.3x-0.8x on local ones (window 512)
    at L 4096-16384, 0.23x-0.35x over Gemma3 270M's 3 global + 15 local layers: blocked's tile
    loop runs there as many small sequential kernels, while XLA runs dense's [L, L] scores as a
    few large ones. The price is dense's L x L memory (6 GiB of temp per layer call at
    one row of L16384, against 0.2 GiB), which --plan-memory counts. CPU: blocked, 0.19x-0.32x
    dense's time at L 4096-8192.
    """
    backend = backend or jax.default_backend()
    if backend == "tpu":
        return FLASH
    return DENSE if backend == "gpu" else BLOCKED


def splash_attention(query: jax.Array, key: jax.Array, value: jax.Array, segment_ids: jax.Array, *,
                     window: int | None = None, block: int = DEFAULT_TILE) -> jax.Array:
    """[B, L, N, H] scaled queries, [B, L, K, H] keys/values -> [B, L, N, H], through splash."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    b, length, n, _ = query.shape
    block = min(block, length)
    if length % SPLASH_LANES or block % SPLASH_LANES:
        raise ValueError(f"--attention splash needs a sequence length and block that are multiples of {SPLASH_LANES}, "
                         f"got {length} and {block}; use --attention blocked")
    shape = (length, length)
    one = mask_lib.CausalMask(shape) if window is None else mask_lib.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    kernel = splash.make_splash_mha(mask_lib.MultiHeadMask([one] * n), block_sizes=sizes, head_shards=1,
                                    q_seq_shards=1, interpret=jax.default_backend() != "tpu")
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (query, key, value))
    seg = segment_ids.astype(jnp.int32)
    out = jax.vmap(lambda q1, k1, v1, s1: kernel(q1, k1, v1, segment_ids=splash.SegmentIds(q=s1, kv=s1)))(q, k, v, seg)
    return out.transpose(0, 2, 1, 3).astype(value.dtype)


def attend(kind: str, query: jax.Array, key: jax.Array, value: jax.Array, segment_ids: jax.Array,
           window: int | None, tile: int) -> jax.Array:
    with jax.named_scope(PROFILE_SCOPE):  # a profile's ops are attributed by it (benchmarks/profile_categories.py)
        return _attend(kind, query, key, value, segment_ids, window, tile)


def _attend(kind: str, query: jax.Array, key: jax.Array, value: jax.Array, segment_ids: jax.Array,
            window: int | None, tile: int) -> jax.Array:
    if kind == BLOCKED:
        return blocked_attention(query, key, value, segment_ids, tile=tile, window=window)
    if kind == FLASH:
        from train.attention_kernels.flash_attention import flash_attention

        return flash_attention(query, key, value, segment_ids, window=window, block=tile)
    if kind == SPLASH:
        return splash_attention(query, key, value, segment_ids, window=window, block=tile)
    raise ValueError(f"unknown attention {kind!r}; choose one of {KINDS}")


def _check(segment_ids: jax.Array, cache: Any) -> None:
    if cache is not None:
        raise ValueError("blocked/flash/splash attention is for training: a KV cache needs --attention dense")
    if segment_ids.ndim != 2:
        raise ValueError(f"blocked/flash/splash attention reads [B, L] segment ids as attention_mask, got shape {segment_ids.shape}")


# The classes segment_class has made: restore_tunix gives their modules Tunix's class back.
_SEGMENT_CLASSES: set[type] = set()


@functools.cache
def segment_class(family: Family) -> type:
    """The family's Tunix Attention whose attn_mask argument is [B, L] segment ids (training only):
    the family computes the query, key and value and projects the result as Tunix's block does
    (`Family.attention_inputs`, `attention_output`); the attention itself is the kind's kernel."""

    class SegmentIdsAttention(family.attention_class()):
        __doc__ = f"{family.name} Attention whose attn_mask argument is [B, L] segment ids (training only)."

        def block(self, x, segment_pos, cache, attn_mask, segment_ids=None):
            _check(attn_mask, cache)
            query, key, value, window = family.attention_inputs(self, x, segment_pos)
            encoded = attend(self.attention_kind, query, key, value, attn_mask, window, self.attention_tile)
            return None, family.attention_output(self, encoded)

    _SEGMENT_CLASSES.add(SegmentIdsAttention)
    return SegmentIdsAttention


def install(model: nnx.Module, kind: str, tile: int | None = None) -> nnx.Module:
    """Switches every layer's Attention to read segment ids (blocked, flash, splash); dense: unchanged.
    tile: the kind's tile or block (default_tile(kind) when None)."""
    if kind not in KINDS:
        raise ValueError(f"unknown attention {kind!r}; choose one of {KINDS}")
    if kind == DENSE:
        return model
    cls = segment_class(families.of(model))
    for layer in model.layers:
        attn = layer.attn
        if not isinstance(attn, cls.__mro__[1]):
            raise ValueError(f"unexpected attention module {type(attn).__name__}")
        attn.__class__ = cls  # same fields, LoRA and all; only block() differs
        attn.attention_kind = kind
        attn.attention_tile = tile or default_tile(kind)
    return model


def restore_tunix(model: nnx.Module) -> nnx.Module:
    """Gives every layer Tunix's own Attention back (undoes `install`): generation runs with a KV
    cache, which only Tunix's attention has (prepack generate, and --eval-generate during a run)."""
    for layer in model.layers:
        attn = layer.attn
        if type(attn) in _SEGMENT_CLASSES:
            attn.__class__ = type(attn).__mro__[1]
    return model
