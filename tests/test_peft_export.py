"""The adapter export (`--save-lora`, PEFT layout) and `prepack export --merge`, checked against Hugging Face itself.

Tiny random Gemma3 (q/k/v fused as Tunix's q_einsum + kv_einsum, a sliding window), Qwen3
(untied head) and Llama3 (tied head, Tunix's RoPE base) with random LoRA factors, float32. What
"the published layout" means is read from Hugging Face's own code: transformers builds
Gemma3ForCausalLM / Qwen3ForCausalLM / LlamaForCausalLM from the exported config.json and names every weight and shape, and peft applies the exported
adapter. Tiny widths make q_proj square (4 heads x 16 = 64 = hidden), so a missing transpose
keeps every shape right and shows only in values: the logits catch it.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from train import families
from train.adapter_files import hf_layout, merge_export, peft_export
from train.adapter_files.lora_file import LoraFileError, save_lora
from train.model import models
from train.model.fingerprint import base_fingerprint

VOCAB = 96
RANK, ALPHA = 4, 6.0
LENGTH = 12
CASES = {
    "gemma3": ("tiny-gemma3", {"sliding_window_size": 4}),
    "qwen3": ("tiny-qwen3", {"use_tied_embedding": False}),
    "llama3": ("tiny-llama3", {}),
}


def build(family: str) -> tuple[models.BuiltModel, nnx.Module, dict]:
    """(the base as built, the LoRA model with random A and B, the metadata training records)."""
    name, overrides = CASES[family]
    base = models.build_model(name, vocab_size=VOCAB, seed=2, config_overrides=overrides)
    fingerprint = base_fingerprint(base.model)
    model = models.apply_lora(models.build_model(name, vocab_size=VOCAB, seed=2, config_overrides=overrides).model,
                              base.spec, rank=RANK, alpha=ALPHA, seed=3)
    rng = np.random.default_rng(7)
    state = nnx.state(model, nnx.LoRAParam)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.2, x.dtype), state))
    meta = {"model": name, "lora_alpha": ALPHA, "base_weights": "random", "base_fingerprint": fingerprint,
            "base_dtype": "float32", "config_overrides": overrides, "vocab_size": VOCAB, "seed": 2, "step": 1}
    return base, model, meta


def tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(3, VOCAB, size=(2, LENGTH)).astype(np.int32)


def tunix_logits(model: nnx.Module) -> np.ndarray:
    t = tokens()
    positions = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), t.shape)
    mask = np.broadcast_to(np.tril(np.ones((LENGTH, LENGTH), bool)), (t.shape[0], LENGTH, LENGTH))
    return np.asarray(model(jnp.asarray(t), jnp.asarray(positions), None, jnp.asarray(mask))[0])


def hf_logits(model) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens(), dtype=torch.long)).logits.numpy()


def hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype="float32", attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tmp_path_factory) -> dict:
    family = families.by_name(request.param)
    base, model, meta = build(family.name)
    root = tmp_path_factory.mktemp(f"export_{family.name}")
    adapter = str(root / "adapter")
    peft_export.save_peft(model, family, base.config, adapter, model_name=meta["model"], rank=RANK, alpha=ALPHA, metadata=meta)
    base_folder = str(root / "base")
    base_hf = merge_export.base_hf_weights(base.model, family, base.config)
    merge_export.write_hf_folder(base_folder, base_hf, family.hf_config(base.config, "float32"), "float32", False)
    merged = str(root / "merged")
    merge_export.merge_export(adapter, merged)
    return {"family": family, "base": base, "model": model, "meta": meta, "adapter": adapter, "base_folder": base_folder,
            "base_hf": base_hf, "merged": merged, "root": root}


def test_base_conversion_is_the_inverse_of_tunix_loader(exported) -> None:
    """The HF folder of the base, read back by Tunix's own safetensors loader, gives every parameter bit for bit."""
    base = exported["base"]
    back = base.spec.family.load_weights(exported["base_folder"], base.config, jnp.float32, None)
    mine = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(base.model, nnx.Param))}
    theirs = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(back, nnx.Param))}
    assert mine.keys() == theirs.keys()
    for p in mine:
        np.testing.assert_array_equal(theirs[p], mine[p], err_msg=str(p))


