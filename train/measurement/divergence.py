"""What a run does when its loss or gradient norm stops being finite (`--nan-policy`).

- stop (default): the run ends at the first non-finite step (its loss, its gradient norm, or the
  LoRA values its update made: finite gradients times a learning rate can still overflow them) with a
  non-zero exit (3) and one line naming the step. Tunix saves a checkpoint after the step's post-processing, so raising
  there means that step is never saved. With --save-lora, the adapter saved is the last finite
  one: the LoRA values copied at the last fetch that found every step finite (the trainer's
  `last_finite`), and the line names its step; none is saved when no step was fetched finite
  before the divergence (and lora_file.save_lora refuses non-finite values anyway). The metrics JSONL keeps the step's
  record and its summary line says why the run stopped.
- skip-step: the optimizer is wrapped in optax.apply_if_finite (train/step/optimizer.py), so an
  update with non-finite gradients is not applied; the step is recorded as skipped and the
  summary counts them. This is what other trainers offer as "skip the bad batch" (e.g. dynamic
  loss scaling's skipped steps).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from train.run_config.config import TrainError

STOP = "stop"
SKIP_STEP = "skip-step"
NAN_POLICIES = (STOP, SKIP_STEP)
EXIT_DIVERGED = 3


class Diverged(TrainError):
    """The loss or gradient norm became non-finite under --nan-policy stop."""

    def __init__(self, step: int, reason: str, saved: str | None = None):
        self.step, self.reason = step, reason
        kept = f"this step's checkpoint; {saved}" if saved else "this step's checkpoint or a LoRA file"
        super().__init__(
            f"step {step}: {reason}; training stopped (--nan-policy stop) without saving {kept}. Try a lower "
            "--learning-rate or --dtype float32, or --nan-policy skip-step to skip such steps"
        )


def nonfinite_reason(values: Mapping[str, Any], lora_finite: Any = None) -> str | None:
    """'loss is nan, gradient norm is inf' for the non-finite ones among {"loss", "grad_norm"}; when both
    are finite, the LoRA values after the update if `lora_finite` (the step's own check) is false; None
    if all are finite."""
    labels = {"loss": "loss", "grad_norm": "gradient norm"}
    bad = [f"{labels[k]} is {float(v)}" for k, v in values.items() if v is not None and not math.isfinite(float(v))]
    if not bad and lora_finite is not None and not bool(lora_finite):  # a non-finite gradient says why already
        bad.append("the LoRA values after the update are non-finite")
    return ", ".join(bad) if bad else None


def check_policy(policy: str) -> None:
    if policy not in NAN_POLICIES:
        raise TrainError(f"--nan-policy {policy!r}: choose {' or '.join(NAN_POLICIES)}")


def finite_or_none(value: Any) -> float | None:
    """JSON has no NaN: non-finite numbers are written as null (the record says why)."""
    value = float(value)
    return value if math.isfinite(value) else None
