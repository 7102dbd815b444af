"""The model families (one module each) and the `--model` names they offer; see README.md."""

from __future__ import annotations

from typing import Any

from train.families import gemma3, llama3, qwen3
from train.families.base import TINY_CONTEXT, Family, Head, ModelSpec

FAMILIES: tuple[Family, ...] = (gemma3.FAMILY, qwen3.FAMILY, llama3.FAMILY)
MODELS: dict[str, ModelSpec] = {spec.name: spec for module in (gemma3, qwen3, llama3) for spec in module.SPECS}

__all__ = ["FAMILIES", "MODELS", "TINY_CONTEXT", "Family", "Head", "ModelSpec", "by_name", "of"]


def by_name(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise KeyError(f"unknown model family {name!r}; one of {', '.join(f.name for f in FAMILIES)}")


def of(thing: Any) -> Family:
    """The family of a Tunix model, config, decoder layer or attention module (or a subclass of one,
    as the layer scan and the attention kinds make), by the module that defines its class."""
    cls = thing if isinstance(thing, type) else type(thing)
    for c in cls.__mro__:
        for family in FAMILIES:
            if family.owns(c):
                return family
    raise ValueError(f"{cls.__name__} is of no model family here ({', '.join(f.name for f in FAMILIES)})")
