"""An adapter's scale is checked where its tensors are (issue 71): alpha, rank and alpha / r * B @ A of
every adapter read back, on every read path (`prepack generate --lora`, `prepack export --merge`; a
resumed run's restored values are in tests/test_train_checkpoint.py), refused in one line naming the file
and the field, before any model is built. JSON readers take NaN, Infinity and 1e300 in a config; safetensors
metadata are strings parsed the same way; lora_B values of 3e38 are finite, their scaled update is not.

One tiny Gemma3 adapter (`--model tiny`, random weights, rank 4, alpha 8) is written once in both formats;
each case corrupts a copy. Nothing here builds a model: every refusal comes before."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from apps import generate as generate_app
from train.adapter_files import adapter_scale, adapters, lora_file, merge_export, peft_export
from train.adapter_files.lora_file import LoraFileError
from train.model import models
from train.model.fingerprint import base_fingerprint
from train.run_config import options

VOCAB, RANK, ALPHA = 96, 4, 8.0
A_LONG = "the adapter was edited or not written by a LoRA trainer"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> dict:
    """A PEFT folder and a prepack file of one tiny Gemma3 adapter with non-zero factors."""
    built = models.build_model("tiny", vocab_size=VOCAB, seed=0)
    model = models.apply_lora(built.model, built.spec, rank=RANK, alpha=ALPHA)
    rng = np.random.default_rng(0)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), nnx.state(model, nnx.LoRAParam)))
    meta = {"model": "tiny", "lora_alpha": ALPHA, "base_weights": "random", "base_fingerprint": base_fingerprint(model),
            "base_dtype": "float32", "vocab_size": VOCAB, "seed": 0, "step": 1}
    root = tmp_path_factory.mktemp("scale")
    peft = str(root / "peft")
    peft_export.save_peft(model, built.spec.family, built.config, peft, model_name="tiny", rank=RANK, alpha=ALPHA, metadata=meta)
    prepack = str(root / "lora.safetensors")
    lora_file.save_lora(model, prepack, meta)
    data = root / "held_out.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "2 + 2 = ?"}, {"role": "assistant", "content": "4"}]}) + "\n")
    return {"peft": peft, "prepack": prepack, "data": str(data), "root": root}


def peft_copy(adapter, tmp_path, *, config_edit=None, tensor_edit=None) -> str:
    """A copy of the PEFT folder: `config_edit(text) -> text` on adapter_config.json (raw, so JSON's NaN
    tokens can be written), `tensor_edit(tensors)` on the weights."""
    folder = tmp_path / "peft"
    shutil.copytree(adapter["peft"], folder)
    config = folder / peft_export.ADAPTER_CONFIG
    if config_edit:
        config.write_text(config_edit(config.read_text()))
    if tensor_edit:
        weights = str(folder / peft_export.ADAPTER_WEIGHTS)
        with open(weights, "rb") as f:
            meta = lora_file._parse_safetensors_metadata(f.read(), weights)
        tensors = safetensors.numpy.load_file(weights)
        tensor_edit(tensors)
        safetensors.numpy.save_file(tensors, weights, metadata=meta)
    return str(folder)


def prepack_copy(adapter, tmp_path, *, meta_edit=None, tensor_edit=None) -> str:
    meta, tensors = lora_file.read_lora(adapter["prepack"])
    if meta_edit:
        meta_edit(meta)
    if tensor_edit:
        tensor_edit(tensors)
    path = str(tmp_path / "lora.safetensors")
    safetensors.numpy.save_file(tensors, path, metadata=meta)
    return path


def _set(text: str, field: str, token: str) -> str:
    """adapter_config.json with `field`'s value replaced by the raw JSON token."""
    config = json.loads(text)
    marker = "@@VALUE@@"
    config[field] = marker
    return json.dumps(config, indent=2).replace(json.dumps(marker), token)


def first_b(tensors: dict, suffix: str) -> str:
    return sorted(n for n in tensors if n.endswith(suffix))[0]


