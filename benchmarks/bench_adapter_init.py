"""The adapters' initialisation trace: qwix's keys from nnx's own stream against `models.KeysInOrder`.

Every `prepack train`, `verify --model` and `generate` run adds LoRA adapters under one `nnx.jit`
(train/model/models.py `apply_lora`). With a plain `nnx.Rngs`, each of qwix's key draws updates a
count Variable inside the trace, and each update builds one of JAX's tracer-origin messages,
which walks the whole trace so far. `KeysInOrder` draws the same keys counted in Python. Both
variants run here on the same model, alternating, in one process; the figure is JAX's own trace
time of `jit(add_adapters)` (the `/jax/core/compile/jaxpr_trace_duration` event), each sample
kept (`trace_s`) beside the medians.

    python -m benchmarks.bench_adapter_init [--model gemma3-270m] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
VARIANTS = ("nnx.Rngs", "KeysInOrder")


def traced(apply: Callable[[], Any]) -> tuple[float, Any]:
    """(JAX's trace time of the one jit `apply` traces, the adapters' `add_adapters`; what it returns)."""
    import jax

    seen: list[float] = []
    listener = lambda event, duration, **_: seen.append(duration) if event == TRACE_EVENT else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        result = apply()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return max(seen), result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m", help="a model of train/model/models.py (random weights)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="traces per variant, alternating")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    import jax
    from flax import nnx

    from benchmarks.device_machine import machine
    from train.model import models

    built = models.build_model(args.model, weights="random", seed=0)
    rngs_of = {"nnx.Rngs": lambda seed: nnx.Rngs(params=seed), "KeysInOrder": models.traced_rngs}
    real = models.traced_rngs
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    leaves: dict[str, list[Any]] = {}
    try:
        for _ in range(args.repeats):
            for variant in VARIANTS:
                models.traced_rngs = rngs_of[variant]
                base = nnx.clone(built.model)
                seconds, adapted = traced(lambda: models.apply_lora(base, built.spec, rank=args.rank))
                times[variant].append(seconds)
                leaves[variant] = jax.tree.leaves(nnx.state(adapted, nnx.LoRAParam))
    finally:
        models.traced_rngs = real
    same = len(leaves["nnx.Rngs"]) == len(leaves["KeysInOrder"]) > 0 and all(
        bool((a == b).all()) for a, b in zip(leaves["nnx.Rngs"], leaves["KeysInOrder"]))
    medians = {v: statistics.median(t) for v, t in times.items()}
    result = {"model": args.model, "rank": args.rank, "adapters": len(leaves["KeysInOrder"]), "trace_s": times,
              "median_trace_s": medians, "ratio": medians["nnx.Rngs"] / medians["KeysInOrder"],
              "same_adapters": same, "machine": machine(),
              "command": " ".join(["python -m benchmarks.bench_adapter_init", *(argv if argv is not None else sys.argv[1:])])}
    for v in VARIANTS:
        print(f"{v}: the adapters' trace {medians[v]:.2f} s (median of {args.repeats})")
    print(f"nnx.Rngs / KeysInOrder: {result['ratio']:.2f}x; the same adapters: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
