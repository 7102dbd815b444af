"""`--lr-schedule constant|cosine|linear|wsd` with warmup: the learning rate per optimizer step, as optax schedules.

Every schedule warms up linearly from 0 to `--learning-rate` over the warmup steps (none by
default), then:
- constant: stays there (the default, as before this option existed);
- cosine: decays along a half cosine to `--min-lr-ratio` x the peak at `--steps` (optax's
  `warmup_cosine_decay_schedule`: Tunix's CLI, MaxText and TRL recipes);
- linear: decays linearly to the same floor at `--steps`;
- wsd (warmup-stable-decay): stays at the peak, then decays linearly to the floor over the last
  `WSD_DECAY_FRACTION` of the steps (MaxText's default decay fraction).

The schedule is a function of the optimizer's update count, which lives in the optimizer state
(`optax.inject_hyperparams`): a checkpoint restores it, so a resumed run continues the same
curve. `--steps` is part of the curve for every schedule but constant, so a resume must keep it
(train/checkpointing/resume.py's identity). Counts start at 0: the first update uses schedule(0), which is 0
during warmup, as in optax and Hugging Face's schedules.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from train.run_config.config import TrainError
from train.run_config.options import float32_problem

CONSTANT, COSINE, LINEAR, WSD = "constant", "cosine", "linear", "wsd"
SCHEDULES = (CONSTANT, COSINE, LINEAR, WSD)
WSD_DECAY_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class ScheduleSpec:
    """What the learning rate of each optimizer step is, resolved from the flags."""

    kind: str
    peak: float
    warmup_steps: int
    min_lr_ratio: float
    total_steps: int

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share: total_steps only where the curve depends on it."""
        return {"kind": self.kind, "warmup_steps": self.warmup_steps, "min_lr_ratio": self.min_lr_ratio,
                "total_steps": None if self.kind == CONSTANT else self.total_steps}


def resolve(kind: str, learning_rate: float, steps: int, warmup_steps: int | None = None,
            warmup_ratio: float | None = None, min_lr_ratio: float = 0.0) -> ScheduleSpec:
    """Checks the schedule flags (one line each, before any weight loads) and resolves the warmup."""
    if kind not in SCHEDULES:
        raise TrainError(f"unknown --lr-schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    if not (math.isfinite(learning_rate) and learning_rate > 0):
        raise TrainError(f"--learning-rate must be a positive number, got {learning_rate}")
    problem = float32_problem("--learning-rate", learning_rate)  # 1e300: inf in the optimizer, every LoRA value inf
    if problem:
        raise TrainError(problem)
    if warmup_steps is not None and warmup_ratio is not None:
        raise TrainError("give --warmup-steps or --warmup-ratio, not both")
    if warmup_ratio is not None:
        if not (math.isfinite(warmup_ratio) and 0 <= warmup_ratio < 1):
            raise TrainError(f"--warmup-ratio must be in [0, 1), got {warmup_ratio}")
        warmup_steps = int(round(warmup_ratio * steps))
    warmup_steps = warmup_steps or 0
    if warmup_steps < 0 or (warmup_steps and warmup_steps >= steps):
        raise TrainError(f"--warmup-steps must be from 0 to --steps - 1 ({steps - 1}), got {warmup_steps}")
    if not (math.isfinite(min_lr_ratio) and 0 <= min_lr_ratio <= 1):
        raise TrainError(f"--min-lr-ratio must be in [0, 1], got {min_lr_ratio}")
    return ScheduleSpec(kind, float(learning_rate), int(warmup_steps), float(min_lr_ratio), int(steps))


def make_schedule(spec: ScheduleSpec) -> Any:
    """The optax schedule: step count (0-based) -> learning rate."""
    import optax

    peak, warmup, total = spec.peak, spec.warmup_steps, spec.total_steps
    floor = peak * spec.min_lr_ratio
    if spec.kind == COSINE:
        # decay_steps counts the warmup too (optax's convention): the floor is reached at --steps.
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total, warmup + 1), floor)
    parts, boundaries = [], []
    if warmup:
        parts.append(optax.linear_schedule(0.0, peak, warmup))
        boundaries.append(warmup)
    if spec.kind == CONSTANT:
        parts.append(optax.constant_schedule(peak))
    elif spec.kind == LINEAR:
        parts.append(optax.linear_schedule(peak, floor, max(total - warmup, 1)))
    else:  # WSD: stable until the decay window, then linear to the floor at --steps
        decay = max(1, int(round(WSD_DECAY_FRACTION * total)))
        stable = max(total - warmup - decay, 0)
        parts.append(optax.constant_schedule(peak))
        boundaries.append(warmup + stable)
        parts.append(optax.linear_schedule(peak, floor, decay))
    return parts[0] if len(parts) == 1 else optax.join_schedules(parts, boundaries)