def generate_refusal(adapter, path, tmp_path) -> str:
    out, err = io.StringIO(), io.StringIO()
    argv = ["--input", adapter["data"], "--format", "chat", "--model", "tiny", "--max-new-tokens", "2", "--lora", path,
            "--output", str(tmp_path / "gen.jsonl"), "--compile-cache", "off"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = generate_app.main(argv)
    assert code == 2, err.getvalue()
    return err.getvalue()


def export_refusal(path, tmp_path, capsys) -> str:
    out = tmp_path / "merged"
    assert merge_export.main(["--merge", "--lora", path, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert not out.exists() and "rebuilding" not in err
    return err


def assert_refused_everywhere(adapter, path, tmp_path, capsys, want: str) -> None:
    """The one line `want` from the library readers, `prepack generate --lora` and `prepack export --merge`."""
    for read in (merge_export.read_adapter, adapters.read_adapter):
        with pytest.raises(LoraFileError) as e:
            read(path)
        assert want in str(e.value) and "\n" not in str(e.value)
    for prog, err in (("prepack generate", generate_refusal(adapter, path, tmp_path)),
                      ("prepack export", export_refusal(path, tmp_path, capsys))):
        assert err.startswith(f"{prog}: ") and want in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "loading" not in err


RANGE = f"a LoRA alpha is a number above 0 and at most {options.MAX_LORA_ALPHA:,.0f}"


@pytest.mark.parametrize(("token", "words"), [
    ("NaN", f"lora_alpha is nan: {RANGE}"),
    ("Infinity", f"lora_alpha is inf: {RANGE}"),
    ("-Infinity", f"lora_alpha is -inf: {RANGE}"),
    ("1e300", f"lora_alpha is 1e+300: {RANGE}"),
    ("1000001", f"lora_alpha is 1000001: {RANGE}"),
    ("0", f"lora_alpha is 0: {RANGE}"),
    ("-8.0", f"lora_alpha is -8.0: {RANGE}"),
    ('"8.0"', "lora_alpha is a string '8.0', not a number"),
    ("true", "lora_alpha is a boolean True, not a number"),
    ("null", "lora_alpha is null None, not a number"),
])
def test_a_peft_config_alpha_out_of_range_is_refused_on_every_path(adapter, tmp_path, capsys, token, words):
    path = peft_copy(adapter, tmp_path, config_edit=lambda t: _set(t, "lora_alpha", token))
    assert_refused_everywhere(adapter, path, tmp_path, capsys, f"{path}/{peft_export.ADAPTER_CONFIG}: {words}")


@pytest.mark.parametrize(("token", "words"), [
    ("-4", "r is -4: a LoRA rank is a whole number from 1 to 2,147,483,647"),
    ("0", "r is 0: a LoRA rank is a whole number from 1 to 2,147,483,647"),
    ("4.0", "r is a number 4.0, not a whole number"),
    ('"4"', "r is a string '4', not a whole number"),
    ("true", "r is a boolean True, not a whole number"),
    ("8", "r is 8, but tensor base_model.model.model.layers.0.mlp.down_proj.lora_B.weight in "),
    ("2", "r is 2, but tensor base_model.model.model.layers.0.mlp.down_proj.lora_B.weight in "),
])
def test_a_peft_config_rank_out_of_range_is_refused_on_every_path(adapter, tmp_path, capsys, token, words):
    path = peft_copy(adapter, tmp_path, config_edit=lambda t: _set(t, "r", token))
    assert_refused_everywhere(adapter, path, tmp_path, capsys, f"{path}/{peft_export.ADAPTER_CONFIG}: {words}")
    assert "--lora-rank" not in generate_refusal(adapter, path, tmp_path)  # generate has no such option


@pytest.mark.parametrize("field", ["lora_alpha", "r"])
def test_a_peft_config_without_alpha_or_rank_is_refused(adapter, tmp_path, capsys, field):
    def drop(text):
        config = json.loads(text)
        del config[field]
        return json.dumps(config)

    path = peft_copy(adapter, tmp_path, config_edit=drop)
    assert_refused_everywhere(adapter, path, tmp_path, capsys, f"{path}/{peft_export.ADAPTER_CONFIG}: no {field}; ")


def test_finite_peft_factors_whose_scaled_update_overflows_are_refused(adapter, tmp_path, capsys):
    """lora_B of 3e38 is finite in float32; alpha / r = 2 times it is not."""
    name = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"

    def huge_b(tensors):
        tensors[name] = np.full_like(tensors[name], 3e38)

    path = peft_copy(adapter, tmp_path, tensor_edit=huge_b)
    assert_refused_everywhere(adapter, path, tmp_path, capsys, f"{path}/{peft_export.ADAPTER_WEIGHTS}: tensor {name} "
                              "times alpha / r = 2 overflows float32 (|value| up to 3e+38)")


def test_factors_each_in_range_whose_product_overflows_are_refused(adapter, tmp_path, capsys):
    """alpha / r * B is finite, B @ A is not: the update itself is checked."""
    module = "base_model.model.model.layers.0.mlp.down_proj"

    def big_pair(tensors):
        tensors[f"{module}.lora_A.weight"] = np.full_like(tensors[f"{module}.lora_A.weight"], 1e20)
        tensors[f"{module}.lora_B.weight"] = np.full_like(tensors[f"{module}.lora_B.weight"], 1e20)

    path = peft_copy(adapter, tmp_path, tensor_edit=big_pair)
    assert_refused_everywhere(adapter, path, tmp_path, capsys, f"{path}/{peft_export.ADAPTER_WEIGHTS}: tensor "
                              f"{module}.lora_B.weight: the update alpha / r * B @ A overflows float32 (|value| up to 8e+40")


@pytest.mark.parametrize(("key", "words"), [("prepack_lora_alpha", f"is nan: {RANGE}"),
                                            ("prepack_lora_rank", "is a number nan, not a whole number")])
def test_prepacks_own_record_in_a_peft_folder_is_held_to_the_same_rule(adapter, tmp_path, capsys, key, words):
    folder = tmp_path / "peft"
    shutil.copytree(adapter["peft"], folder)
    weights = str(folder / peft_export.ADAPTER_WEIGHTS)
    with open(weights, "rb") as f:
        meta = lora_file._parse_safetensors_metadata(f.read(), weights)
    meta[key] = "NaN"
    safetensors.numpy.save_file(safetensors.numpy.load_file(weights), weights, metadata=meta)
    assert_refused_everywhere(adapter, str(folder), tmp_path, capsys, f"{weights}: metadata {key} {words}")


@pytest.mark.parametrize(("key", "stored", "words"), [
    ("lora_alpha", "NaN", f"metadata lora_alpha is nan: {RANGE}"),
    ("lora_alpha", "Infinity", f"metadata lora_alpha is inf: {RANGE}"),
    ("lora_alpha", "1e300", f"metadata lora_alpha is 1e+300: {RANGE}"),
    ("lora_alpha", '"8.0"', "metadata lora_alpha is a string '8.0', not a number"),
    ("lora_alpha", "eight", "metadata lora_alpha is a string 'eight', not a number"),
    ("lora_alpha", "true", "metadata lora_alpha is a boolean True, not a number"),
    ("lora_rank", "-4", "metadata lora_rank is -4: a LoRA rank is a whole number from 1"),
    ("lora_rank", "0", "metadata lora_rank is 0: a LoRA rank is a whole number from 1"),
    ("lora_rank", "None", "metadata lora_rank is a string 'None', not a whole number"),
    ("lora_rank", "8", "metadata lora_rank is 8, but tensor layers.0.attn.attn_vec_einsum.w_lora_b in "),
])
def test_a_prepack_files_metadata_out_of_range_is_refused_on_every_path(adapter, tmp_path, capsys, key, stored, words):
    path = prepack_copy(adapter, tmp_path, meta_edit=lambda m: m.update({key: stored}))
    assert_refused_everywhere(adapter, path, tmp_path, capsys, f"{path}: {words}")


@pytest.mark.parametrize("stored", ["NaN", "1e300", "true"])
def test_load_lora_holds_a_prepack_file_to_the_same_check(adapter, tmp_path, stored):
    """The library loader (what `generate --lora` puts on the model for a prepack file) checks what it loads."""
    path = prepack_copy(adapter, tmp_path, meta_edit=lambda m: m.update({"lora_alpha": stored}))
    fresh = models.apply_lora(models.build_model("tiny", vocab_size=VOCAB, seed=0).model,
                              models.get_spec("tiny"), rank=RANK, alpha=ALPHA)
    with pytest.raises(LoraFileError, match=rf"^{path}: metadata lora_alpha is "):
        lora_file.load_lora(fresh, path, check_base=False)
    lora_file.load_lora(fresh, adapter["prepack"])


def test_finite_prepack_factors_whose_scaled_update_overflows_are_refused(adapter, tmp_path, capsys):
    holder = {}

    def huge_b(tensors):
        holder["name"] = name = first_b(tensors, "_lora_b")
        tensors[name] = np.full_like(tensors[name], 3e38)

    path = prepack_copy(adapter, tmp_path, tensor_edit=huge_b)
    assert_refused_everywhere(adapter, path, tmp_path, capsys,
                              f"{path}: tensor {holder['name']} times alpha / r = 2 overflows float32")


def test_valid_adapters_pass_with_their_alpha_and_rank(adapter, tmp_path):
    for path in (adapter["peft"], adapter["prepack"]):
        read = adapters.read_adapter(path)
        assert (read.rank, read.alpha) == (RANK, ALPHA)
    # A whole-number alpha (as PEFT users write it), the largest alpha allowed, and a missing alpha in
    # a prepack file (qwix's default 2 x rank) all read.
    path = peft_copy(adapter, tmp_path, config_edit=lambda t: _set(t, "lora_alpha", "16"))
    assert merge_export.read_adapter(path).scale == 4.0
    (tmp_path / "big").mkdir()
    path = peft_copy(adapter, tmp_path / "big", config_edit=lambda t: _set(t, "lora_alpha", "1e6"))
    assert merge_export.read_adapter(path).alpha == 1e6
    path = prepack_copy(adapter, tmp_path, meta_edit=lambda m: m.pop("lora_alpha"))
    assert adapters.read_adapter(path).alpha == 2.0 * RANK


def test_the_update_check_on_its_own():
    """The bound skips the product when it shows the update finite; cancellation is not an overflow."""
    a = np.full((3, 2), 1e19, np.float32)
    b = np.array([[1e19, 1e19], [-1e19, -1e19]], np.float32)  # a @ b is exactly 0
    adapter_scale.check_update([adapter_scale.FactorPair("w_lora_b", a, b)], 4.0, 2, tensors_at="f", rank_at="f: r")
    with pytest.raises(LoraFileError, match=r"^f: tensor w_lora_b: the update alpha / r \* B @ A overflows float32"):
        adapter_scale.check_update([adapter_scale.FactorPair("w_lora_b", a, np.abs(b))], 4.0, 2, tensors_at="f", rank_at="f: r")
    pairs = adapter_scale.qwix_pairs({"x.w_lora_a": np.ones((4, 16, 2)), "x.w_lora_b": np.ones((2, 64))})
    assert [(p.a.shape, p.b.shape) for p in pairs] == [((64, 2), (2, 64))]
