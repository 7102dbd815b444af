"""An adapter's scale, checked where its tensors are: the one check of every adapter read back.

A LoRA update is alpha / r * B @ A. The tensors alone can all be finite while the update is not: an
adapter_config.json whose `lora_alpha` is NaN, Infinity or 1e300 (JSON readers take all three), or a
lora_B of 3e38 (finite in float32, its scaled product is not). Such an adapter generated `<pad>` for
every prompt at exit 0 (issue 71). So every reader (`prepack generate --lora`, `prepack export
--merge`, and a resumed run's restored LoRA values, which `--eval-generate` then evaluates) hands
its alpha, rank and factors to `check`, which refuses in one line naming the file and the field
(`lora_alpha`, `r`, `lora_rank`, or the tensor):

- alpha: a number above 0 and at most MAX_LORA_ALPHA (train/run_config/options.py says why), not a
  string or a bool; the same rule as `prepack train --lora-alpha`, so whatever train writes reads back;
- rank: a whole number, the rank of every factor (the axis A and B share), so alpha / r is the scale
  the factors were trained with;
- the update: alpha / r * B and alpha / r * B @ A finite in float32 for every factor pair (computed
  in float64 where a bound does not already show it finite, so the check cannot overflow itself).

Factors are handed over as (A [in, r], B [r, out]) matrices: qwix's A [..., in, r] and B [r, ...]
reshape to them exactly (`qwix_pairs`), PEFT's lora_A [r, in] and lora_B [out, r] are their
transposes (`peft_pairs`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from train.adapter_files.lora_error import LoraFileError
from train.run_config import options

FLOAT32_MAX = float(np.finfo(np.float32).max)
REMEDY = "the adapter was edited or not written by a LoRA trainer: use the file prepack train wrote, or retrain"


@dataclasses.dataclass(frozen=True)
class FactorPair:
    """One adapted weight's factors as matrices: the update is a @ b (times alpha / r)."""

    name: str  # the tensor a refusal names (B's: the factor that carries the update's size)
    a: np.ndarray  # [in, r]
    b: np.ndarray  # [r, out]


def qwix_pairs(tensors: Mapping[str, Any]) -> list[FactorPair]:
    """qwix's `<path>_lora_a` [..., in, r] and `<path>_lora_b` [r, ...] (a prepack file, a checkpoint)."""
    pairs = []
    for name in sorted(tensors):
        if not name.endswith("_lora_b"):
            continue
        a = tensors.get(name[: -len("_lora_b")] + "_lora_a")
        if a is None:
            continue  # a half pair: the loader's own check of names and shapes says so
        a, b = np.asarray(a), np.asarray(tensors[name])
        if a.ndim and b.ndim:
            r = a.shape[-1]
            pairs.append(FactorPair(name, a.reshape(-1, r), b.reshape(b.shape[0], -1)))
    return pairs


def peft_pairs(factors: Mapping[str, tuple[np.ndarray, np.ndarray]], prefix: str = "") -> list[FactorPair]:
    """PEFT's {module: (lora_A [r, in], lora_B [out, r])}, named as the file names lora_B."""
    return [FactorPair(f"{prefix}{module}.lora_B.weight", np.asarray(la).T, np.asarray(lb).T)
            for module, (la, lb) in sorted(factors.items())]


def parsed_metadata(text: Any) -> Any:
    """A safetensors metadata value (a string; JSON for non-strings, as the writers store them) as
    the value it stands for; a string that is no JSON stays the string (and is refused as one)."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def check_alpha(value: Any, where: str, field: str, remedy: str = REMEDY) -> float:
    """alpha, or LoraFileError naming `where` (the file) and `field`."""
    problem = options.lora_alpha_problem(value)
    if problem:
        raise LoraFileError(f"{where}: {field} {problem}; {remedy}")
    return float(value)


def check_rank(value: Any, where: str, field: str, remedy: str = REMEDY) -> int:
    problem = options.lora_rank_problem(value)
    if problem:
        raise LoraFileError(f"{where}: {field} {problem}; {remedy}")
    return int(value)


def _largest(x: np.ndarray) -> float:
    return float(np.max(np.abs(x.astype(np.float64)))) if x.size else 0.0


def check_update(pairs: Iterable[FactorPair], alpha: float, rank: int, *, tensors_at: str, rank_at: str,
                 remedy: str = REMEDY) -> None:
    """Every pair of rank `rank` (`rank_at` says where the rank was read: "path: r"), and alpha / r * B,
    alpha / r * B @ A finite in float32; else one line naming the tensor in `tensors_at` (its file)."""
    scale = alpha / rank
    for pair in pairs:
        if pair.a.shape[-1] != rank or pair.b.shape[0] != rank:
            raise LoraFileError(f"{rank_at} is {rank:,}, but tensor {pair.name} in {tensors_at} has rank {pair.b.shape[0]:,} "
                                f"(A {tuple(pair.a.shape)}, B {tuple(pair.b.shape)}); {remedy}")
        a_max, b_max = _largest(pair.a), _largest(pair.b)
        if scale * b_max > FLOAT32_MAX:
            raise LoraFileError(f"{tensors_at}: tensor {pair.name} times alpha / r = {scale:g} overflows float32 "
                                f"(|value| up to {b_max:.3g}); {remedy}")
        if scale * rank * a_max * b_max <= FLOAT32_MAX:
            continue  # no entry of the product can be larger: the bound shows it finite
        update = scale * np.abs(pair.a.astype(np.float64) @ pair.b.astype(np.float64))
        largest = float(np.max(update)) if update.size else 0.0
        if not largest <= FLOAT32_MAX:
            raise LoraFileError(f"{tensors_at}: tensor {pair.name}: the update alpha / r * B @ A overflows float32 "
                                f"(|value| up to {largest:.3g}, alpha / r = {scale:g}); {remedy}")


def check(alpha: Any, rank: Any, pairs: Iterable[FactorPair], *, config_at: str, tensors_at: str, alpha_field: str,
          rank_field: str, remedy: str = REMEDY) -> tuple[float, int]:
    """(alpha, rank) of an adapter read back, every value checked (see the module's note); else one line
    naming the file (`config_at`: where alpha and rank were read; `tensors_at`: the tensors') and the field."""
    alpha = check_alpha(alpha, config_at, alpha_field, remedy)
    rank = check_rank(rank, config_at, rank_field, remedy)
    check_update(pairs, alpha, rank, tensors_at=tensors_at, rank_at=f"{config_at}: {rank_field}", remedy=remedy)
    return alpha, rank


def prepack_file_scale(meta: Mapping[str, str], tensors: Mapping[str, Any], path: str) -> tuple[float, int]:
    """(alpha, rank) of a prepack LoRA file (train/adapter_files/lora_file.py), checked: its metadata's
    `lora_rank` and `lora_alpha` (stored as JSON text; a missing alpha is qwix's default, 2 x rank)
    against its qwix factors."""
    if "lora_rank" not in meta:
        raise LoraFileError(f"{path}: metadata names no lora_rank; {REMEDY}")
    rank = check_rank(parsed_metadata(meta["lora_rank"]), path, "metadata lora_rank")
    alpha = parsed_metadata(meta["lora_alpha"]) if "lora_alpha" in meta else 2.0 * rank
    return check(alpha, rank, qwix_pairs(tensors), config_at=path, tensors_at=path, alpha_field="metadata lora_alpha",
                 rank_field="metadata lora_rank")
