"""The pieces a family's Hugging Face sites are made of: one Tunix parameter, its HF names, and the conversions.

Hugging Face stores every projection as a torch Linear weight [out, in] with the heads flattened
head-major (`q_proj.weight` is [num_heads * head_dim, hidden]); Tunix keeps einsum kernels with
the heads as their own axes. The base-weight conversions here are the inverses of Tunix 0.1.7's
own safetensors loaders (transpose, reshape, and Gemma3's q/k/v fused into `q_einsum` +
`kv_einsum`); tests/test_peft_export.py writes a model through them and reads it back with those
loaders, bit for bit.

LoRA. qwix factors a LoRA'd kernel as A [contracting dims..., r] and B [r, remaining dims...]
(qwix 0.1.8 `_parse_einsum_str_for_lora`), delta = x A B * alpha / r. PEFT's factors are
`lora_A.weight` [r, in] and `lora_B.weight` [out, r], delta W = B A * lora_alpha / r, the same
scale. Each family module lists its sites (`Family.sites`); train/adapter_files/hf_layout.py
applies them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

LAYER = "model.layers.{i}."


@dataclasses.dataclass(frozen=True)
class Dims:
    """The widths the conversions need, from Tunix's ModelConfig."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Any) -> "Dims":
        return cls(int(config.embed_dim), int(config.num_heads), int(config.num_kv_heads), int(config.head_dim))


Array = np.ndarray
# A Tunix kernel -> its HF weights [out, in], one per HF name of the site.
ToHF = Callable[[Array, Dims], list[Array]]
# qwix (A, B) -> PEFT (lora_A [r, in], lora_B [out, r]) per HF name of the site.
LoraToHF = Callable[[Array, Array, Dims], list[tuple[Array, Array]]]


def heads_in(w: Array) -> Array:
    """[heads, hidden, head_dim] (Gemma3's N D H) -> [heads * head_dim, hidden]."""
    n, d, h = w.shape
    return w.transpose(0, 2, 1).reshape(n * h, d)


def dnh_in(w: Array) -> Array:
    """[hidden, heads, head_dim] (Qwen3's and Llama3's D N H) -> [heads * head_dim, hidden]."""
    d, n, h = w.shape
    return w.reshape(d, n * h).T


def heads_out(w: Array) -> Array:
    """[heads, head_dim, hidden] (the output projection's N H D) -> [hidden, heads * head_dim]."""
    n, h, d = w.shape
    return w.reshape(n * h, d).T


def lora_heads_out_b(a: Array, b: Array, parts: int | None = None) -> list[tuple[Array, Array]]:
    """A [hidden, r], B [r, (parts,) heads, head_dim] -> (A.T, B_part flattened head-major and transposed)."""
    r = a.shape[-1]
    if parts is None:
        return [(a.T, b.reshape(r, -1).T)]
    return [(a.T, b[:, p].reshape(r, -1).T) for p in range(parts)]


def lora_heads_in_a(a: Array, b: Array) -> list[tuple[Array, Array]]:
    """A [heads, head_dim, r], B [r, hidden] (the output projection) -> ([r, heads * head_dim], [hidden, r])."""
    r = a.shape[-1]
    return [(a.reshape(-1, r).T, b.T)]


def lora_linear(a: Array, b: Array) -> list[tuple[Array, Array]]:
    """A kernel [in, out]: A [in, r], B [r, out] -> ([r, in], [out, r])."""
    return [(a.T, b.T)]


@dataclasses.dataclass(frozen=True)
class Site:
    """One Tunix parameter (path below `layers.i.`, or top-level) and its HF weights."""

    tunix: str
    hf: tuple[str, ...]
    to_hf: ToHF
    lora_to_hf: LoraToHF | None = None
    # Tunix's kernel layout as an einsum over qwix's factors: ΔW = einsum(spec, A, B) (the rank is 'r').
    delta: str | None = None

    @property
    def per_layer(self) -> bool:
        return self.hf[0].startswith(LAYER)


def identity(w: Array, dims: Dims) -> list[Array]:
    return [w]


def transpose(w: Array, dims: Dims) -> list[Array]:
    return [w.T]


MLP = (
    Site("mlp.gate_proj.kernel", (LAYER + "mlp.gate_proj.weight",), transpose, lambda a, b, d: lora_linear(a, b), "ir,ro->io"),
    Site("mlp.up_proj.kernel", (LAYER + "mlp.up_proj.weight",), transpose, lambda a, b, d: lora_linear(a, b), "ir,ro->io"),
    Site("mlp.down_proj.kernel", (LAYER + "mlp.down_proj.weight",), transpose, lambda a, b, d: lora_linear(a, b), "ir,ro->io"),
)


def dnh_attention(prefix: str = "attn.") -> tuple[Site, ...]:
    """q/k/v kernels [hidden, heads, head_dim] and o [heads, head_dim, hidden], one HF Linear each (Qwen3, Llama3)."""
    qkv = tuple(Site(f"{prefix}{x}_proj.w", (LAYER + f"self_attn.{x}_proj.weight",), lambda w, d: [dnh_in(w)],
                     lambda a, b, d: lora_heads_out_b(a, b), "dr,rnh->dnh") for x in "qkv")
    out = Site(f"{prefix}o_proj.w", (LAYER + "self_attn.o_proj.weight",), lambda w, d: [heads_out(w)],
               lambda a, b, d: lora_heads_in_a(a, b), "nhr,rd->nhd")
    return (*qkv, out)



def llama_layout(attention_norms: tuple[Site, ...] = ()) -> tuple[Site, ...]:
    """The sites of Hugging Face's Llama layout (Qwen3 adds its q/k norms as `attention_norms`): the
    embedding, the final norm, an lm_head, one Linear per projection, two norms a layer, the MLP."""
    return (
        Site("embedder.input_embedding", ("model.embed_tokens.weight",), identity),
        Site("final_norm.w", ("model.norm.weight",), identity),
        Site("lm_head.w", ("lm_head.weight",), transpose),
        *dnh_attention(),
        *attention_norms,
        Site("input_layernorm.w", (LAYER + "input_layernorm.weight",), identity),
        Site("post_attention_layernorm.w", (LAYER + "post_attention_layernorm.weight",), identity),
        *MLP,
    )

class LayoutError(ValueError):
    """A parameter this layout does not know (another architecture, or a Tunix that changed)."""
