"""`prepack export --merge`: the base weights with a trained adapter merged in, as a Hugging Face safetensors folder.

    prepack export --merge --lora ADAPTER --output DIR [--weights HF_DIR|gguf|random] [--dtype float32|bfloat16] [--overwrite]

ADAPTER is what `prepack train --save-lora` wrote: a PEFT folder (the default format) or a
`--lora-format prepack` file. Its metadata names the model, the base weights and their
fingerprint, so the base is rebuilt exactly as training built it (a different base is refused:
the adapter was trained on that one; QLoRA adapters merge into the unquantized base, as PEFT's
merge_and_unload does). Every base weight is converted to the model's Hugging Face layout
(train/adapter_files/hf_layout.py), each adapted weight gets W + lora_alpha / r * lora_B @ lora_A (in float32,
then cast to --dtype, default the training dtype), and DIR gets `model.safetensors` and
`config.json` (transformers' config class of the family: Gemma3TextConfig, Qwen3Config, LlamaConfig): what
`AutoModelForCausalLM.from_pretrained(DIR)` and Tunix's own safetensors loaders read. The
tokenizer files are not written: take them from the base model's repository.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import numpy as np

from prepack import storage
from prepack.cli_help import CommandParser
from train.adapter_files import hf_layout
from train.adapter_files.lora_file import LoraFileError, check_finite

MODEL_WEIGHTS = "model.safetensors"
CONFIG = "config.json"
# A merged folder's files of the kinds this writer writes, or a loader would read beside them
# (a stale sharded copy: model-00001-of-00002.safetensors and its index): --overwrite replaces or
# removes these, and nothing else in the folder.
_OWN_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")


def owns_merged_file(name: str) -> bool:
    return name in (MODEL_WEIGHTS, CONFIG, "model.safetensors.index.json") or bool(_OWN_SHARD.fullmatch(name))


def output_refusal(lora: str, output: str, weights: str | None) -> str | None:
    """The output rule (prepack/storage/output_rule.py) for one export: --output apart from
    --lora and a --weights folder, and from the working folder and those above it."""
    from prepack.storage import output_rule

    inputs = [output_rule.Place("--lora", lora)]
    if weights and weights not in ("random", "gguf"):
        inputs.append(output_rule.Place("--weights", weights))
    return output_rule.refusal(output_rule.RunPaths(inputs, [output_rule.Place("--output", output)]))


@dataclasses.dataclass
class Adapter:
    """An exported adapter in Hugging Face's layout, with what it was trained on."""

    factors: dict[str, tuple[np.ndarray, np.ndarray]]  # HF module -> (lora_A [r, in], lora_B [out, r])
    rank: int
    alpha: float
    meta: dict[str, Any]  # model, base_weights, base_fingerprint, base_dtype, vocab_size, seed, config_overrides
    raw: dict[str, str] = dataclasses.field(default_factory=dict)  # the safetensors metadata as stored (strings)
    peft: bool = True  # read from a PEFT folder (else a prepack file)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _json_meta(meta: Mapping[str, str], prefix: str) -> dict[str, Any]:
    out = {}
    for key, value in meta.items():
        if key.startswith(prefix):
            try:
                out[key[len(prefix):]] = json.loads(value)
            except ValueError:
                out[key[len(prefix):]] = value
    return out


def is_folder(path: str) -> bool:
    """Whether the adapter at `path` is a PEFT folder (else a prepack file)."""
    from train.adapter_files import peft_export

    if storage.is_gcs(path):
        return storage.read_bytes(storage.join(path, peft_export.ADAPTER_CONFIG)) is not None
    return os.path.isdir(path)


