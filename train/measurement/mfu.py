"""Tokens per second per chip and MFU, for each step's metrics row and the summary.

MFU = the batch's model FLOPs (train/measurement/flops.model_flops: forward and backward of its real tokens,
attention at the same-segment causal ideal, no recomputation) / the step's wall time / (the
chips' count x one chip's dense bfloat16 peak). A "chip" is one JAX device of this process
(a TPU v4/v5p chip in megacore mode, a v5e/v6e chip, one GPU). The peak comes from the table
below by the device kind JAX reports, or from --peak-tflops; where neither knows it (a CPU),
`mfu` is null, never missing.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

# Dense (not sparse) bfloat16 TFLOP/s per JAX device, from the vendors' published peaks:
# Cloud TPU system architecture pages (v4 275, v5e 197, v5p 459, v6e 918 per chip) and NVIDIA's
# datasheets (the "with sparsity" figures halved). Matched on the whole device kind (TPUs, as
# JAX names them) or on a word of it (GPUs: "NVIDIA H100 80GB HBM3"); first match wins.
TPU_PEAK_TFLOPS = {
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0, "TPU v5e": 197.0,
    "TPU v5": 459.0, "TPU v5p": 459.0,
    "TPU v6 lite": 918.0, "TPU v6e": 918.0,
}
GPU_PEAK_TFLOPS = (
    (r"\bB200\b", 2250.0),
    (r"\bH200\b", 989.4), (r"\bGH200\b", 989.4),
    (r"\bH100\b.*\bPCIe\b", 756.0), (r"\bH100\b.*\bNVL\b", 835.0), (r"\bH100\b", 989.4),
    (r"\bA100\b", 312.0),
    (r"\bL40S\b", 362.1), (r"\bL4\b", 121.0),
)


def peak_tflops(device_kind: str, override: float | None = None) -> tuple[float | None, str]:
    """(TFLOP/s per chip or None, where it came from)."""
    if override is not None:
        return float(override), "--peak-tflops"
    if device_kind in TPU_PEAK_TFLOPS:
        return TPU_PEAK_TFLOPS[device_kind], f"table ({device_kind})"
    for pattern, tflops in GPU_PEAK_TFLOPS:
        if re.search(pattern, device_kind):
            return tflops, f"table ({device_kind})"
    return None, f"unknown for {device_kind!r} (give --peak-tflops)"


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What the per-step fields need besides the step: the model's cost, the chips, their peak."""

    cost: Any = None  # train.measurement.flops.ModelCost; None: no FLOP count, mfu null
    chips: int = 1
    peak_tflops: float | None = None
    extra_forwards: int = 0  # the objective's forward passes beside the policy's (train/objectives/)

    def batch_flops(self, batch: Mapping[str, Any]) -> float | None:
        if self.cost is None:
            return None
        from train.measurement import flops

        seg = batch["segment_ids"]  # [B, L], or [B, K, L] with --grad-accum-steps: rows either way
        return flops.model_flops(self.cost, seg.reshape(-1, seg.shape[-1]), self.extra_forwards)

    def fields(self, tokens: float, seconds: float, model_flops: float | None) -> dict[str, float | None]:
        """`tokens_per_s_per_chip` and `mfu` of `tokens` real tokens and `model_flops` done in `seconds`."""
        per_chip = tokens / seconds / self.chips if seconds > 0 else 0.0
        mfu = None
        if self.peak_tflops and model_flops is not None and seconds > 0:
            mfu = model_flops / seconds / (self.chips * self.peak_tflops * 1e12)
        return {"tokens_per_s_per_chip": per_chip, "mfu": mfu}


def for_run(model: Any, device_kind: str, chips: int, override: float | None,
            extra_forwards: int = 0) -> tuple[Throughput, dict[str, Any]]:
    """The run's Throughput and the summary facts about it (peak and its source, chips);
    extra_forwards: the objective's (train/objectives/)."""
    from train.measurement import flops

    peak, source = peak_tflops(device_kind, override)
    facts = {"peak_tflops": peak, "peak_tflops_source": source, "chips": chips}
    return Throughput(flops.model_cost(model), chips, peak, extra_forwards), facts
