"""The run's choices, resolved once from its TrainConfig and carried (`Setup.run`): the objective, the model
(its spec: family, LoRA paths, default dtype), the attention kind, the compute dtype and the compilation
cache's folder.

Why: each was re-derived from the config's strings wherever it was needed (the objective's lookup ten
times, the attention kind eleven, the dtype twelve), and the cache folder read back from jax.config. Each
lookup is still its own module's (`objectives.of`, `models.get_spec`, `models.parse_dtype`,
`memory_path.attention_kind`, `compile_cache.enable`); this is the one place a run asks them, and what
it asks them is carried from here. A refusal among them (an unknown model or dtype, another objective's
option) is the same one line as before.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from train import objectives
from train.run_config.config import TrainConfig

if TYPE_CHECKING:
    from train.families.base import Family, ModelSpec


@dataclasses.dataclass(frozen=True)
class ResolvedRun:
    """What a run's options resolve to, once; `cache_folder` is set when the cache is enabled."""

    objective: objectives.Objective
    spec: ModelSpec  # the model: its family, LoRA paths, default dtype, context length
    attention: str  # --attention, or the backend's default kind
    compute_dtype: Any  # --dtype, or the model's default (a jnp dtype)
    cache_folder: str | None = None  # the compilation cache's folder this process uses; None: off (or not yet on)

    @property
    def family(self) -> Family:
        return self.spec.family

    @property
    def dtype_name(self) -> str:
        import jax.numpy as jnp

        return jnp.dtype(self.compute_dtype).name

    def with_cache(self, folder: str | None) -> ResolvedRun:
        """The same choices once compile_cache.enable has said which folder (None: off)."""
        return dataclasses.replace(self, cache_folder=folder)


def resolve(cfg: TrainConfig) -> ResolvedRun:
    """The run's choices from its config (TrainError or ModelError, one line, for a choice that does not exist)."""
    from train.model import models
    from train.step import memory_path

    objective = objectives.of(cfg)
    spec = models.get_spec(cfg.model)
    return ResolvedRun(objective, spec, memory_path.attention_kind(cfg), models.parse_dtype(cfg.dtype, spec.default_dtype))