def read_adapter(path: str) -> Adapter:
    """The one reader of an adapter, for every command that reads one (`generate --lora`, `export
    --merge`; train/adapter_files/adapters.py builds on it): a PEFT folder or a prepack LoRA file, its
    tensors finite, its alpha, rank and scaled update checked (train/adapter_files/adapter_scale.py),
    converted to HF factors. LoraFileError (one line naming the file and the field) otherwise."""
    from train.adapter_files import adapter_scale, lora_file, peft_export
    from train.model import models

    if is_folder(path):
        config, tensors, raw = peft_export.read_peft(path)
        meta = _json_meta(raw, peft_export.META_PREFIX)
        if "model" not in meta:
            raise LoraFileError(f"{path}: a PEFT adapter without prepack's metadata (prepack_model, ...): merge it with "
                                "peft's merge_and_unload onto its base model instead")
        config_at, weights_at = f"{path}/{peft_export.ADAPTER_CONFIG}", f"{path}/{peft_export.ADAPTER_WEIGHTS}"
        for field in ("lora_alpha", "r"):
            if field not in config:
                raise LoraFileError(f"{config_at}: no {field}; {adapter_scale.REMEDY}")
        factors = peft_export.hf_factors(tensors, path)
        alpha, rank = adapter_scale.check(config["lora_alpha"], config["r"], adapter_scale.peft_pairs(factors, peft_export.PREFIX),
                                          config_at=config_at, tensors_at=weights_at, alpha_field="lora_alpha", rank_field="r")
        # prepack's own record of them in the weights' metadata: not what scales the update, held to the same rule
        for key, check in (("lora_alpha", adapter_scale.check_alpha), ("lora_rank", adapter_scale.check_rank)):
            if peft_export.META_PREFIX + key in raw:
                check(adapter_scale.parsed_metadata(raw[peft_export.META_PREFIX + key]), weights_at,
                      f"metadata {peft_export.META_PREFIX}{key}")
        return Adapter(factors, rank, alpha, meta, dict(raw))
    raw, tensors = lora_file.read_lora(path)
    alpha, rank = adapter_scale.prepack_file_scale(raw, tensors, path)
    meta = _json_meta({"m_" + k: v for k, v in raw.items()}, "m_")
    if not isinstance(meta.get("model"), str):
        raise LoraFileError(f"{path}: metadata names no model the adapter was trained on; {adapter_scale.REMEDY}")
    spec = models.get_spec(meta["model"])
    config = models.resolve_config(spec.name, vocab_size=meta.get("vocab_size"), config_overrides=meta.get("config_overrides"))
    pairs: dict[tuple[int | None, str], dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        base, _, which = name.rpartition("_lora_")
        layer, kernel = hf_layout.split_path(tuple(int(p) if p.isdigit() else p for p in base.split(".")))
        pairs.setdefault((layer, kernel), {})[which] = value
    factors = hf_layout.lora_to_hf(spec.family, {k: (v["a"], v["b"]) for k, v in pairs.items()}, hf_layout.Dims.of(config))
    return Adapter(factors, rank, alpha, {**meta, "lora_rank": rank, "lora_alpha": alpha}, dict(raw), peft=False)


def base_hf_weights(model: Any, family: Any, config: Any) -> dict[str, np.ndarray]:
    """The model's base parameters (float32, on the host) under their Hugging Face names."""
    import jax
    from flax import nnx

    flat = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if isinstance(var, nnx.LoRAParam):
            continue
        flat[tuple(path)] = np.asarray(jax.device_get(var.get_value())).astype(np.float32)
    return hf_layout.base_to_hf(family, flat, hf_layout.Dims.of(config))


def merge(base: Mapping[str, np.ndarray], adapter: Adapter) -> dict[str, np.ndarray]:
    """W + alpha / r * lora_B @ lora_A for every adapted weight (float32); refuses modules or shapes the base lacks."""
    merged = dict(base)
    for module, (a, b) in adapter.factors.items():
        name = f"{module}.weight"
        if name not in merged:
            raise LoraFileError(f"the adapter's module {module} is not in the base model (another architecture or size)")
        w = merged[name]
        if w.shape != (b.shape[0], a.shape[1]):
            raise LoraFileError(f"the adapter's {module}: lora_B {b.shape} @ lora_A {a.shape} does not fit the base's {w.shape}")
        merged[name] = w + adapter.scale * (b.astype(np.float32) @ a.astype(np.float32))
    return merged


def write_hf_folder(path: str, weights: Mapping[str, np.ndarray], config_json: Mapping[str, Any], dtype: str,
                    overwrite: bool) -> None:
    import jax.numpy as jnp
    import safetensors.flax

    from train.adapter_files import peft_export

    data = safetensors.flax.save({k: jnp.asarray(v, dtype=dtype) for k, v in sorted(weights.items())}, metadata={"format": "pt"})
    peft_export.write_folder(path, {MODEL_WEIGHTS: data, CONFIG: (json.dumps(dict(config_json), indent=2, sort_keys=True) + "\n").encode()},
                             overwrite, owns=owns_merged_file)


def rebuild_base(adapter: Adapter, weights: str | None, say: TextIO) -> Any:
    """The base model the adapter was trained on (no LoRA), checked by its fingerprint."""
    from train.model import models
    from train.model.fingerprint import base_fingerprint

    meta = adapter.meta
    source = weights or meta.get("base_weights")
    print(f"rebuilding the base of {meta['model']} ({source}) ...", file=say, flush=True)
    built = models.build_model(str(meta["model"]), weights=source, vocab_size=meta.get("vocab_size"),
                               dtype=meta.get("base_dtype"), seed=int(meta.get("seed") or 0),
                               config_overrides=meta.get("config_overrides"))
    expected = meta.get("base_fingerprint")
    if expected and base_fingerprint(built.model) != expected:
        raise LoraFileError(f"the adapter was trained on other base weights ({meta.get('base_weights')!r}, fingerprint "
                            f"{expected}) than {source!r} gives (fingerprint {base_fingerprint(built.model)}); pass the "
                            "training run's --weights")
    return built


def merge_export(lora: str, output: str, *, weights: str | None = None, dtype: str | None = None, overwrite: bool = False,
                 out: TextIO | None = None) -> dict[str, Any]:
    from prepack.storage import output_rule

    say = out if out is not None else sys.stderr
    try:  # the one string the rule judges and the folder is written at (a link followed by `..` included)
        output = output_rule.output_path("--output", output)
    except output_rule.OutputPathError as e:
        raise LoraFileError(str(e)) from None
    refused = output_refusal(lora, output, weights)
    if refused:
        raise LoraFileError(refused)
    # Where the folder goes is judged before the adapter is read or the base rebuilt (gs:///x was a
    # ValueError after 9 s of merging).
    problem = None if storage.is_gcs(output) else storage.local_write_problem(output)
    if problem:
        raise LoraFileError(f"--output {problem}")
    if not storage.is_gcs(output) and os.path.exists(output) and not overwrite:
        raise LoraFileError(f"--output {output} already exists; pass --overwrite to replace it, or give another path")
    from train.adapter_files.peft_export import folder_problem

    problem = folder_problem(output, (MODEL_WEIGHTS, CONFIG), overwrite)  # a file there, a folder named config.json
    if problem:
        raise LoraFileError(f"--output {problem}")
    adapter = read_adapter(lora)
    built = rebuild_base(adapter, weights, say)
    family = built.spec.family
    dtype = dtype or adapter.meta.get("base_dtype") or "float32"
    merged = merge(base_hf_weights(built.model, family, built.config), adapter)
    # The adapter was checked finite when read; the base or the product may still not be (an overflow in --dtype).
    check_finite(merged, f"--output {output}: not written", "the merged weights would be unusable: check the base --weights "
                 "and the adapter")
    write_hf_folder(output, merged, family.hf_config(built.config, dtype), dtype, overwrite)
    summary = {"output": output, "model": adapter.meta["model"], "architecture": family.architecture,
               "tensors": len(merged), "adapted": len(adapter.factors), "dtype": dtype}
    print(f"wrote {output}: {summary['architecture']} {dtype}, {len(merged)} tensors, {len(adapter.factors)} with the "
          f"adapter merged (alpha / r = {adapter.scale:g})", file=say, flush=True)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="prepack export",
                                description="write a trained adapter merged into its base as a Hugging Face safetensors folder")
    p.add_argument("--merge", action="store_true", required=True, help="merge the adapter into the base weights (required)")
    p.add_argument("--lora", required=True, help="the adapter prepack train --save-lora wrote (a PEFT folder or a prepack file)")
    p.add_argument("--output", required=True, help="the folder to write (model.safetensors, config.json)")
    p.add_argument("--weights", default=None, help="the base weights (default: what the adapter records: gguf, random, or an HF folder)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="dtype of the merged weights (default: the training dtype)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the merged files (model*.safetensors, its index, config.json) of an existing --output; "
                        "other files there stay")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from prepack.format.manifest import ManifestError
    from train.model import models

    try:
        summary = merge_export(args.lora, args.output, weights=args.weights, dtype=args.dtype, overwrite=args.overwrite)
    except (LoraFileError, models.ModelError, hf_layout.LayoutError, ManifestError) as e:
        print(f"prepack export: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"export": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
