"""Tunix weights and qwix LoRA factors in Hugging Face's layout, by the family's sites (train/families/).

Each family lists its sites (`Family.sites`: one Tunix parameter, its HF names, the conversions of
its weights and of its LoRA factors; train/families/hf_sites.py says how HF's layout and qwix's
factors are laid out); the functions here apply them to a model's parameters.

`tunix_delta` is the merged update in Tunix's own layout (an einsum of A and B over the rank,
straight from qwix's factorization), independent of the PEFT conversion, so the two can be
checked against each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from train.families import Family
from train.families.hf_sites import Array, Dims, LayoutError, Site

__all__ = ["Dims", "LayoutError", "Site", "base_to_hf", "hf_names", "lora_to_hf", "site", "split_path", "tunix_delta"]


def split_path(path: tuple[Any, ...]) -> tuple[int | None, str]:
    """("layers", 3, "attn", "q_einsum", "w") -> (3, "attn.q_einsum.w"); top-level params -> (None, path)."""
    if len(path) > 2 and path[0] == "layers":
        return int(path[1]), ".".join(map(str, path[2:]))
    return None, ".".join(map(str, path))


def site(family: Family, name: str) -> Site:
    for s in family.sites:
        if s.tunix == name:
            return s
    raise LayoutError(f"{family.name}: no Hugging Face name for Tunix parameter {name!r}")


def hf_names(s: Site, layer: int | None) -> list[str]:
    return [n.format(i=layer) for n in s.hf]


def base_to_hf(family: Family, params: Mapping[tuple[Any, ...], Array], dims: Dims) -> dict[str, Array]:
    """{Tunix flat path: value} of the base weights (no LoRA factors) -> {HF name: [out, in] value}."""
    out: dict[str, Array] = {}
    for path, value in params.items():
        layer, name = split_path(path)
        s = site(family, name)
        for hf_name, w in zip(hf_names(s, layer), s.to_hf(np.asarray(value), dims)):
            out[hf_name] = np.ascontiguousarray(w)
    return out


def lora_to_hf(family: Family, factors: Mapping[tuple[int | None, str], tuple[Array, Array]], dims: Dims) -> dict[str, tuple[Array, Array]]:
    """{(layer, Tunix kernel name): (A, B)} -> {HF module name (no `.weight`): (lora_A [r, in], lora_B [out, r])}."""
    out: dict[str, tuple[Array, Array]] = {}
    for (layer, name), (a, b) in factors.items():
        s = site(family, name)
        if s.lora_to_hf is None:
            raise LayoutError(f"{family.name}: Tunix parameter {name!r} has no LoRA conversion")
        for hf_name, (la, lb) in zip(hf_names(s, layer), s.lora_to_hf(np.asarray(a), np.asarray(b), dims)):
            out[hf_name.removesuffix(".weight")] = (np.ascontiguousarray(la), np.ascontiguousarray(lb))
    return out


def tunix_delta(family: Family, name: str, a: Array, b: Array) -> Array:
    """The LoRA update of a Tunix kernel in its own layout (before alpha / r): qwix's A and B contracted over the rank."""
    s = site(family, name)
    if s.delta is None:
        raise LayoutError(f"{family.name}: Tunix parameter {name!r} takes no LoRA")
    return np.einsum(s.delta, np.asarray(a, np.float32), np.asarray(b, np.float32))
