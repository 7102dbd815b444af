"""The ranges of `prepack train`'s whole-number options: one table, checked while the command line is
parsed and again on a TrainConfig (a library caller's), before any weight loads.

Why each bound: steps and step counts fit optax's and Tunix's int32 step counters; a seed is one
Grain's shuffle takes (0 to 2^32 - 1; jax and numpy take those too); read threads and fake CPU
devices are threads and devices this host would start. A value outside its range is refused in one
line that shows it bounded (a 5,000-digit --steps is not echoed whole, and int() is never asked to
convert it: Python refuses strings of more than 4,300 digits with a traceback of its own).

The real-valued options the step computes with in float32 (the learning rate, clipping, DPO's beta)
must stay finite and non-zero there too (`float32_problem`): 1e300 is finite to Python and inf to the
optimizer, whose first update then makes every LoRA value inf. LoRA's alpha has one rule for the
flag and for every adapter read back (`lora_alpha_problem`, `lora_rank_problem`: a PEFT folder's
adapter_config.json, a prepack file's metadata, a checkpoint's run.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from prepack.hostile_input.untrusted import shown, shown_with_type
from train.run_config.config import TrainConfig, TrainError

MAX_STEPS = 2**31 - 1  # optax's update count and Tunix's step are int32
MAX_SEED = 2**32 - 1  # grain.MapDataset.shuffle: "Seed must be an integer between 0 and 2**32-1"
MAX_READ_THREADS = 1024
MAX_CPU_DEVICES = 4096
MAX_COUNT = 2**31 - 1  # any other count of rows or things (shapes are int32-indexed on the device)
# LoRA's alpha: the adapter's update is alpha / r * B @ A. Trained adapters use alphas of 1 to a few
# thousand (PEFT's default 8, rsLoRA's alpha / sqrt(r) scales of the same order); an alpha of a
# million already scales an update by 10^6 per rank, and past it a factor of ordinary size makes an
# update that float32 cannot hold, so a larger alpha is a corrupt or hand-edited file, not a choice.
MAX_LORA_ALPHA = 1e6


@dataclasses.dataclass(frozen=True)
class Count:
    """A whole-number option: its flag, the TrainConfig field, and its range (both ends included)."""

    flag: str
    field: str
    low: int
    high: int
    meaning: str = ""  # what a special low value means, said in the refusal (e.g. "0: at the end only")

    def problem(self, value: Any) -> str | None:
        if value is None or (type(value) is int and self.low <= value <= self.high):
            return None
        what = f" ({self.meaning})" if self.meaning else ""
        return f"{self.flag} must be a whole number from {self.low:,} to {self.high:,}{what}, got {shown(value)}"


COUNTS: tuple[Count, ...] = (
    Count("--steps", "steps", 1, MAX_STEPS),
    Count("--batch-size", "batch_size", 1, MAX_COUNT),
    Count("--grad-accum-steps", "grad_accum_steps", 1, MAX_COUNT),
    Count("--seed", "seed", 0, MAX_SEED),
    Count("--lora-rank", "lora_rank", 1, MAX_COUNT),
    Count("--warmup-steps", "warmup_steps", 0, MAX_STEPS),
    Count("--read-threads", "read_threads", 0, MAX_READ_THREADS, "0: read on the training thread"),
    Count("--log-every", "log_every", 0, MAX_STEPS, "0: fetch at the end only"),
    Count("--eval-every", "eval_every", 1, MAX_STEPS),
    Count("--eval-batches", "eval_batches", 1, MAX_COUNT),
    Count("--checkpoint-every", "checkpoint_every", 1, MAX_STEPS),
    Count("--checkpoint-keep", "checkpoint_keep", 1, MAX_COUNT),
    Count("--eval-generate-every", "eval_generate_every", 1, MAX_STEPS),
)
# Bounded while parsing only: on a TrainConfig their own modules judge them (the memory path's
# tile and chunk rules, QLoRA's tile against the model's widths), and --cpu-devices is no field.
PARSED_ONLY: tuple[Count, ...] = (
    Count("--loss-chunk-tokens", "loss_chunk_tokens", 0, MAX_COUNT, "0: full logits"),
    Count("--attention-tile", "attention_tile", 1, MAX_COUNT),
    Count("--qlora-tile-size", "qlora_tile_size", 1, MAX_COUNT),
    Count("--cpu-devices", "cpu_devices", 1, MAX_CPU_DEVICES),
)
BY_FLAG: Mapping[str, Count] = {c.flag: c for c in COUNTS + PARSED_ONLY}

_WHOLE = re.compile(r"^\s*[+-]?\d+\s*$")
_MAX_DIGITS = 30  # more digits than any bound above has: out of range without converting


def whole_number(flag: str) -> Callable[[str], int]:
    """argparse type of a whole-number option: the value, or a refusal that shows it bounded."""
    count = BY_FLAG[flag]

    def parse(text: str) -> int:
        digits = text.strip().lstrip("+-")
        if not _WHOLE.match(text):
            problem = count.problem(text)  # not a number: refused, shown bounded
        elif len(digits) > _MAX_DIGITS:
            problem = count.problem(text).replace(f"got {shown(text)}", f"got a number of {len(digits):,} digits")
        else:
            value = int(text, 10)
            problem = count.problem(value)
            if problem is None:
                return value
        # argparse prefixes "argument --flag: "; the message names the flag itself too.
        raise argparse.ArgumentTypeError(str(problem).removeprefix(f"{flag} "))

    parse.__name__ = "whole number"  # argparse's fallback wording, should a ValueError escape
    return parse


def check_counts(cfg: TrainConfig) -> None:
    """Every whole-number option of a TrainConfig in its range (None: the option's default), else one line."""
    for count in COUNTS:
        problem = count.problem(getattr(cfg, count.field))
        if problem:
            raise TrainError(problem)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def in_float32(value: float) -> float:
    """`value` as float32 holds it: inf past 3.4e38, 0 below 1.4e-45."""
    with np.errstate(over="ignore", under="ignore"):
        return float(np.float32(value))


def float32_problem(flag: str, value: float) -> str | None:
    """Why a finite real option is unusable in float32 (the dtype the step computes it in), or None."""
    as32 = in_float32(value)
    if not math.isfinite(as32):
        return f"{flag} {value:g} is {as32} in float32, the dtype the step computes in; give at most {np.finfo(np.float32).max:.3g}"
    if value and not as32:
        return f"{flag} {value:g} is 0 in float32, the dtype the step computes in; give at least {np.finfo(np.float32).smallest_normal:.3g}"
    return None


def lora_alpha_problem(value: Any) -> str | None:
    """Why `value` cannot be a LoRA alpha, or None: a number (not a bool, not a string), above 0 and at
    most MAX_LORA_ALPHA (NaN and inf are neither; a huge int is compared without conversion)."""
    if not _is_number(value):
        return f"is {shown_with_type(value)}, not a number"
    if not 0 < value <= MAX_LORA_ALPHA:
        return (f"is {shown(value)}: a LoRA alpha is a number above 0 and at most {MAX_LORA_ALPHA:,.0f} (the adapter's "
                "update is alpha / r * B @ A)")
    return None


def lora_rank_problem(value: Any) -> str | None:
    """Why `value` cannot be a LoRA rank, or None: a whole number (not a bool) from 1 to MAX_COUNT."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return f"is {shown_with_type(value)}, not a whole number"
    if not 1 <= value <= MAX_COUNT:
        return f"is {shown(value)}: a LoRA rank is a whole number from 1 to {MAX_COUNT:,}"
    return None


def check_reals(cfg: TrainConfig) -> None:
    """The real-valued options without a check of their own elsewhere: LoRA's alpha, and the
    float32 range of the ones the step computes with (the learning rate's own range: schedule.py)."""
    alpha = cfg.lora_alpha
    if alpha is not None and lora_alpha_problem(alpha):
        raise TrainError(f"--lora-alpha must be a number above 0 and at most {MAX_LORA_ALPHA:,.0f} (the adapter's scale "
                         f"is alpha / rank), got {shown(alpha)}")
    for flag, value in (("--max-grad-norm", cfg.max_grad_norm), ("--beta", cfg.beta)):
        if _is_number(value) and math.isfinite(value):
            problem = float32_problem(flag, value)
            if problem:
                raise TrainError(problem)
