"""Qwen3 (Tunix `tunix.models.qwen3`): qwen3-0.6b, tiny-qwen3.

What is Qwen3's own: q and k RMS-normed before RoPE; the output head is the embedding
(`use_tied_embedding`, in the embedder's compute dtype) or an `lm_head`; logits cast to float32;
the forward takes `segment_ids`, which the layers are given too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from train.families.base import TINY_CONTEXT, Family, Head, ModelSpec
from train.families.hf_sites import LAYER, Site, identity, llama_layout

TUNIX = "tunix.models.qwen3.model"
LORA_PATHS = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj|.*up_proj"


def _q3() -> Any:
    from tunix.models.qwen3 import model as q3

    return q3


def qwen3_0p6b(vocab_size: int | None, dtype: Any) -> Any:
    return dataclasses.replace(_q3().ModelConfig.qwen3_0p6b(), dtype=dtype, param_dtype=dtype)


def tiny_config(vocab_size: int | None = None, dtype: Any = None) -> Any:
    import jax.numpy as jnp

    dtype = jnp.float32 if dtype is None else dtype
    return dataclasses.replace(
        _q3().ModelConfig.qwen3_0p6b(),
        num_layers=2,
        vocab_size=vocab_size or 256,
        embed_dim=64,
        hidden_dim=128,
        num_heads=4,
        head_dim=16,
        num_kv_heads=2,
        dtype=dtype,
        param_dtype=dtype,
    )


def load_weights(folder: str, config: Any, dtype: Any, mesh: Any) -> Any:
    from tunix.models.qwen3 import params

    return params.create_model_from_safe_tensors(folder, config, mesh, dtype=dtype)


def attention_inputs(attn: Any, x: Any, segment_pos: Any) -> tuple[Any, Any, Any, int | None]:
    """Tunix 0.1.7's Qwen3 Attention.block up to the attention itself."""
    q3 = _q3()
    query = q3.apply_rope(attn.q_norm(attn.q_proj(x)), segment_pos, head_dim=attn.head_dim)
    key = q3.apply_rope(attn.k_norm(attn.k_proj(x)), segment_pos, head_dim=attn.head_dim)
    return query * attn.scale, key, attn.v_proj(x), None


def attention_output(attn: Any, encoded: Any) -> Any:
    return attn.o_proj(encoded)


def lm_head(model: Any, family: str) -> Head:
    """An untied `lm_head` (`BTD,DV->BTV`: [D, V]), in the config's compute dtype."""
    head = model.lm_head
    if getattr(head, "einsum_str", "BTD,DV->BTV") != "BTD,DV->BTV":
        raise ValueError(f"unexpected {family} lm_head einsum {head.einsum_str!r}; the chunked loss needs BTD,DV->BTV")
    return Head(head.w[...], False, model.config.dtype)


def output_head(model: Any) -> Head:
    if model.config.use_tied_embedding:  # tied: both cast to the embedder's compute dtype
        return Head(model.embedder.input_embedding[...], True, model.embedder.dtype)
    return lm_head(model, "Qwen3")


def logits(model: Any, x: Any) -> Any:
    import jax.numpy as jnp

    out = model.embedder.decode(x) if model.config.use_tied_embedding else model.lm_head(x)
    return jnp.astype(out, jnp.float32)


def layer_kwargs(named: Mapping[str, Any]) -> dict[str, Any]:
    return {"segment_ids": named.get("segment_ids")}


ARCHITECTURE = "Qwen3ForCausalLM"


def hf_config(config: Any, dtype: str) -> dict[str, Any]:
    """config.json through transformers' Qwen3Config."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.embed_dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(config.rope_theta)},
        tie_word_embeddings=bool(config.use_tied_embedding), max_position_embeddings=40_960,
        dtype=dtype, architectures=[ARCHITECTURE],
    ).to_dict()


SITES = llama_layout((
    Site("attn.q_norm.w", (LAYER + "self_attn.q_norm.weight",), identity),
    Site("attn.k_norm.w", (LAYER + "self_attn.k_norm.weight",), identity),
))

FAMILY = Family(
    name="qwen3", tunix_module=TUNIX, model_class_name="Qwen3", lora_paths=LORA_PATHS, load_weights=load_weights,
    attention_inputs=attention_inputs, attention_output=attention_output, output_head=output_head, logits=logits,
    architecture=ARCHITECTURE, hf_config=hf_config, sites=SITES,
    # tests/test_train_trainer.py checks it against the embedded tokenizer's.
    vocab_hash="2b126ad4a1742c536099a31874320a4da38b49ec91d85e3e219374d897a44566",
    layer_kwargs=layer_kwargs,
)

# Qwen/Qwen3-0.6B: max_position_embeddings 40960.
SPECS = (
    ModelSpec("qwen3-0.6b", FAMILY, LORA_PATHS, False, qwen3_0p6b, 40960, hf_base="Qwen/Qwen3-0.6B"),
    ModelSpec("tiny-qwen3", FAMILY, LORA_PATHS, True, tiny_config, TINY_CONTEXT, "float32"),
)
