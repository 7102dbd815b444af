"""The chunked loss's head work before and after targets-first chunks and the fused head VJP, on real rows.

Before (testkit.reference.checkpointed_chunked_token_nll, the loss at 90b4e18): every position
of the batch is projected onto the vocabulary, each chunk under jax.checkpoint: three [C, D] x
[D, V] matmuls per chunk (forward, recompute, backward). After (train/step/chunked_loss.py): targets
first, chunks without a target skipped, dL/dh computed in the forward pass: two per chunk that
holds a target. Rows are `prepack pack --sample` (the shipped 400-example Alpaca file, Gemma3's
tokenizer) at --max-length, packed and `--no-pack`; the batch is the first --batch-size rows
of each set. The hidden states are random (the head's cost does not depend on them), the head
is Gemma3 270M's shape (V 262,144, D 640, tied, bf16). Reported per layout: target fraction,
chunks with a target, the head FLOPs of a step's loss (analytic: XLA's cost analysis counts a
loop body once), and the CPU time of value_and_grad w.r.t. the hidden states, before and after,
interleaved in one process, with the loss and gradient difference.

    python -m benchmarks.bench_loss_skip                                 # L1024, B 4, chunk 1024
    python -m benchmarks.bench_loss_skip --max-length 2048 --batch-size 2 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--chunk", type=int, default=1024, help="--loss-chunk-tokens")
    p.add_argument("--hidden", type=int, default=640, help="D (Gemma3 270M: 640)")
    p.add_argument("--vocab", type=int, default=262_144, help="V (Gemma3: 262,144)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per variant after a warm-up, interleaved")
    p.add_argument("--work-dir", default=None, help="where the sample is packed (default: a temporary folder)")
    return p


def pack_sample(work: str, max_length: int) -> dict[str, str]:
    out = {}
    for layout, extra in (("packed", []), ("unpacked", ["--no-pack"])):
        folder = os.path.join(work, layout)
        if not os.path.exists(os.path.join(folder, f"L{max_length}", "manifest.json")):
            subprocess.run([sys.executable, "-m", "apps.cli", "pack", "--sample", "--output", folder, "--max-length",
                            str(max_length), "--overwrite", *extra], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out[layout] = os.path.join(folder, f"L{max_length}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import loaders
    from testkit.reference import checkpointed_chunked_token_nll
    from train.step import loss as loss_lib
    from train.step.chunked_loss import Projection, chunked_token_nll

    work = args.work_dir or tempfile.mkdtemp(prefix="bench_loss_skip_")
    sets = pack_sample(work, args.max_length)
    rng = np.random.default_rng(0)
    d, v, c = args.hidden, args.vocab, args.chunk
    projection = Projection(jnp.asarray(rng.normal(scale=0.02, size=(v, d)), jnp.bfloat16), True, jnp.bfloat16)
    rows_b, length = args.batch_size, args.max_length
    h = jnp.asarray(rng.normal(size=(rows_b, length, d)), jnp.bfloat16)
    matmul = 2 * c * d * v

    results = {}
    for layout, path in sets.items():
        view = loaders.open_shards(path)
        rows = [view[i] for i in range(rows_b)]
        batch = {k: np.stack([r[k] for r in rows]) for k in ("input_ids", "loss_mask")}
        targets, weights = loss_lib.shifted_targets(jnp.asarray(batch["input_ids"]), jnp.asarray(batch["loss_mask"]))
        n = rows_b * length
        chunks = -(-n // c)
        active = int(np.count_nonzero(np.asarray(weights)))
        with_target = -(-active // c)

        def make(before: bool):
            def loss(hidden):
                if before:
                    nll = checkpointed_chunked_token_nll(hidden, projection, targets, c)
                else:
                    nll = chunked_token_nll(hidden, projection, targets, c, weights)
                return jnp.sum(nll * weights) / jnp.sum(weights)
            return jax.jit(jax.value_and_grad(loss)).lower(h).compile()

        fns = {"before": make(True), "after": make(False)}
        out = {k: jax.block_until_ready(f(h)) for k, f in fns.items()}  # warm-up, not timed
        times = {k: [] for k in fns}
        for _ in range(args.repeats):
            for k, f in fns.items():
                started = time.perf_counter()
                jax.block_until_ready(f(h))
                times[k].append(time.perf_counter() - started)
        dl = abs(float(out["after"][0]) - float(out["before"][0]))
        dg = float(jnp.max(jnp.abs(out["after"][1].astype(jnp.float32) - out["before"][1].astype(jnp.float32))))
        results[layout] = {"target_fraction": active / n, "chunks": chunks, "with_target": with_target,
                           "flops_before": 3 * chunks * matmul, "flops_after": 2 * with_target * matmul,
                           "t_before": statistics.median(times["before"]), "t_after": statistics.median(times["after"]),
                           "dl": dl, "dg": dg}

    print(f"\n## Chunked loss, head work before / after: B {rows_b} x L {length}, chunk {c}, D {d}, V {v:,}, bf16, "
          f"{jax.devices()[0].platform}, median of {args.repeats} interleaved calls of value_and_grad w.r.t. h\n")
    print("| rows | target fraction | chunks with a target | head FLOPs before | after | after / before | CPU s before | after | after / before | max diff loss / grad |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layout, r in results.items():
        print(f"| {layout} | {r['target_fraction']:.3f} | {r['with_target']} of {r['chunks']} | {r['flops_before']:.3e} | "
              f"{r['flops_after']:.3e} | {r['flops_after'] / r['flops_before']:.3f} | {r['t_before']:.3f} | {r['t_after']:.3f} | "
              f"{r['t_after'] / r['t_before']:.3f} | {r['dl']:.1e} / {r['dg']:.1e} |")
    print("\ncommand: " + " ".join(["python -m benchmarks.bench_loss_skip", *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
