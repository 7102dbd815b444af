"""The LoRA export of `prepack train --save-lora`: one safetensors file, and loading it back.

LoRA export (`save_lora` / `load_lora`): one safetensors file with every nnx.LoRAParam,
named by its module path (`layers.0.attn.q_proj.w_lora_a`, `..._lora_b`), and string
metadata: model, rank, alpha, module regex, dtype, base-weights source and fingerprint,
step. `load_lora(model, path)` puts them into a freshly built LoRA model with the same
shapes and refuses another rank, other module paths or other base weights, and an unusable
scale (train/adapter_files/adapter_scale.py, as every reader does).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

from prepack import storage
from train.adapter_files import adapter_scale
from train.adapter_files.lora_error import LoraFileError
from train.model.fingerprint import base_fingerprint

__all__ = ["LoraFileError", "save_lora", "read_lora", "read_lora_metadata", "load_lora", "load_tensors", "check_finite",
           "nonfinite_tensor", "lora_tensors"]

LORA_FORMAT = "prepack-lora"
LORA_FORMAT_VERSION = "1"


def lora_tensors(model: Any) -> dict[str, Any]:
    """{module path.param name: value} of every nnx.LoRAParam, gathered to the host."""
    import jax
    import numpy as np
    from flax import nnx

    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        value = var.get_value()
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            from jax.experimental import multihost_utils

            value = multihost_utils.process_allgather(value, tiled=True)
        out[".".join(map(str, path))] = np.asarray(jax.device_get(value))
    return out


def nonfinite_tensor(tensors: Mapping[str, Any]) -> tuple[str, int, int] | None:
    """(name, non-finite values, values) of the first tensor (by name) holding NaN or Inf; None when all are finite."""
    import numpy as np

    for name in sorted(tensors):
        value = np.asarray(tensors[name])
        if value.dtype.kind in "fc" or value.dtype.name == "bfloat16":
            bad = int(value.size - np.count_nonzero(np.isfinite(value.astype(np.float32))))
            if bad:
                return name, bad, int(value.size)
    return None


def check_finite(tensors: Mapping[str, Any], where: str, remedy: str) -> None:
    """The one check of adapters and merged weights, on every read and write: LoraFileError naming
    the first tensor that holds NaN or Inf. A diverged run's values would poison whatever uses them
    (a merged model of NaN, completions of padding), and nothing downstream says why."""
    found = nonfinite_tensor(tensors)
    if found is not None:
        name, bad, size = found
        raise LoraFileError(f"{where}: tensor {name} is non-finite (NaN/Inf in {bad:,} of {size:,} values); {remedy}")


READ_REMEDY = "the adapter is unusable (a diverged run's?): use one saved before the divergence, or retrain"


def _lora_rank(tensors: Mapping[str, Any]) -> int | None:
    """qwix's A factors end in the rank: [..., in, rank]."""
    for name in sorted(tensors):
        if name.endswith("_lora_a"):
            return int(tensors[name].shape[-1])
    return None


def _write_bytes(path: str, data: bytes) -> None:
    # locally through a temp name: a crash leaves the old file, never half a new one
    storage.storage_for(path).replace(path, data, content_type="application/octet-stream")


def _read_bytes(path: str) -> bytes:
    data = storage.storage_for(path).read_bytes(path)
    if data is None:
        raise LoraFileError(f"no LoRA file at {path}")
    return data


def save_lora(model: Any, path: str, metadata: Mapping[str, Any]) -> dict[str, str]:
    """Writes the model's LoRA parameters to a safetensors file; returns the metadata written.

    metadata: model, lora_alpha, lora_module_path, base_weights, base_fingerprint, step, ...
    (values are stored as strings, JSON for non-strings). lora_rank and dtype are taken
    from the tensors. Only process 0 writes.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import safetensors.flax

    tensors = lora_tensors(model)
    if not tensors:
        raise LoraFileError("the model has no LoRA parameters to export")
    check_finite(tensors, f"{path}: not written", "the run diverged: lower --learning-rate, or --dtype float32")
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items() if v is not None}
    meta.update({
        "format": LORA_FORMAT,
        "format_version": LORA_FORMAT_VERSION,
        "lora_rank": str(_lora_rank(tensors)),
        "dtype": str(next(iter(tensors.values())).dtype),
        "tensor_names": "module path + '.' + qwix param name (<kernel>_lora_a [.., in, rank], <kernel>_lora_b [rank, ..])",
    })
    if jax.process_index() == 0:
        # safetensors.flax keeps bfloat16 (the numpy writer has no bf16).
        data = safetensors.flax.save({k: jnp.asarray(v) for k, v in tensors.items()}, metadata=meta)
        _write_bytes(path, data)
    return meta


def _parse_safetensors_metadata(data: bytes, path: str) -> dict[str, str]:
    """The file's __metadata__ (the format: u64 little-endian header length, then a JSON header)."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
    except (struct.error, ValueError) as e:
        raise LoraFileError(f"{path}: not a safetensors file ({e})") from e
    return dict(header.get("__metadata__") or {})


