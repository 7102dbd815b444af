"""XLA's planned memory for Tunix's own train step, read without running it.

`nnx.jit(trainer.create_train_step_fn()).lower(model, optimizer, batch).compile()`
compiles exactly the function PeftTrainer jits (gen_model_input_fn, loss, grads,
optimizer update) for a batch's shapes; `memory_analysis()` is what XLA plans
to allocate for it. `lower_trainers_step` lowers the trainer's own jitted step instead (its caller compiles it),
so that the loop's step 1 reuses the executable (`--remat auto`, `--plan-memory`). Used by the tests and benchmarks that compare packed with
unpacked batches (same shapes, so the same program) and our loss with Tunix's.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    hlo_fingerprint: str  # a hash of the optimized HLO: equal fingerprints = the same program
    compile_s: float

    @property
    def peak_estimate_bytes(self) -> int:
        """Arguments + outputs - donated aliases + temporaries (what the step holds at once, at most)."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["peak_estimate_bytes"] = self.peak_estimate_bytes
        return d


_DEBUG_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_METADATA = re.compile(r",? metadata=\{[^{}]*\}")


def program_text(compiled: Any) -> str:
    """The optimized HLO without debug info: source locations record the Python call site,
    which differs between two calls of the same program."""
    out, skipping = [], False
    for line in (compiled.as_text() or "").splitlines():
        if line.strip() in _DEBUG_SECTIONS:
            skipping = True
            continue
        if skipping:
            skipping = bool(line.strip())
            continue
        out.append(_METADATA.sub("", line))
    return "\n".join(out)


def memory_of(compiled: Any, compile_s: float = 0.0, fingerprint: bool = True) -> CompiledMemory:
    """fingerprint=False: no HLO text (printing a real model's program takes seconds; a plan needs none)."""
    import hashlib

    ma = compiled.memory_analysis()
    text = program_text(compiled) if fingerprint else ""
    return CompiledMemory(
        argument_bytes=int(ma.argument_size_in_bytes),
        output_bytes=int(ma.output_size_in_bytes),
        alias_bytes=int(ma.alias_size_in_bytes),
        temp_bytes=int(ma.temp_size_in_bytes),
        generated_code_bytes=int(ma.generated_code_size_in_bytes),
        hlo_fingerprint=hashlib.sha256(text.encode()).hexdigest()[:16] if fingerprint else "",
        compile_s=compile_s,
    )


def compile_train_step(trainer: Any, batch: Mapping[str, Any]) -> Any:
    """Compiles the trainer's train step for this batch (device fields only, as the trainer sends)."""
    from flax import nnx

    from train.step.model_inputs import device_fields
    from train.step.train_step import DONATED

    step = nnx.jit(trainer.create_train_step_fn(), donate_argnames=DONATED)
    return step.lower(trainer.model, trainer.optimizer, device_fields(batch)).compile()


def lower_trainers_step(trainer: Any, batch: Mapping[str, Any]) -> Any:
    """Lowers (traces, not compiles) the step the trainer's loop will call, for this batch's shapes: Tunix's own jitted
    step (`jit_train_and_eval_step`, as `train` makes it), with the batch sharded as Tunix shards
    one. JAX keeps the executable with that jit, so step 1, the same jit called on the same shapes,
    runs it without compiling again (tests/test_train_compile_once.py counts the compiles).

    The trainer's step holds a copy of the model's graph taken here: after a change of the
    model's structure (remat, attention) call `trainer.clear_jit_cache()` before compiling again."""
    from tunix.sft import sharding_utils

    from train.step.model_inputs import device_fields

    step, _ = trainer.jit_train_and_eval_step(cache_nnx_graph=True)  # PeftTrainer.train's default
    jitted = step.func.__wrapped__  # the nnx.jit under Tunix's nnx.cached_partial(jitted, model, optimizer)
    inputs = sharding_utils.shard_input(device_fields(batch), trainer.config.data_sharding_axis)
    return jitted.lower(trainer.model, trainer.optimizer, inputs)


def train_step_memory(trainer: Any, batch: Mapping[str, Any]) -> CompiledMemory:
    start = time.perf_counter()
    compiled = compile_train_step(trainer, batch)
    return memory_of(compiled, time.perf_counter() - start)


def flops_of(compiled: Any) -> float:
    """XLA's FLOP estimate of a compiled program (0 where the backend gives none)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", 0.0))


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"