def test_peft_names_and_shapes_are_the_hf_architectures(exported) -> None:
    hf = hf_model(exported["base_folder"])
    assert type(hf).__name__ == exported["family"].architecture
    shapes = {name: tuple(t.shape) for name, t in hf.state_dict().items()}
    tensors = safetensors.numpy.load_file(os.path.join(exported["adapter"], peft_export.ADAPTER_WEIGHTS))
    config = json.load(open(os.path.join(exported["adapter"], peft_export.ADAPTER_CONFIG)))
    layers = exported["base"].config.num_layers
    modules = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj"]
    expected = {f"base_model.model.model.layers.{i}.{m}.lora_{x}.weight" for i in range(layers) for m in modules for x in "AB"}
    assert set(tensors) == expected
    for name, value in tensors.items():
        module = name[len("base_model.model."):].rsplit(".lora_", 1)[0]
        out_dim, in_dim = shapes[f"{module}.weight"]
        assert value.shape == ((RANK, in_dim) if ".lora_A." in name else (out_dim, RANK)), name
        assert value.dtype == np.float32
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA
    assert config["target_modules"] == sorted(m.split(".")[1] for m in modules)
    if exported["family"].name == "gemma3":  # the fused kv_einsum: k and v share one A, B split in halves
        for i in range(layers):
            a_k = tensors[f"base_model.model.model.layers.{i}.self_attn.k_proj.lora_A.weight"]
            np.testing.assert_array_equal(a_k, tensors[f"base_model.model.model.layers.{i}.self_attn.v_proj.lora_A.weight"])


def test_peft_applies_the_adapter_as_training_computed_it(exported) -> None:
    """peft's PeftModel on transformers' base gives the logits of Tunix's LoRA model."""
    from peft import PeftModel

    with_adapter = PeftModel.from_pretrained(hf_model(exported["base_folder"]), exported["adapter"]).eval()
    want = tunix_logits(exported["model"])
    np.testing.assert_allclose(hf_logits(with_adapter), want, atol=2e-4, rtol=1e-4)
    # and the adapter matters: without it the logits are another model's
    assert np.abs(hf_logits(hf_model(exported["base_folder"])) - want).max() > 1e-2


