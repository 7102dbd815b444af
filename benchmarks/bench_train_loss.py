"""Our masked loss vs Tunix 0.1.7's default SFT loss, on the loss alone: value, gradient, memory, time.

Tunix's default builds a float32 one-hot [B, L-1, V] and a full log_softmax; ours gathers
the target logit (take_along_axis) and subtracts a float32 logsumexp. At Gemma3's
262,144-token vocabulary the [B, L, V] buffers are what the loss costs, so this
measures value_and_grad with respect to the logits, jitted, for both:
- equality of the loss value and of the gradient;
- XLA's planned temporary memory (compiled.memory_analysis());
- median wall time of the compiled function.

    python -m benchmarks.bench_train_loss [--batch-size 4 --max-length 256 --vocab 262144 --dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--vocab", type=int, default=262_144)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the logits")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from train.step import loss as loss_lib
    from testkit import train_batches as testing
    from train.measurement.compiled import fmt_bytes, memory_of

    b, l, v = args.batch_size, args.max_length, args.vocab
    rng = np.random.default_rng(0)
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    logits = jnp.asarray(rng.standard_normal((b, l, v), dtype=np.float32) * 3, dtype)
    tokens = jnp.asarray(rng.integers(0, v, (b, l)), jnp.int32)
    mask = jnp.asarray(rng.random((b, l)) < 0.6, jnp.int32)
    losses = {"ours (masked, take_along_axis)": loss_lib.masked_loss_fn, "tunix default (one-hot)": loss_lib.tunix_default_loss_fn()}

    rows, values = [], {}
    for name, fn in losses.items():
        f = jax.jit(jax.value_and_grad(lambda lg, fn=fn: fn(testing.FixedLogits(lg), tokens, mask, None, None)))
        start = time.perf_counter()
        compiled = f.lower(logits).compile()
        mem = memory_of(compiled, time.perf_counter() - start)
        value, grad = compiled(logits)
        jax.block_until_ready(grad)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(logits))
            times.append(time.perf_counter() - start)
        values[name] = (float(value), np.asarray(grad, np.float32))
        rows.append((name, mem, statistics.median(times), min(times), max(times)))

    logits_bytes = b * l * v * jnp.dtype(dtype).itemsize
    print(f"\n## Loss alone: value_and_grad w.r.t. {args.dtype} logits [B={b}, L={l}, V={v:,}] "
          f"({fmt_bytes(logits_bytes)}), {jax.default_backend()} ({jax.devices()[0].device_kind})\n")
    print("| loss | value | temp memory | temp / logits | outputs (incl. the logits' gradient) | time median (min-max) |")
    print("|---|---|---|---|---|---|")
    for name, mem, med, lo, hi in rows:
        print(f"| {name} | {values[name][0]:.6f} | {fmt_bytes(mem.temp_bytes)} | {mem.temp_bytes / logits_bytes:.2f} | "
              f"{fmt_bytes(mem.output_bytes)} | "
              f"{med * 1e3:.0f} ms ({lo * 1e3:.0f}-{hi * 1e3:.0f}) |")
    (n1, (v1, g1)), (n2, (v2, g2)) = values.items()
    print(f"\n|value diff| = {abs(v1 - v2):.2e} (relative {abs(v1 - v2) / abs(v2):.1e}), max |grad diff| = {np.max(np.abs(g1 - g2)):.2e}")
    print(f"temp saved: {fmt_bytes(rows[1][1].temp_bytes - rows[0][1].temp_bytes)}; "
          f"time ratio default/ours: {rows[1][2] / rows[0][2]:.2f}x")
    print("\ncommand: " + " ".join([sys.executable, *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
