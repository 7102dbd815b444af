"""`--loss-chunk-tokens N`: CPU time and planned memory of the loss alone, against full logits.

The chunked loss (train/step/chunked_loss.py) trades memory for loop steps: one chunk's [N, V]
logits at a time, recomputed in the backward pass. This times value_and_grad of the masked
token-mean loss with respect to the final hidden states (what a LoRA step backpropagates
through), jitted, at each N and at N = 0 (full [B*L, V] logits, the reference), in one process
and interleaved, on Gemma3 270M's shape (D 640, V 262,144, the tied bf16 embedding). It
reports each N's median time and XLA's planned temporary memory, both as ratios to N = 0,
and checks that every N gives the reference's loss and gradient.

    python -m benchmarks.bench_loss_chunk                        # 4,096 tokens, N 256..4096
    python -m benchmarks.bench_loss_chunk --tokens 8192 --chunks 512,1024,2048
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="B * L positions in the step")
    p.add_argument("--hidden", type=int, default=640, help="D (Gemma3 270M: 640)")
    p.add_argument("--vocab", type=int, default=262_144, help="V (Gemma3: 262,144)")
    p.add_argument("--chunks", default="256,512,1024,2048,4096", help="N,N,...; 0 (full logits) always runs")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per N after the compile, interleaved")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from train.measurement.compiled import fmt_bytes, memory_of
    from train.step.chunked_loss import Projection, chunked_token_nll

    rng = np.random.default_rng(0)
    n, d, v = args.tokens, args.hidden, args.vocab
    h = jnp.asarray(rng.normal(size=(1, n, d)), jnp.bfloat16)
    projection = Projection(jnp.asarray(rng.normal(scale=0.02, size=(v, d)), jnp.bfloat16), True, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, v, size=(1, n)), jnp.int32)
    weights = jnp.asarray(rng.random(size=(1, n)) < 0.7, jnp.float32)  # about a packed row's target density

    def loss_at(chunk: int):
        def loss(hidden):
            if chunk == 0:
                logits = projection.logits(hidden).astype(jnp.float32)
                target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
                nll = jax.nn.logsumexp(logits, axis=-1) - target
            else:
                nll = chunked_token_nll(hidden, projection, targets, chunk)
            return jnp.sum(nll * weights) / jnp.sum(weights)
        return jax.jit(jax.value_and_grad(loss))

    chunks = [0] + [int(c) for c in args.chunks.split(",") if int(c) > 0]
    fns, temp, times, results = {}, {}, {c: [] for c in chunks}, {}
    for c in chunks:
        fns[c] = loss_at(c).lower(h).compile()  # one compile: its memory plan, then the calls
        temp[c] = memory_of(fns[c]).temp_bytes
        results[c] = jax.block_until_ready(fns[c](h))  # a warm-up run, not timed
    for _ in range(args.repeats):
        for c in chunks:
            started = time.perf_counter()
            jax.block_until_ready(fns[c](h))
            times[c].append(time.perf_counter() - started)

    ref_loss, ref_grad = results[0]
    print(f"\n## Loss alone, value_and_grad w.r.t. hidden states: {n:,} tokens, D {d}, V {v:,}, bf16 projection, "
          f"{jax.devices()[0].platform}, median of {args.repeats} interleaved calls\n")
    print("| --loss-chunk-tokens | temp | temp / full | time (s) | time / full | max abs diff loss / grad |")
    print("|---|---|---|---|---|---|")
    full_t, full_m = statistics.median(times[0]), temp[0]
    for c in chunks:
        t, m = statistics.median(times[c]), temp[c]
        loss, grad = results[c]
        dl = abs(float(loss) - float(ref_loss))
        dg = float(jnp.max(jnp.abs(grad.astype(jnp.float32) - ref_grad.astype(jnp.float32))))
        print(f"| {c or '0 (full logits)'} | {fmt_bytes(m)} | {m / full_m:.3f} | {t:.3f} | {t / full_t:.2f} | {dl:.1e} / {dg:.1e} |")
    print("\ncommand: " + " ".join(["python -m benchmarks.bench_loss_chunk", *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
