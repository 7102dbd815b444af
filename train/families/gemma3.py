"""Gemma3 (Tunix `tunix.models.gemma3`): gemma3-270m, gemma3-1b, tiny-gemma3 (and `tiny`).

What is Gemma3's own: the embedding table is `num_embed` and is the output head (tied, with a
final logit soft-cap where the config has one); local (sliding-window) and global layers alternate
(`attn_type`), so the layer scan switches between two layer graphs; q and k/v are the fused
`q_einsum` + `kv_einsum` (or one `qkv_einsum`), with q/k norms and a query scalar.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from train.families.base import TINY_CONTEXT, Family, Head, ModelSpec
from train.families.hf_sites import (LAYER, MLP, LayoutError, Site, heads_in, heads_out, identity, lora_heads_in_a,
                                     lora_heads_out_b)

TUNIX = "tunix.models.gemma3.model"
LORA_PATHS = ".*q_einsum|.*kv_einsum|.*qkv_einsum|.*attn_vec_einsum|.*gate_proj|.*down_proj|.*up_proj"


def _g3() -> Any:
    from tunix.models.gemma3 import model as g3

    return g3


def real_config(factory: str):
    def make(vocab_size: int | None, dtype: Any) -> Any:
        return dataclasses.replace(getattr(_g3().ModelConfig, factory)(), param_dtype=dtype)

    return make


def tiny_config(vocab_size: int | None = None, dtype: Any = None, sliding_window_size: int = 8) -> Any:
    import jax.numpy as jnp

    return _g3().ModelConfig(
        num_layers=6,  # one full GEMMA3_ATTENTION_PATTERN cycle: 5 local layers, then a global one
        num_embed=vocab_size or 256,
        embed_dim=64,
        hidden_dim=128,
        num_heads=4,
        head_dim=16,
        num_kv_heads=1,  # like 270m/1b: separate q_einsum/kv_einsum
        sliding_window_size=sliding_window_size,
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
        param_dtype=jnp.float32 if dtype is None else dtype,
    )


def load_weights(folder: str, config: Any, dtype: Any, mesh: Any) -> Any:
    from tunix.models.gemma3 import params_safetensors

    return params_safetensors.create_model_from_safe_tensors(folder, config, mesh, dtype=dtype)


def vocab_size(config: Any) -> int:
    return int(config.num_embed)


def layer_kind(layer: Any) -> Any:
    """Local or global: the two graphs of Gemma3's decoder layers."""
    return layer.attn.attn_type


def window(attn: Any) -> int | None:
    return int(attn.sliding_window_size) if attn.attn_type == _g3().AttentionType.LOCAL_SLIDING else None


def attention_inputs(attn: Any, x: Any, segment_pos: Any) -> tuple[Any, Any, Any, int | None]:
    """Tunix 0.1.7's Gemma3 Attention.block up to the attention itself."""
    g3 = _g3()
    if attn.use_qkv_einsum:
        query, key, value = attn.qkv_einsum(x)
    else:
        query = attn.q_einsum(x)
        key, value = attn.kv_einsum(x)
    rope = dict(head_dim=attn.head_dim, base_frequency=attn.rope_base_frequency, scale_factor=attn.rope_scale_factor)
    query = g3.apply_rope(attn._query_norm(query), segment_pos, **rope) * attn.query_pre_attn_scalar
    key = g3.apply_rope(attn._key_norm(key), segment_pos, **rope)
    return query, key, value, window(attn)


def attention_output(attn: Any, encoded: Any) -> Any:
    return attn.attn_vec_einsum(encoded)


def output_head(model: Any) -> Head:
    """Tied: decode is jnp.dot(x, input_embedding.T), in the parameter dtype; a final logit soft-cap
    where the config has one (Tunix 0.1.7's has none)."""
    emb = model.embedder.input_embedding[...]
    return Head(emb, True, emb.dtype, getattr(model.config, "final_logit_softcap", None))


def embed(model: Any, tokens: Any) -> Any:
    return model._encode_and_get_inputs(tokens=tokens)


def logits(model: Any, x: Any) -> Any:
    return model.embedder.decode(x)


def query_scalar(config: Any) -> float:
    """Gemma3's query scaling as HF's query_pre_attn_scalar (queries are multiplied by its -1/2 power)."""
    g3 = _g3()
    norm = config.query_pre_attn_norm
    if norm == g3.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM:
        return config.head_dim
    if norm == g3.QueryPreAttentionNormalisation.BY_EMBED_DIM_DIV_NUM_HEADS:
        return config.embed_dim // config.num_heads
    return config.embed_dim // config.num_heads  # BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS


ARCHITECTURE = "Gemma3ForCausalLM"


