"""Tunix's Gemma3 and Qwen3 weights and qwix LoRA factors in Hugging Face's layout (Gemma3ForCausalLM, Qwen3ForCausalLM).

Hugging Face stores every projection as a torch Linear weight [out, in] with the heads flattened
head-major (`q_proj.weight` is [num_heads * head_dim, hidden]); Tunix keeps einsum kernels with
the heads as their own axes. The base-weight conversions here are the inverses of Tunix 0.1.7's
own safetensors loaders (gemma3/params_safetensors.py, qwen3/params.py: transpose, reshape, and
Gemma3's q/k/v fused into `q_einsum` + `kv_einsum`); tests/test_peft_export.py writes a model
through them and reads it back with those loaders, bit for bit.

LoRA. qwix factors a LoRA'd kernel as A [contracting dims..., r] and B [r, remaining dims...]
(qwix 0.1.8 `_parse_einsum_str_for_lora`), delta = x A B * alpha / r. PEFT's factors are
`lora_A.weight` [r, in] and `lora_B.weight` [out, r], delta W = B A * lora_alpha / r, the same
scale. Gemma3's LoRA sits on the fused `kv_einsum`: one A for k and v, one B over both, so in
PEFT's layout `k_proj` and `v_proj` share that A and each gets its half of B (exact: the keys'
update is x A B_k, the values' x A B_v).

`tunix_delta` is the merged update in Tunix's own layout (an einsum of A and B over the rank,
straight from qwix's factorization), independent of the PEFT conversion, so the two can be
checked against each other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

GEMMA3, QWEN3 = "gemma3", "qwen3"
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


def _heads_in(w: Array) -> Array:
    """[heads, hidden, head_dim] (Gemma3's N D H) -> [heads * head_dim, hidden]."""
    n, d, h = w.shape
    return w.transpose(0, 2, 1).reshape(n * h, d)


def _dnh_in(w: Array) -> Array:
    """[hidden, heads, head_dim] (Qwen3's D N H) -> [heads * head_dim, hidden]."""
    d, n, h = w.shape
    return w.reshape(d, n * h).T


def _heads_out(w: Array) -> Array:
    """[heads, head_dim, hidden] (the output projection's N H D) -> [hidden, heads * head_dim]."""
    n, h, d = w.shape
    return w.reshape(n * h, d).T


def _lora_heads_out_b(a: Array, b: Array, parts: int | None = None) -> list[tuple[Array, Array]]:
    """A [hidden, r], B [r, (parts,) heads, head_dim] -> (A.T, B_part flattened head-major and transposed)."""
    r = a.shape[-1]
    if parts is None:
        return [(a.T, b.reshape(r, -1).T)]
    return [(a.T, b[:, p].reshape(r, -1).T) for p in range(parts)]


def _lora_heads_in_a(a: Array, b: Array) -> list[tuple[Array, Array]]:
    """A [heads, head_dim, r], B [r, hidden] (the output projection) -> ([r, heads * head_dim], [hidden, r])."""
    r = a.shape[-1]
    return [(a.reshape(-1, r).T, b.T)]


def _lora_linear(a: Array, b: Array) -> list[tuple[Array, Array]]:
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


def _identity(w: Array, dims: Dims) -> list[Array]:
    return [w]


def _transpose(w: Array, dims: Dims) -> list[Array]:
    return [w.T]


MLP = (
    Site("mlp.gate_proj.kernel", (LAYER + "mlp.gate_proj.weight",), _transpose, lambda a, b, d: _lora_linear(a, b), "ir,ro->io"),
    Site("mlp.up_proj.kernel", (LAYER + "mlp.up_proj.weight",), _transpose, lambda a, b, d: _lora_linear(a, b), "ir,ro->io"),
    Site("mlp.down_proj.kernel", (LAYER + "mlp.down_proj.weight",), _transpose, lambda a, b, d: _lora_linear(a, b), "ir,ro->io"),
)

SITES: dict[str, tuple[Site, ...]] = {
    GEMMA3: (
        Site("embedder.input_embedding", ("model.embed_tokens.weight",), _identity),
        Site("final_norm.scale", ("model.norm.weight",), _identity),
        Site("attn.q_einsum.w", (LAYER + "self_attn.q_proj.weight",), lambda w, d: [_heads_in(w)],
             lambda a, b, d: _lora_heads_out_b(a, b), "dr,rnh->ndh"),
        Site("attn.kv_einsum.w", (LAYER + "self_attn.k_proj.weight", LAYER + "self_attn.v_proj.weight"),
             lambda w, d: [_heads_in(w[0]), _heads_in(w[1])], lambda a, b, d: _lora_heads_out_b(a, b, 2), "dr,rckh->ckdh"),
        Site("attn.qkv_einsum.w", tuple(LAYER + f"self_attn.{x}_proj.weight" for x in "qkv"),
             lambda w, d: [_heads_in(w[j]) for j in range(3)], lambda a, b, d: _lora_heads_out_b(a, b, 3), "dr,rcnh->cndh"),
        Site("attn.attn_vec_einsum.w", (LAYER + "self_attn.o_proj.weight",), lambda w, d: [_heads_out(w)],
             lambda a, b, d: _lora_heads_in_a(a, b), "nhr,rd->nhd"),
        Site("attn._query_norm.scale", (LAYER + "self_attn.q_norm.weight",), _identity),
        Site("attn._key_norm.scale", (LAYER + "self_attn.k_norm.weight",), _identity),
        Site("pre_attention_norm.scale", (LAYER + "input_layernorm.weight",), _identity),
        Site("post_attention_norm.scale", (LAYER + "post_attention_layernorm.weight",), _identity),
        Site("pre_ffw_norm.scale", (LAYER + "pre_feedforward_layernorm.weight",), _identity),
        Site("post_ffw_norm.scale", (LAYER + "post_feedforward_layernorm.weight",), _identity),
        *MLP,
    ),
    QWEN3: (
        Site("embedder.input_embedding", ("model.embed_tokens.weight",), _identity),
        Site("final_norm.w", ("model.norm.weight",), _identity),
        Site("lm_head.w", ("lm_head.weight",), _transpose),
        Site("attn.q_proj.w", (LAYER + "self_attn.q_proj.weight",), lambda w, d: [_dnh_in(w)],
             lambda a, b, d: _lora_heads_out_b(a, b), "dr,rnh->dnh"),
        Site("attn.k_proj.w", (LAYER + "self_attn.k_proj.weight",), lambda w, d: [_dnh_in(w)],
             lambda a, b, d: _lora_heads_out_b(a, b), "dr,rnh->dnh"),
        Site("attn.v_proj.w", (LAYER + "self_attn.v_proj.weight",), lambda w, d: [_dnh_in(w)],
             lambda a, b, d: _lora_heads_out_b(a, b), "dr,rnh->dnh"),
        Site("attn.o_proj.w", (LAYER + "self_attn.o_proj.weight",), lambda w, d: [_heads_out(w)],
             lambda a, b, d: _lora_heads_in_a(a, b), "nhr,rd->nhd"),
        Site("attn.q_norm.w", (LAYER + "self_attn.q_norm.weight",), _identity),
        Site("attn.k_norm.w", (LAYER + "self_attn.k_norm.weight",), _identity),
        Site("input_layernorm.w", (LAYER + "input_layernorm.weight",), _identity),
        Site("post_attention_layernorm.w", (LAYER + "post_attention_layernorm.weight",), _identity),
        *MLP,
    ),
}
ARCHITECTURES = {GEMMA3: "Gemma3ForCausalLM", QWEN3: "Qwen3ForCausalLM"}


class LayoutError(ValueError):
    """A parameter this layout does not know (another architecture, or a Tunix that changed)."""


def split_path(path: tuple[Any, ...]) -> tuple[int | None, str]:
    """("layers", 3, "attn", "q_einsum", "w") -> (3, "attn.q_einsum.w"); top-level params -> (None, path)."""
    if len(path) > 2 and path[0] == "layers":
        return int(path[1]), ".".join(map(str, path[2:]))
    return None, ".".join(map(str, path))


def site(family: str, name: str) -> Site:
    for s in SITES[family]:
        if s.tunix == name:
            return s
    raise LayoutError(f"{family}: no Hugging Face name for Tunix parameter {name!r}")


def hf_names(s: Site, layer: int | None) -> list[str]:
    return [n.format(i=layer) for n in s.hf]


def base_to_hf(family: str, params: Mapping[tuple[Any, ...], Array], dims: Dims) -> dict[str, Array]:
    """{Tunix flat path: value} of the base weights (no LoRA factors) -> {HF name: [out, in] value}."""
    out: dict[str, Array] = {}
    for path, value in params.items():
        layer, name = split_path(path)
        s = site(family, name)
        for hf_name, w in zip(hf_names(s, layer), s.to_hf(np.asarray(value), dims)):
            out[hf_name] = np.ascontiguousarray(w)
    return out


def lora_to_hf(family: str, factors: Mapping[tuple[int | None, str], tuple[Array, Array]], dims: Dims) -> dict[str, tuple[Array, Array]]:
    """{(layer, Tunix kernel name): (A, B)} -> {HF module name (no `.weight`): (lora_A [r, in], lora_B [out, r])}."""
    out: dict[str, tuple[Array, Array]] = {}
    for (layer, name), (a, b) in factors.items():
        s = site(family, name)
        if s.lora_to_hf is None:
            raise LayoutError(f"{family}: Tunix parameter {name!r} has no LoRA conversion")
        for hf_name, (la, lb) in zip(hf_names(s, layer), s.lora_to_hf(np.asarray(a), np.asarray(b), dims)):
            out[hf_name.removesuffix(".weight")] = (np.ascontiguousarray(la), np.ascontiguousarray(lb))
    return out


def tunix_delta(family: str, name: str, a: Array, b: Array) -> Array:
    """The LoRA update of a Tunix kernel in its own layout (before alpha / r): qwix's A and B contracted over the rank."""
    s = site(family, name)
    if s.delta is None:
        raise LayoutError(f"{family}: Tunix parameter {name!r} takes no LoRA")
    return np.einsum(s.delta, np.asarray(a, np.float32), np.asarray(b, np.float32))


def hf_config(family: str, config: Any, dtype: str) -> dict[str, Any]:
    """config.json of the Hugging Face architecture for a Tunix ModelConfig (through transformers' own config class)."""
    if family == GEMMA3:
        from transformers import Gemma3TextConfig
        from tunix.models.gemma3 import model as g3

        pattern = getattr(g3, "GEMMA3_ATTENTION_PATTERN")
        layer_types = ["full_attention" if pattern[i % len(pattern)] == g3.AttentionType.GLOBAL else "sliding_attention"
                       for i in range(config.num_layers)]
        if config.local_scale_factor != 1.0 or config.global_scale_factor != 1.0:
            raise LayoutError("Gemma3 with RoPE scaling has no exported config here (the 270M and 1B have none)")
        hf = Gemma3TextConfig(
            vocab_size=config.num_embed, hidden_size=config.embed_dim, intermediate_size=config.hidden_dim,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, query_pre_attn_scalar=query_scalar(config),
            sliding_window=config.sliding_window_size, layer_types=layer_types, max_position_embeddings=32_768,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": float(config.global_base_frequency)},
                             "sliding_attention": {"rope_type": "default", "rope_theta": float(config.local_base_frequency)}},
            tie_word_embeddings=True, dtype=dtype, architectures=[ARCHITECTURES[GEMMA3]],
        )
    else:
        from transformers import Qwen3Config

        hf = Qwen3Config(
            vocab_size=config.vocab_size, hidden_size=config.embed_dim, intermediate_size=config.hidden_dim,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
            tie_word_embeddings=bool(config.use_tied_embedding), max_position_embeddings=40_960,
            dtype=dtype, architectures=[ARCHITECTURES[QWEN3]],
        )
    return hf.to_dict()


def query_scalar(config: Any) -> float:
    """Gemma3's query scaling as HF's query_pre_attn_scalar (queries are multiplied by its -1/2 power)."""
    from tunix.models.gemma3 import model as g3

    norm = config.query_pre_attn_norm
    if norm == g3.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM:
        return config.head_dim
    if norm == g3.QueryPreAttentionNormalisation.BY_EMBED_DIM_DIV_NUM_HEADS:
        return config.embed_dim // config.num_heads
    return config.embed_dim // config.num_heads  # BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS
