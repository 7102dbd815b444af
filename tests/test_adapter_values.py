"""Non-finite values never pass (issue 57): every adapter read, either format, is checked for NaN/Inf
before use and refused in one line naming the tensor; a merge never writes non-finite weights; a
truncated adapter of either format is one line; export's and tokenizer-folder's outputs are judged
before any work. Tiny Qwen3 (random weights) with random LoRA factors: each test runs in seconds."""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from train.adapter_files import adapters, lora_file, merge_export, peft_export
from train.adapter_files.lora_file import LoraFileError
from train.model import models
from train.model.fingerprint import base_fingerprint

VOCAB, RANK = 96, 2
DOWN_B = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> dict:
    """A PEFT folder and a prepack file of one tiny Qwen3 adapter with non-zero factors."""
    built = models.build_model("tiny-qwen3", vocab_size=VOCAB, seed=1)
    model = models.apply_lora(built.model, built.spec, rank=RANK, alpha=4.0)
    rng = np.random.default_rng(0)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), nnx.state(model, nnx.LoRAParam)))
    meta = {"model": "tiny-qwen3", "lora_alpha": 4.0, "base_weights": "random", "base_fingerprint": base_fingerprint(model),
            "base_dtype": "float32", "vocab_size": VOCAB, "seed": 1, "step": 1}
    root = tmp_path_factory.mktemp("adapter")
    peft = str(root / "peft")
    peft_export.save_peft(model, built.spec.family, built.config, peft, model_name="tiny-qwen3", rank=RANK, alpha=4.0, metadata=meta)
    prepack = str(root / "lora.safetensors")
    lora_file.save_lora(model, prepack, meta)
    return {"peft": peft, "prepack": prepack, "model": model, "spec": built.spec}


def poisoned_peft(adapter, tmp_path, value=np.nan) -> str:
    """The PEFT folder with one lora_B all `value`, as a stranger (or a diverged trainer elsewhere) would write it."""
    folder = tmp_path / "poisoned"
    folder.mkdir()
    source = os.path.join(adapter["peft"], peft_export.ADAPTER_WEIGHTS)
    with open(source, "rb") as f:
        meta = lora_file._parse_safetensors_metadata(f.read(), source)
    tensors = safetensors.numpy.load_file(source)
    tensors[DOWN_B] = np.full_like(tensors[DOWN_B], value)
    safetensors.numpy.save_file(tensors, str(folder / peft_export.ADAPTER_WEIGHTS), metadata=meta)
    (folder / peft_export.ADAPTER_CONFIG).write_bytes(open(os.path.join(adapter["peft"], peft_export.ADAPTER_CONFIG), "rb").read())
    return str(folder)


def poisoned_prepack(adapter, tmp_path) -> tuple[str, str]:
    meta, tensors = lora_file.read_lora(adapter["prepack"])
    name = sorted(n for n in tensors if n.endswith("_lora_b"))[0]
    tensors[name] = np.full_like(tensors[name], np.inf)
    path = str(tmp_path / "poisoned.safetensors")
    safetensors.numpy.save_file(tensors, path, metadata=meta)
    return path, name


@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_every_reader_refuses_a_non_finite_peft_adapter(adapter, tmp_path, value):
    path = poisoned_peft(adapter, tmp_path, value)
    want = (f"{path}/{peft_export.ADAPTER_WEIGHTS}: tensor {DOWN_B} is non-finite (NaN/Inf in 128 of 128 values); "
            "the adapter is unusable")
    for read in (peft_export.read_peft, merge_export.read_adapter, adapters.read_adapter):
        with pytest.raises(LoraFileError) as e:
            read(path)
        assert str(e.value).startswith(want) and "layout" not in str(e.value)


def test_every_reader_refuses_a_non_finite_prepack_file(adapter, tmp_path):
    path, name = poisoned_prepack(adapter, tmp_path)
    want = f"{path}: tensor {name} is non-finite (NaN/Inf in"
    for read in (lora_file.read_lora, merge_export.read_adapter, adapters.read_adapter):
        with pytest.raises(LoraFileError, match=None) as e:
            read(path)
        assert str(e.value).startswith(want)
    fresh = models.apply_lora(models.build_model("tiny-qwen3", vocab_size=VOCAB, seed=1).model, adapter["spec"], rank=RANK)
    with pytest.raises(LoraFileError) as e:
        lora_file.load_lora(fresh, path)
    assert str(e.value).startswith(want)


