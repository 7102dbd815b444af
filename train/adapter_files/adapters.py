"""`--lora PATH`: the adapter `prepack train --save-lora` wrote, read back onto its base model.

One entry point for both formats `--lora-format` writes: `read_adapter(path)` says what the
adapter needs (model, rank, alpha, vocabulary, base weights) before any weights load, and
`apply_adapter` puts it on a freshly built base model as qwix LoRA parameters, so generation runs
the adapter as training ran it (the LoRA path, not a merged copy of the weights).

- `peft` (the default): a Hugging Face PEFT folder (`adapter_model.safetensors` +
  `adapter_config.json`, train/adapter_files/peft_export.py) read through train/adapter_files/merge_export.py's reader; its
  factors are in Hugging Face's layout and are mapped back to qwix's (the inverse of
  train/adapter_files/hf_layout.py's `lora_to_hf`, checked by mapping the result forward again: exact, or refused);
- `prepack`: the project's single safetensors file (train/adapter_files/lora_file.py), loaded as it is.

Either way the adapter names the base weights it was trained on (their fingerprint) and is
refused on others.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from train.adapter_files import lora_file

__all__ = ["Adapter", "read_adapter", "apply_adapter", "PEFT", "PREPACK"]

PEFT, PREPACK = "peft", "prepack"


@dataclasses.dataclass(frozen=True)
class Adapter:
    path: str
    kind: str  # PEFT or PREPACK
    model: str | None  # the --model it was trained on
    rank: int
    alpha: float
    vocab_size: int | None
    metadata: dict[str, Any]
    factors: dict[str, tuple[np.ndarray, np.ndarray]] | None = None  # PEFT: HF module -> (lora_A, lora_B)

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.kind, "model": self.model, "rank": self.rank, "alpha": self.alpha,
                "step": self.metadata.get("step"), "base_weights": self.metadata.get("base_weights")}

    @property
    def seed(self) -> int:
        return int(self.metadata.get("seed") or 0)


def _int(value: Any, key: str, path: str) -> int | None:
    if value in (None, "None", "null"):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise lora_file.LoraFileError(f"{path}: metadata {key} is {value!r}, not an integer") from None


def read_adapter(path: str) -> Adapter:
    """What the adapter at `path` belongs to; LoraFileError (one line) when it is none we read. Both
    formats go through the one reader (merge_export.read_adapter): every tensor read and checked
    finite, alpha, rank and the scaled update checked (adapter_scale.py), before any model is built."""
    from train.adapter_files import merge_export

    read = merge_export.read_adapter(path)
    if not read.peft:  # the prepack file: loaded as stored (load_lora)
        return Adapter(path, PREPACK, read.meta.get("model"), read.rank, read.alpha,
                       _int(read.raw.get("vocab_size"), "vocab_size", path), dict(read.raw))
    return Adapter(path, PEFT, read.meta.get("model"), read.rank, read.alpha,
                   _int(read.meta.get("vocab_size"), "vocab_size", path), dict(read.meta), read.factors)


def qwix_factors(family: Any, config: Any, hf: dict[str, tuple[np.ndarray, np.ndarray]],
                 shapes: dict[tuple[int | None, str], tuple[tuple[int, ...], tuple[int, ...]]],
                 path: str) -> dict[tuple[int | None, str], tuple[np.ndarray, np.ndarray]]:
    """PEFT's (lora_A [r, in], lora_B [out, r]) per HF module -> qwix's (A, B) per Tunix kernel, shaped as
    the model's own LoRA parameters. Every layout of train/adapter_files/hf_layout.py maps A to lora_A's transpose
    (reshaped) and B to the parts' lora_B transposes stacked (a fused kernel's parts share A)."""
    from train.adapter_files import hf_layout

    out = {}
    for (layer, name), (a_shape, b_shape) in shapes.items():
        site = hf_layout.site(family, name)
        modules = [n.format(i=layer).removesuffix(".weight") for n in site.hf]
        missing = [m for m in modules if m not in hf]
        if missing:
            raise lora_file.LoraFileError(f"{path}: no LoRA factors for {missing[0]}, which the model adapts; the adapter "
                                          "was trained with other --lora paths or on another model")
        if any(not np.array_equal(hf[m][0], hf[modules[0]][0]) for m in modules[1:]):
            raise lora_file.LoraFileError(f"{path}: {', '.join(modules)} have different lora_A, but the model's LoRA on "
                                          f"{name} shares one A across them; this adapter was not trained by prepack train")
        la = hf[modules[0]][0]
        try:
            a = la.T.reshape(a_shape)
            b = np.stack([hf[m][1].T for m in modules], axis=1).reshape(b_shape)
        except ValueError:
            raise lora_file.LoraFileError(f"{path}: {modules[0]}'s factors {la.shape} / {hf[modules[0]][1].shape} do not fit "
                                          f"the model's LoRA {a_shape} / {b_shape} (another rank or model size)") from None
        out[(layer, name)] = (a, b)
    back = hf_layout.lora_to_hf(family, out, hf_layout.Dims.of(config))
    extra = sorted(set(hf) - set(back))
    if extra:
        raise lora_file.LoraFileError(f"{path}: factors for {extra[0]}, which the model's LoRA does not adapt")
    for module, (la, lb) in back.items():  # the inverse is exact, or the layouts changed under it
        if not (np.array_equal(la, hf[module][0]) and np.array_equal(lb, hf[module][1])):
            raise lora_file.LoraFileError(f"{path}: {module} does not map back onto the model's LoRA layout")
    return out


def _set_peft(model: Any, family: Any, adapter: Adapter) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from train.adapter_files import hf_layout

    state = nnx.state(model, nnx.LoRAParam)
    flat = {tuple(p): var for p, var in nnx.to_flat_state(state)}
    kernels: dict[tuple[int | None, str], dict[str, Any]] = {}
    for p, var in flat.items():
        base, _, which = ".".join(map(str, p)).rpartition("_lora_")
        key = hf_layout.split_path(tuple(int(x) if x.isdigit() else x for x in base.split(".")))
        kernels.setdefault(key, {})[which] = var
    shapes = {k: (tuple(v["a"].get_value().shape), tuple(v["b"].get_value().shape)) for k, v in kernels.items()}
    factors = qwix_factors(family, model.config, adapter.factors or {}, shapes, adapter.path)
    for key, (a, b) in factors.items():
        for which, value in (("a", a), ("b", b)):
            var = kernels[key][which]
            current = var.get_value()
            sharding = getattr(current, "sharding", None)
            value = jnp.asarray(value, dtype=current.dtype)
            var.set_value(jax.device_put(value, sharding) if sharding is not None else value)
    nnx.update(model, state)


def apply_adapter(model: Any, spec: Any, adapter: Adapter) -> Any:
    """The base model with the adapter's LoRA on it (models.apply_lora, then its values): refused
    (LoraFileError) when the adapter was trained on other base weights, paths or shapes."""
    from train.model import models
    from train.model.fingerprint import base_fingerprint

    # The base weights are checked before the LoRA is built (the fingerprint leaves LoRA out, so
    # it is the same on the base model): other weights are refused without that work.
    expected = adapter.metadata.get("base_fingerprint")
    if expected:
        mine = base_fingerprint(model)
        if mine != expected:
            raise lora_file.LoraFileError(
                f"{adapter.path}: trained on other base weights ({adapter.metadata.get('base_weights')!r}, fingerprint "
                f"{expected}) than this model's (fingerprint {mine}); build the model with the training run's "
                "--model/--weights/--dtype/--seed")
    lora_model = models.apply_lora(model, spec, rank=adapter.rank, alpha=adapter.alpha)
    if adapter.kind == PREPACK:
        lora_file.load_lora(lora_model, adapter.path, check_base=False)
        return lora_model
    _set_peft(lora_model, spec.family, adapter)
    return lora_model
