"""Llama 3 (Tunix `tunix.models.llama3`): tiny-llama3.

What is Llama3's own in Tunix 0.1.7: its ModelConfig has no dtype (the parameters are float32
unless a loader casts them) and calls the tied head `weight_tying`; no q/k norms; the forward takes
no `output_hidden_states`, so the layer-scan class adds it (`sows_hidden_states=False`); and its
attention applies RoPE with `apply_rope`'s default base, 1,000,000, whatever `rope_theta` says, so
the exported config.json says that base: the merged folder computes what the trained model did.

No real Llama checkpoint is offered (`--model llama3.2-1b` would be one line in SPECS): Meta's
Llama 3.2 weights need RoPE base 500,000 with the llama3 frequency scaling, which Tunix 0.1.7's
Llama3 does not apply, so they would train as another model. There is no Llama tokenizer here
either (`vocab_hash` None): like `tiny`, tiny-llama3 sizes its embedding from the set it trains on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from train.families.base import TINY_CONTEXT, Family, Head, ModelSpec
from train.families.hf_sites import llama_layout
from train.families.qwen3 import LORA_PATHS, lm_head

TUNIX = "tunix.models.llama3.model"
# Tunix 0.1.7's Llama3 Attention calls apply_rope without rope_theta: its default is the base used.
TUNIX_ROPE_THETA = 1_000_000


def _l3() -> Any:
    from tunix.models.llama3 import model as l3

    return l3


def tiny_config(vocab_size: int | None = None, dtype: Any = None) -> Any:
    """Llama 3.2 1B's shape (tied head, grouped KV), as small as the other tiny models; float32."""
    return dataclasses.replace(_l3().ModelConfig.llama3p2_1b(), num_layers=2, vocab_size=vocab_size or 256, embed_dim=64,
                               hidden_dim=128, num_heads=4, head_dim=16, num_kv_heads=2)


def load_weights(folder: str, config: Any, dtype: Any, mesh: Any) -> Any:
    from tunix.models.llama3 import params

    return params.create_model_from_safe_tensors(folder, config, mesh, dtype=dtype)


def attention_inputs(attn: Any, x: Any, segment_pos: Any) -> tuple[Any, Any, Any, int | None]:
    """Tunix 0.1.7's Llama3 Attention.block up to the attention itself (its scale is on the scores there)."""
    l3 = _l3()
    act = attn.shd_config.act_btnh
    query = l3.apply_rope(l3.shard(attn.q_proj(x), act), segment_pos, head_dim=attn.head_dim)
    key = l3.apply_rope(l3.shard(attn.k_proj(x), act), segment_pos, head_dim=attn.head_dim)
    return query * attn.scale, key, l3.shard(attn.v_proj(x), act), None


def attention_output(attn: Any, encoded: Any) -> Any:
    return _l3().shard(attn.o_proj(encoded), attn.shd_config.act_btd)


def output_head(model: Any) -> Head:
    if model.config.weight_tying:  # decode is jnp.dot(x, input_embedding.T)
        emb = model.embedder.input_embedding[...]
        return Head(emb, True, emb.dtype)
    head = lm_head(model, "Llama3")
    return head._replace(dtype=head.matrix.dtype)  # no compute dtype in the config: the weights'


def logits(model: Any, x: Any) -> Any:
    return model.embedder.decode(x) if model.config.weight_tying else model.lm_head(x)


ARCHITECTURE = "LlamaForCausalLM"


def hf_config(config: Any, dtype: str) -> dict[str, Any]:
    """config.json through transformers' LlamaConfig (RoPE base: TUNIX_ROPE_THETA, what the model computed with)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.embed_dim, intermediate_size=config.hidden_dim,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(TUNIX_ROPE_THETA)},
        tie_word_embeddings=bool(config.weight_tying), max_position_embeddings=131_072,
        dtype=dtype, architectures=[ARCHITECTURE],
    ).to_dict()


SITES = llama_layout()

FAMILY = Family(
    name="llama3", tunix_module=TUNIX, model_class_name="Llama3", lora_paths=LORA_PATHS, load_weights=load_weights,
    attention_inputs=attention_inputs, attention_output=attention_output, output_head=output_head, logits=logits,
    architecture=ARCHITECTURE, hf_config=hf_config, sites=SITES, sows_hidden_states=False,
)

SPECS = (
    # Its adapter names the Llama 3.2 checkpoint whose layout (module names, tied head) it has.
    ModelSpec("tiny-llama3", FAMILY, LORA_PATHS, True, tiny_config, TINY_CONTEXT, "float32", hf_base="meta-llama/Llama-3.2-1B"),
)