def test_export_refuses_a_non_finite_adapter_and_writes_nothing(adapter, tmp_path, capsys):
    out = tmp_path / "merged"
    for path in (poisoned_peft(adapter, tmp_path), poisoned_prepack(adapter, tmp_path)[0]):
        assert merge_export.main(["--merge", "--lora", path, "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"prepack export: {path}") and "is non-finite (NaN/Inf in" in err
        assert len(err.strip().splitlines()) == 1 and "rebuilding" not in err and not out.exists()


def test_merge_never_writes_non_finite_weights(adapter, tmp_path, monkeypatch):
    """A finite adapter on a base that overflows: the merged tensors are checked before anything is written."""
    real = merge_export.base_hf_weights

    def overflowing(*a):
        weights = real(*a)
        weights["model.norm.weight"] = weights["model.norm.weight"] * np.inf
        return weights

    monkeypatch.setattr(merge_export, "base_hf_weights", overflowing)
    out = tmp_path / "merged"
    with pytest.raises(LoraFileError, match=r"--output .*merged: not written: tensor model.norm.weight is non-finite"):
        merge_export.merge_export(adapter["peft"], str(out))
    assert not out.exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("fmt", ["peft", "prepack"])
def test_a_truncated_adapter_is_one_line(adapter, tmp_path, capsys, fmt):
    if fmt == "peft":
        folder = tmp_path / "cut"
        folder.mkdir()
        for name in (peft_export.ADAPTER_WEIGHTS, peft_export.ADAPTER_CONFIG):
            (folder / name).write_bytes(open(os.path.join(adapter["peft"], name), "rb").read())
        path, weights = str(folder), str(folder / peft_export.ADAPTER_WEIGHTS)
    else:
        path = weights = str(tmp_path / "cut.safetensors")
        with open(path, "wb") as f:
            f.write(open(adapter["prepack"], "rb").read())
    os.truncate(weights, os.path.getsize(weights) - 64)
    with pytest.raises(LoraFileError, match=r"cannot be read, truncated or corrupt \("):
        adapters.read_adapter(path)
    assert merge_export.main(["--merge", "--lora", path, "--output", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err
    assert "cannot be read, truncated or corrupt" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("output, message", [
    ("gs:///x", "--output 'gs:///x' names no bucket: write gs://BUCKET/FOLDER"),
    ("s3://b/x", "--output 's3://b/x': only local paths and gs:// are supported, not s3://"),
    ("/proc/merged", "--output '/proc/merged' cannot be written: no folder can be made in /proc"),
])
def test_export_output_is_judged_before_any_work(adapter, capsys, output, message):
    assert merge_export.main(["--merge", "--lora", adapter["peft"], "--output", output]) == 2
    err = capsys.readouterr().err
    assert message in err and "rebuilding" not in err and len(err.strip().splitlines()) == 1


def test_export_output_under_a_file(adapter, tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    assert merge_export.main(["--merge", "--lora", adapter["peft"], "--output", str(tmp_path / "file" / "merged")]) == 2
    assert f"cannot be written: {tmp_path / 'file'} is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "mine"


def test_export_over_a_file_is_refused_before_rebuilding_the_base(adapter, tmp_path, capsys):
    """`export --output FILE --overwrite` was refused only after the base was rebuilt and merged."""
    (tmp_path / "file").write_text("mine")
    assert merge_export.main(["--merge", "--lora", adapter["peft"], "--output", str(tmp_path / "file"), "--overwrite"]) == 2
    assert capsys.readouterr().err == f"prepack export: --output {tmp_path / 'file'} is a file, not a folder; give a folder path\n"
    assert (tmp_path / "file").read_text() == "mine"


def test_export_into_a_folder_holding_a_folder_named_config_json_is_refused_before_any_work(adapter, tmp_path, capsys):
    """A folder named config.json in --output: 16 s of merging, then a traceback (the rollback held)."""
    out = tmp_path / "merged"
    (out / "config.json").mkdir(parents=True)
    (out / "config.json" / "notes.txt").write_text("mine")
    assert merge_export.main(["--merge", "--lora", adapter["peft"], "--output", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err == (f"prepack export: --output {out / 'config.json'} is a folder, where this command writes the file "
                   "config.json; nothing replaces a folder: move it away, or give another path\n")
    assert sorted(os.listdir(out)) == ["config.json"] and (out / "config.json" / "notes.txt").read_text() == "mine"


def test_tokenizer_folder_output_is_judged_before_building(tmp_path, capsys, monkeypatch):
    from prepack.text import gemma3_hf_folder

    from apps import tokenizer_folder

    def never(*a, **k):
        raise AssertionError("the tokenizer was built")

    monkeypatch.setattr(gemma3_hf_folder, "fast_tokenizer", never)
    assert tokenizer_folder.main(["--output", "/proc/tokenizer"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prepack tokenizer-folder: --output '/proc/tokenizer' cannot be written: no folder can be "
                          "made in /proc (") and len(err.strip().splitlines()) == 1