def hf_config(config: Any, dtype: str) -> dict[str, Any]:
    """config.json through transformers' Gemma3TextConfig."""
    from transformers import Gemma3TextConfig

    g3 = _g3()
    pattern = getattr(g3, "GEMMA3_ATTENTION_PATTERN")
    layer_types = ["full_attention" if pattern[i % len(pattern)] == g3.AttentionType.GLOBAL else "sliding_attention"
                   for i in range(config.num_layers)]
    if config.local_scale_factor != 1.0 or config.global_scale_factor != 1.0:
        raise LayoutError("Gemma3 with RoPE scaling has no exported config here (the 270M and 1B have none)")
    return Gemma3TextConfig(
        vocab_size=config.num_embed, hidden_size=config.embed_dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, query_pre_attn_scalar=query_scalar(config),
        sliding_window=config.sliding_window_size, layer_types=layer_types, max_position_embeddings=32_768,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": float(config.global_base_frequency)},
                         "sliding_attention": {"rope_type": "default", "rope_theta": float(config.local_base_frequency)}},
        tie_word_embeddings=True, dtype=dtype, architectures=[ARCHITECTURE],
    ).to_dict()


# Gemma3's LoRA sits on the fused `kv_einsum`: one A for k and v, one B over both, so in PEFT's
# layout `k_proj` and `v_proj` share that A and each gets its half of B (exact: the keys' update is
# x A B_k, the values' x A B_v).
SITES = (
    Site("embedder.input_embedding", ("model.embed_tokens.weight",), identity),
    Site("final_norm.scale", ("model.norm.weight",), identity),
    Site("attn.q_einsum.w", (LAYER + "self_attn.q_proj.weight",), lambda w, d: [heads_in(w)],
         lambda a, b, d: lora_heads_out_b(a, b), "dr,rnh->ndh"),
    Site("attn.kv_einsum.w", (LAYER + "self_attn.k_proj.weight", LAYER + "self_attn.v_proj.weight"),
         lambda w, d: [heads_in(w[0]), heads_in(w[1])], lambda a, b, d: lora_heads_out_b(a, b, 2), "dr,rckh->ckdh"),
    Site("attn.qkv_einsum.w", tuple(LAYER + f"self_attn.{x}_proj.weight" for x in "qkv"),
         lambda w, d: [heads_in(w[j]) for j in range(3)], lambda a, b, d: lora_heads_out_b(a, b, 3), "dr,rcnh->cndh"),
    Site("attn.attn_vec_einsum.w", (LAYER + "self_attn.o_proj.weight",), lambda w, d: [heads_out(w)],
         lambda a, b, d: lora_heads_in_a(a, b), "nhr,rd->nhd"),
    Site("attn._query_norm.scale", (LAYER + "self_attn.q_norm.weight",), identity),
    Site("attn._key_norm.scale", (LAYER + "self_attn.k_norm.weight",), identity),
    Site("pre_attention_norm.scale", (LAYER + "input_layernorm.weight",), identity),
    Site("post_attention_norm.scale", (LAYER + "post_attention_layernorm.weight",), identity),
    Site("pre_ffw_norm.scale", (LAYER + "pre_feedforward_layernorm.weight",), identity),
    Site("post_ffw_norm.scale", (LAYER + "post_feedforward_layernorm.weight",), identity),
    *MLP,
)

FAMILY = Family(
    name="gemma3", tunix_module=TUNIX, model_class_name="Gemma3", lora_paths=LORA_PATHS, load_weights=load_weights,
    attention_inputs=attention_inputs, attention_output=attention_output, output_head=output_head, logits=logits,
    architecture=ARCHITECTURE, hf_config=hf_config, sites=SITES,
    # tests/test_train_trainer.py checks it against the embedded tokenizer's.
    vocab_hash="956ce6ae17ebe03ad27594308e5310f6363616b8b786f47156d524e8f3e0e2f3",
    vocab_size=vocab_size, layer_kind=layer_kind, window=window, embed=embed,
)

# google/gemma-3-270m, google/gemma-3-1b-pt: max_position_embeddings 32768.
SPECS = (
    ModelSpec("gemma3-270m", FAMILY, LORA_PATHS, False, real_config("gemma3_270m"), 32768, hf_base="google/gemma-3-270m"),
    ModelSpec("gemma3-1b", FAMILY, LORA_PATHS, False, real_config("gemma3_1b_pt"), 32768, hf_base="google/gemma-3-1b-pt"),
    ModelSpec("tiny-gemma3", FAMILY, LORA_PATHS, True, tiny_config, TINY_CONTEXT, "float32"),
    ModelSpec("tiny", FAMILY, LORA_PATHS, True, tiny_config, TINY_CONTEXT, "float32"),
)
