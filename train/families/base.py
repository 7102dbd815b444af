"""`Family`: what differs between model families (Gemma3, Qwen3, Llama3), asked by the rooms above
instead of comparing names or probing config attributes; and `ModelSpec`, one `--model` name.

A family module (gemma3.py, qwen3.py, llama3.py) fills one `Family` with its Tunix module and
classes, its pieces (functions of a model, a layer, an attention module or a config) and its
tables, and lists its `ModelSpec`s. Nothing here imports JAX or Tunix at import time: a family's
Tunix module is imported by name when a class of it is first asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from train.families.hf_sites import Site


class Head(NamedTuple):
    """What a model's decode multiplies its final hidden states with (train/step/chunked_loss.py)."""

    matrix: Any
    transposed: bool  # True: matrix is [V, D] (a tied embedding); False: [D, V] (an lm_head)
    dtype: Any
    softcap: float | None = None


def _vocab_size(config: Any) -> int:
    return int(config.vocab_size)


def _kv_dims(config: Any) -> tuple[int, int, int]:
    return int(config.num_layers), int(config.num_kv_heads), int(config.head_dim)


def _no_kind(layer: Any) -> Any:
    return None


def _no_window(attn: Any) -> int | None:
    return None


def _encode(model: Any, tokens: Any) -> Any:
    return model.embedder.encode(tokens)


def _no_layer_kwargs(named: Mapping[str, Any]) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """One model family. Fields without a default are what every family must say; the defaults
    are what most families share (a `vocab_size` config field, one kind of decoder layer, no
    sliding window, `embedder.encode`, Tunix's forward taking `output_hidden_states`)."""

    name: str
    # Tunix's module of the family's classes: the model, its ModelConfig, DecoderLayer, Attention.
    tunix_module: str
    model_class_name: str
    # qwix's module_path regex: the projections LoRA adapts.
    lora_paths: str
    # (folder, config, dtype, mesh) -> the model, read by Tunix's own safetensors loader.
    load_weights: Callable[[str, Any, Any, Any], Any]
    # --attention blocked|flash|splash: (attention module, x, positions) -> (query scaled, key, value, window)
    # as Tunix's block computes them, and the output projection of the attended values.
    attention_inputs: Callable[[Any, Any, Any], tuple[Any, Any, Any, int | None]]
    attention_output: Callable[[Any, Any], Any]
    # The final hidden states' projection (the chunked loss), and the logits of the layer-scan forward.
    output_head: Callable[[Any], Head]
    logits: Callable[[Any, Any], Any]
    # Hugging Face: the architecture's name, its config.json for a Tunix config and dtype, and the sites.
    architecture: str
    hf_config: Callable[[Any, str], dict[str, Any]]
    sites: tuple[Site, ...]
    # prepack.text.tokenizer.vocab_hash of the family's own tokenizer, as every manifest records it;
    # None: no tokenizer of its own here (a set of any tokenizer that fits the embedding is taken).
    vocab_hash: str | None = None
    attention_class_name: str = "Attention"
    vocab_size: Callable[[Any], int] = _vocab_size  # rows of the embedding table
    kv_dims: Callable[[Any], tuple[int, int, int]] = _kv_dims  # (layers, kv heads, head dim): the KV cache
    layer_kind: Callable[[Any], Any] = _no_kind  # what makes two decoder layers' graphs differ (the layer scan)
    window: Callable[[Any], int | None] = _no_window  # an attention module's sliding window, None: global
    embed: Callable[[Any, Any], Any] = _encode  # (model, tokens) -> the first layer's input
    layer_kwargs: Callable[[Mapping[str, Any]], dict[str, Any]] = _no_layer_kwargs  # from the forward's arguments
    # Whether Tunix's forward takes output_hidden_states (its 5th argument); without it the layer-scan
    # class adds the argument and runs its own loop when it is asked (train/step/layer_scan.py).
    sows_hidden_states: bool = True

    def _tunix(self, name: str) -> type:
        return getattr(importlib.import_module(self.tunix_module), name)

    def model_class(self) -> type:
        return self._tunix(self.model_class_name)

    def attention_class(self) -> type:
        return self._tunix(self.attention_class_name)

    def owns(self, cls: type) -> bool:
        """Whether a class is one of the family's Tunix module (by name: nothing is imported)."""
        return cls.__module__ == self.tunix_module

    def __repr__(self) -> str:
        return f"Family({self.name!r})"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One `--model` name."""

    name: str
    family: Family
    lora_module_path: str
    tiny: bool
    # (vocab_size or None, param dtype) -> Tunix ModelConfig. vocab_size is only used by tiny models.
    make_config: Callable[[int | None, Any], Any]
    # Tokens one sequence may hold (prompt + generated): the Hugging Face config's max_position_embeddings
    # for the real models; tiny models were never trained at any length, and declare TINY_CONTEXT.
    context_length: int
    default_dtype_name: str = "bfloat16"
    # The Hugging Face checkpoint the model corresponds to (adapter_config's base_model_name_or_path).
    hf_base: str | None = None

    @property
    def default_dtype(self) -> Any:
        import jax.numpy as jnp

        return getattr(jnp, self.default_dtype_name)


# The longest sequence the tests and benchmarks give a tiny model (shard sets up to L4096).
TINY_CONTEXT = 4096