def read_lora_metadata(path: str) -> dict[str, str]:
    """The metadata of a LoRA file written by save_lora (to rebuild the model it belongs to)."""
    data = _read_bytes(path)
    meta = _parse_safetensors_metadata(data, path)
    if meta.get("format") != LORA_FORMAT:
        raise LoraFileError(f"{path}: not a prepack LoRA export (metadata format {meta.get('format')!r})")
    return meta


def load_tensors(data: bytes, where: str) -> dict[str, Any]:
    """A safetensors file's tensors (numpy), in one line when it is truncated or corrupt, checked finite."""
    import safetensors.numpy

    try:
        tensors = safetensors.numpy.load(data)
    except Exception as e:  # noqa: BLE001  (safetensors raises its own SafetensorError, among others)
        raise LoraFileError(f"{where}: cannot be read, truncated or corrupt ({str(e)[:100]}); write it again") from None
    check_finite(tensors, where, READ_REMEDY)
    return tensors


def read_lora(path: str) -> tuple[dict[str, str], dict[str, Any]]:
    """(metadata, tensors) of a save_lora file, checked as a stranger's: the format, every tensor
    readable (a truncated file is one line) and finite."""
    data = _read_bytes(path)
    meta = _parse_safetensors_metadata(data, path)
    if meta.get("format") != LORA_FORMAT:
        raise LoraFileError(f"{path}: not a prepack LoRA export (metadata format {meta.get('format')!r})")
    return meta, load_tensors(data, path)


def load_lora(
    model: Any,
    path: str,
    *,
    check_base: bool = True,
    expected: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Sets a LoRA model's nnx.LoRAParam values from a save_lora file; returns its metadata.

    `model` is freshly built with the same LoRA (e.g. models.build_model + models.apply_lora
    with the file's model, rank and alpha). Refused, naming what differs: another rank,
    missing or extra module paths, other shapes, other base weights (fingerprint; pass
    check_base=False to apply anyway), or any `expected` metadata value (e.g.
    {"model": "gemma3-270m", "lora_alpha": 32.0}) that the file contradicts. Alpha is not a
    parameter (qwix keeps it in the provider), so only `expected` can check it. Values are
    cast to the model's dtype and placed with its shardings.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    meta, loaded = read_lora(path)
    adapter_scale.prepack_file_scale(meta, loaded, path)  # the one check of every adapter read (its scale)
    for key, want in (expected or {}).items():
        have = meta.get(key)
        if have is None or (have != want and have != json.dumps(want)):
            raise LoraFileError(f"{path}: {key} is {have!r} in the file, expected {want!r}")

    state = nnx.state(model, nnx.LoRAParam)
    flat = {".".join(map(str, p)): var for p, var in nnx.to_flat_state(state)}
    if not flat:
        raise LoraFileError("the model has no LoRA parameters; apply LoRA (models.apply_lora) before load_lora")
    file_rank = int(meta["lora_rank"])  # checked a whole number above
    model_rank = _lora_rank({k: v.get_value() for k, v in flat.items()})
    if file_rank != model_rank:
        raise LoraFileError(f"{path}: LoRA rank {file_rank} in the file, but the model's LoRA has rank {model_rank}")
    missing, extra = sorted(set(flat) - set(loaded)), sorted(set(loaded) - set(flat))
    if missing or extra:
        raise LoraFileError(
            f"{path}: LoRA module paths differ (file for model {meta.get('model')!r}): "
            f"{len(missing)} missing from the file {missing[:3]}, {len(extra)} not in the model {extra[:3]}"
        )
    for name, var in flat.items():
        if tuple(loaded[name].shape) != tuple(var.get_value().shape):
            raise LoraFileError(f"{path}: {name} has shape {tuple(loaded[name].shape)} in the file, {tuple(var.get_value().shape)} in the model")
    if check_base and meta.get("base_fingerprint"):
        mine = base_fingerprint(model)
        if mine != meta["base_fingerprint"]:
            raise LoraFileError(
                f"{path}: trained on other base weights ({meta.get('base_weights')!r}, fingerprint "
                f"{meta['base_fingerprint']}) than this model's (fingerprint {mine}); "
                "build the model with the same --model/--weights/--dtype/--seed, or pass check_base=False"
            )
    for name, var in flat.items():
        current = var.get_value()
        value = jnp.asarray(loaded[name], dtype=current.dtype)
        sharding = getattr(current, "sharding", None)
        var.set_value(jax.device_put(value, sharding) if sharding is not None else value)
    nnx.update(model, state)
    return meta
