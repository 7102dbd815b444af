"""`--save-lora PATH` (`--lora-format peft`, the default): the trained adapter as a Hugging Face PEFT folder.

    PATH/adapter_model.safetensors   base_model.model.<HF module>.lora_A.weight [r, in]
                                     base_model.model.<HF module>.lora_B.weight [out, r]
    PATH/adapter_config.json         peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, target_modules, ...

The module names, shapes and transposes are those of the model's Hugging Face architecture
(Gemma3ForCausalLM, Qwen3ForCausalLM: train/adapter_files/hf_layout.py), e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, so transformers + peft
(`PeftModel.from_pretrained`), vLLM and llama.cpp's convert_lora_to_gguf.py load it as they load
any PEFT adapter. The safetensors metadata holds `format: pt` (what PEFT writes) and the run's
own record under `prepack_*` keys (model, base weights and their fingerprint, step, shards), which
`prepack export --merge` reads to rebuild the base (train/adapter_files/merge_export.py).

Written whole beside PATH first, then its two files swapped in (prepack/storage/own_files.py):
an existing adapter is replaced only with --overwrite (refused before the run by train/run_config/outputs.py),
and then only these two files; anything else in PATH stays. On gs:// the weights first, the
config last.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from prepack import storage
from prepack.storage import own_files
from train import families
from train.adapter_files import hf_layout
from train.adapter_files.lora_file import LoraFileError, check_finite

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
META_PREFIX = "prepack_"
# adapter_model.safetensors and adapter_config.json are read whole: refuse absurd ones first.
MAX_CONFIG_BYTES = 1 << 20


def lora_factors(model: Any) -> dict[tuple[int | None, str], tuple[np.ndarray, np.ndarray]]:
    """{(layer, Tunix kernel name): (A, B)} of every qwix LoRA pair, on the host."""
    from train.adapter_files.lora_file import lora_tensors

    tensors = lora_tensors(model)
    pairs: dict[tuple[int | None, str], dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        base, _, which = name.rpartition("_lora_")
        layer, kernel = hf_layout.split_path(tuple(int(p) if p.isdigit() else p for p in base.split(".")))
        pairs.setdefault((layer, kernel), {})[which] = value
    return {key: (pair["a"], pair["b"]) for key, pair in sorted(pairs.items(), key=lambda kv: (kv[0][0] or -1, kv[0][1]))}


def peft_tensors(family: families.Family, config: Any, model: Any) -> dict[str, np.ndarray]:
    """The adapter's tensors under PEFT's names."""
    hf = hf_layout.lora_to_hf(family, lora_factors(model), hf_layout.Dims.of(config))
    out = {}
    for module, (a, b) in hf.items():
        out[f"{PREFIX}{module}.lora_A.weight"] = a
        out[f"{PREFIX}{module}.lora_B.weight"] = b
    return out


def hf_base(model_name: str) -> str | None:
    """The Hugging Face checkpoint the model corresponds to (its family module's ModelSpec.hf_base)."""
    spec = families.MODELS.get(model_name)
    return spec.hf_base if spec is not None else None


def adapter_config(model_name: str, rank: int, alpha: float, target_modules: list[str], base_path: str | None) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path or hf_base(model_name),
        "r": int(rank),
        "lora_alpha": float(alpha),
        "target_modules": sorted(target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def save_peft(model: Any, family: families.Family, config: Any, path: str, *, model_name: str, rank: int, alpha: float,
              metadata: Mapping[str, Any], overwrite: bool = False) -> dict[str, str]:
    """Writes the PEFT folder; returns the safetensors metadata written. Refuses NaN/Inf adapters."""
    import jax
    import jax.numpy as jnp
    import safetensors.flax

    tensors = peft_tensors(family, config, model)
    if not tensors:
        raise LoraFileError("the model has no LoRA parameters to export")
    check_finite(tensors, f"{path}: not written", "the run diverged: lower --learning-rate, or --dtype float32")
    meta = {"format": "pt"}
    meta.update({META_PREFIX + k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items() if v is not None})
    meta.update({META_PREFIX + "model": model_name, META_PREFIX + "lora_rank": str(rank), META_PREFIX + "lora_alpha": json.dumps(float(alpha)),
                 META_PREFIX + "family": family.name})
    targets = sorted({name.split(".")[-3] for name in tensors})
    weights_path = metadata.get("base_weights")
    base_path = weights_path if isinstance(weights_path, str) and os.path.isdir(weights_path) else None
    config_json = json.dumps(adapter_config(model_name, rank, alpha, targets, base_path), indent=2, sort_keys=True) + "\n"
    if jax.process_index() != 0:
        return meta
    data = safetensors.flax.save({k: jnp.asarray(v) for k, v in tensors.items()}, metadata=meta)
    write_folder(path, {ADAPTER_WEIGHTS: data, ADAPTER_CONFIG: config_json.encode()}, overwrite)
    return meta


def owns_adapter_file(name: str) -> bool:
    """The files of a PEFT folder this writer writes (--overwrite replaces these and nothing else)."""
    return name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)


def folder_problem(path: str, names: Sequence[str], overwrite: bool) -> str | None:
    """Why the folder `path` cannot take the files `names`, asked before any work (a merge took 16 s
    to find it): a file where the folder goes, a folder that exists without --overwrite, or a folder
    standing where one of the files goes (a file cannot replace it); None when it can. Local only."""
    if storage.is_gcs(path) or not os.path.exists(path):
        return None
    if not os.path.isdir(path):
        return f"{path} is a file, not a folder; give a folder path"
    if not overwrite and os.listdir(path):
        return f"{path} already exists; pass --overwrite to replace it"
    for name in names:
        inside = os.path.join(path, name)
        if os.path.isdir(inside) and not os.path.islink(inside):
            return (f"{inside} is a folder, where this command writes the file {name}; nothing replaces a folder: "
                    "move it away, or give another path")
    return None


def write_folder(path: str, files: Mapping[str, bytes], overwrite: bool, owns: Callable[[str], bool] = owns_adapter_file) -> None:
    """The files into the folder `path`, staged beside it and swapped in (prepack/storage/own_files.py):
    with --overwrite only the files `owns` names are replaced or removed; every other file stays."""
    problem = folder_problem(path, list(files), overwrite)
    if problem:
        raise LoraFileError(problem)
    try:
        own_files.write_own_files(path, files, owns)
    except own_files.OwnFilesError as e:
        raise LoraFileError(str(e)) from None


def read_peft(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, str]]:
    """(adapter_config, tensors by PEFT name, safetensors metadata) of a PEFT folder, checked as a stranger's.
    A `--save-lora` killed while it swapped the folder's files is finished first (own_files.recover)."""
    if not storage.is_gcs(path):
        own_files.recover(path, owns_adapter_file)

    config_bytes = storage.read_bytes(storage.join(path, ADAPTER_CONFIG))
    if config_bytes is None:
        raise LoraFileError(f"{path}: no {ADAPTER_CONFIG}: not a PEFT adapter folder")
    if len(config_bytes) > MAX_CONFIG_BYTES:
        raise LoraFileError(f"{path}/{ADAPTER_CONFIG}: {len(config_bytes):,} bytes, more than an adapter config holds")
    try:
        config = json.loads(config_bytes)
    except (ValueError, RecursionError) as e:
        raise LoraFileError(f"{path}/{ADAPTER_CONFIG}: not valid JSON ({str(e)[:100]})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise LoraFileError(f"{path}/{ADAPTER_CONFIG}: peft_type is {config.get('peft_type') if isinstance(config, dict) else None!r}, "
                            "not 'LORA'")
    data = storage.read_bytes(storage.join(path, ADAPTER_WEIGHTS))
    if data is None:
        raise LoraFileError(f"{path}: no {ADAPTER_WEIGHTS}")
    from train.adapter_files.lora_file import _parse_safetensors_metadata, load_tensors

    meta = _parse_safetensors_metadata(data, f"{path}/{ADAPTER_WEIGHTS}")
    return config, load_tensors(data, f"{path}/{ADAPTER_WEIGHTS}"), meta


def hf_factors(tensors: Mapping[str, np.ndarray], path: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{HF module: (lora_A, lora_B)} from PEFT's names; refuses names that are not PEFT LoRA pairs."""
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        for which in ("lora_A", "lora_B"):
            suffix = f".{which}.weight"
            if name.startswith(PREFIX) and name.endswith(suffix):
                pairs.setdefault(name[len(PREFIX):-len(suffix)], {})[which] = value
                break
        else:
            raise LoraFileError(f"{path}: tensor {name!r} is not a PEFT LoRA factor (base_model.model.<module>.lora_A/B.weight)")
    out = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise LoraFileError(f"{path}: {module} has {sorted(pair)}, not both lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraFileError(f"{path}: {module}: lora_A {a.shape} and lora_B {b.shape} are not [r, in] and [out, r]")
        out[module] = (a, b)
    return out