def test_numpy_application_in_hf_layout_equals_the_merged_export(exported) -> None:
    tensors = safetensors.numpy.load_file(os.path.join(exported["adapter"], peft_export.ADAPTER_WEIGHTS))
    merged = safetensors.numpy.load_file(os.path.join(exported["merged"], merge_export.MODEL_WEIGHTS))
    expect = dict(exported["base_hf"])
    for name, a in tensors.items():
        if ".lora_A." in name:
            module = name[len("base_model.model."):].split(".lora_A.")[0]
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            expect[f"{module}.weight"] = expect[f"{module}.weight"] + ALPHA / RANK * (b @ a)
    assert merged.keys() == expect.keys()
    for name in expect:
        np.testing.assert_allclose(merged[name], expect[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_merged_export_logits_equal_the_lora_model(exported) -> None:
    """Read by Tunix's own loader and by transformers, the merged folder computes what training's model with LoRA does."""
    want = tunix_logits(exported["model"])
    base = exported["base"]
    tunix_merged = base.spec.family.load_weights(exported["merged"], base.config, jnp.float32, None)
    np.testing.assert_allclose(tunix_logits(tunix_merged), want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(hf_logits(hf_model(exported["merged"])), want, atol=2e-4, rtol=1e-4)
    config = json.load(open(os.path.join(exported["merged"], merge_export.CONFIG)))
    assert config["architectures"] == [exported["family"].architecture]


def test_prepack_format_file_merges_the_same(exported, tmp_path) -> None:
    path = str(tmp_path / "lora.safetensors")
    save_lora(exported["model"], path, exported["meta"])
    merged = str(tmp_path / "merged")
    merge_export.merge_export(path, merged)
    a = safetensors.numpy.load_file(os.path.join(merged, merge_export.MODEL_WEIGHTS))
    b = safetensors.numpy.load_file(os.path.join(exported["merged"], merge_export.MODEL_WEIGHTS))
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_tunix_delta_matches_qwix_on_every_site(exported) -> None:
    """hf_layout's einsum of A and B is the update qwix applies: the LoRA model equals its base with W + scale * delta."""
    family, base, model = exported["family"], exported["base"], exported["model"]
    merged = nnx.clone(base.model)
    factors = peft_export.lora_factors(model)
    state = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(merged, nnx.Param))}
    for (layer, name), (a, b) in factors.items():
        path = ("layers", layer, *name.split(".")) if layer is not None else tuple(name.split("."))
        var = state[path]
        var.set_value(var.get_value() + ALPHA / RANK * hf_layout.tunix_delta(family, name, a, b))
    np.testing.assert_allclose(tunix_logits(merged), tunix_logits(model), atol=2e-5, rtol=1e-5)


def test_merge_refuses_other_base_weights_and_an_existing_output(exported, tmp_path) -> None:
    with pytest.raises(LoraFileError, match="already exists; pass --overwrite"):
        merge_export.merge_export(exported["adapter"], exported["merged"])
    config = json.load(open(os.path.join(exported["adapter"], peft_export.ADAPTER_CONFIG)))
    other = tmp_path / "other"
    other.mkdir()
    (other / peft_export.ADAPTER_CONFIG).write_text(json.dumps(config))
    tensors = safetensors.numpy.load_file(os.path.join(exported["adapter"], peft_export.ADAPTER_WEIGHTS))
    meta = {"format": "pt", **{peft_export.META_PREFIX + k: json.dumps(v) if not isinstance(v, str) else v
                                 for k, v in {**exported["meta"], "seed": 5}.items()}}
    safetensors.numpy.save_file(tensors, str(other / peft_export.ADAPTER_WEIGHTS), metadata=meta)
    with pytest.raises(LoraFileError, match="trained on other base weights"):
        merge_export.merge_export(str(other), str(tmp_path / "m"))
    (other / peft_export.ADAPTER_CONFIG).write_text('{"peft_type": "IA3"}')
    with pytest.raises(LoraFileError, match="not 'LORA'"):
        merge_export.read_adapter(str(other))


def test_overwrite_replaces_only_the_writers_own_files(exported, tmp_path) -> None:
    """--save-lora and export --merge with --overwrite: their own files are replaced (a stale shard
    of an earlier sharded export and its index removed), every other file in the folder stays."""
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(exported["adapter"], adapter)
    (adapter / "notes.txt").write_text("mine")
    (adapter / "m.jsonl").write_text("{}\n")
    (adapter / "L256").mkdir()
    (adapter / "L256" / "manifest.json").write_text("{}")
    with pytest.raises(LoraFileError, match="already exists; pass --overwrite"):
        peft_export.save_peft(exported["model"], exported["family"], exported["base"].config, str(adapter),
                              model_name=exported["meta"]["model"], rank=RANK, alpha=ALPHA, metadata=exported["meta"])
    peft_export.save_peft(exported["model"], exported["family"], exported["base"].config, str(adapter),
                          model_name=exported["meta"]["model"], rank=RANK, alpha=ALPHA, metadata=exported["meta"], overwrite=True)
    assert sorted(p.name for p in adapter.iterdir()) == ["L256", "adapter_config.json", "adapter_model.safetensors", "m.jsonl", "notes.txt"]
    assert (adapter / "notes.txt").read_text() == "mine" and (adapter / "L256" / "manifest.json").read_text() == "{}"
    merged = tmp_path / "merged"
    shutil.copytree(exported["merged"], merged)
    for name in ("notes.txt", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json"):
        (merged / name).write_text("old")
    merge_export.merge_export(str(adapter), str(merged), overwrite=True)
    assert sorted(p.name for p in merged.iterdir()) == ["config.json", "model.safetensors", "notes.txt", "tokenizer.json"]
    assert (merged / "model.safetensors").read_bytes() == open(os.path.join(exported["merged"], "model.safetensors"), "rb").read()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "merged"]  # no staging left beside them
