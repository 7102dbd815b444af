"""Attention work and CPU time, `--attention blocked` against `dense`, on packed rows of the shipped sample.

1. Work per step: the tile pairs blocked attention computes on every row of the packed sample
   (`prepack pack --sample`, Alpaca-like rows) at L 2048/4096/8192, counted from the rows'
   segment ids (train/blocked_attention.tile_work), against dense's L x L per row, and the
   FLOPs that implies for Gemma3 270M (4 heads of 256; 15 local layers with window 512, 3 global).
2. CPU time of the attention alone (forward + backward, Gemma3 270M's head shapes, one row,
   bf16) and of a whole train step of tiny Gemma3 (one row), blocked against dense,
   at L 4096 and 8192, on a typical packed row of the sample at each L: the row whose blocked
   tile work is the median (the first row is the atypical one: BFD opens rows with the longest
   examples, so it holds the fewest segments).

    python -m benchmarks.bench_attention [--lengths 2048,4096,8192] [--time-lengths 4096,8192] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

TILE = 512
HEADS, KV_HEADS, HEAD_DIM, WINDOW = 4, 1, 256, 512  # Gemma3 270M
LAYERS_LOCAL, LAYERS_GLOBAL = 15, 3


def packed_sample(lengths: list[int], out: str) -> dict[int, np.ndarray]:
    """The shipped sample packed at each L; returns every row's segment ids per L."""
    import loaders

    cmd = [sys.executable, "-m", "apps.cli", "pack", "--sample", "--output", out, "--overwrite", "--max-length", *map(str, lengths)]
    subprocess.run(cmd, check=True, capture_output=True)
    segs = {}
    for length in lengths:
        view = loaders.open_shards(os.path.join(out, f"L{length}"))
        segs[length] = np.stack([np.asarray(view[i]["segment_ids"]) for i in range(len(view))])
    return segs


def work_table(segs: dict[int, np.ndarray]) -> None:
    from train.blocked_attention import tile_work

    print("| L | rows | segments/row | tile pairs blocked (global / local) | dense pairs (L x L tiles) | blocked / dense | attention GFLOPs per row, blocked / dense |")
    print("|---|---|---|---|---|---|---|")
    for length, seg in segs.items():
        nq = length // TILE
        g, loc = tile_work(seg, TILE), tile_work(seg, TILE, WINDOW)
        rows = len(seg)
        dense_pairs = rows * nq * nq  # Tunix's dense attention computes every score of L x L
        blocked = LAYERS_GLOBAL * g.pairs_computed + LAYERS_LOCAL * loc.pairs_computed
        dense = (LAYERS_GLOBAL + LAYERS_LOCAL) * dense_pairs
        flops_per_pair = 4 * TILE * TILE * HEADS * HEAD_DIM  # q k^T and p v, 2 FLOPs per multiply-add, forward
        segments = float(np.mean([len(set(r[r > 0].tolist())) for r in seg]))
        print(f"| {length} | {rows} | {segments:.1f} | {g.pairs_computed / rows:.1f} / {loc.pairs_computed / rows:.1f} per row "
              f"| {nq * nq} per row | {blocked / dense:.3f} | {blocked * flops_per_pair / rows / 1e9:.1f} / "
              f"{dense * flops_per_pair / rows / 1e9:.1f} |", flush=True)


def typical_row(seg: np.ndarray) -> np.ndarray:
    """The row whose global-layer tile work is the median over the rows."""
    from train.blocked_attention import tile_work

    work = [tile_work(r[None], TILE).pairs_computed for r in seg]
    return seg[int(np.argsort(work, kind="stable")[len(work) // 2])]


def timed(fn, *args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_alone(seg_row: np.ndarray, repeats: int) -> tuple[float, float]:
    import jax
    import jax.numpy as jnp

    from loaders import block_causal_mask_jax
    from train.blocked_attention import NEG_INF, blocked_attention

    length = seg_row.shape[-1]
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, length, HEADS, HEAD_DIM)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(1, length, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(1, length, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    seg = jnp.asarray(seg_row[None])

    def dense(q, k, v, seg):  # Tunix's Gemma3 global attention, as its Attention.block computes it
        s = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(1, length, KV_HEADS, HEADS, HEAD_DIM), k).reshape(1, length, HEADS, length)
        s = jnp.where(block_causal_mask_jax(seg)[:, :, None, :], s, NEG_INF)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("BTKGS,BSKH->BTKGH", p.reshape(1, length, KV_HEADS, HEADS, length), v)

    def blocked(q, k, v, seg):
        return blocked_attention(q, k, v, seg, tile=TILE)

    def fwd_bwd(f):
        return jax.jit(jax.grad(lambda q, k, v, seg: jnp.sum(f(q, k, v, seg).astype(jnp.float32)), argnums=(0, 1, 2)))

    return timed(fwd_bwd(dense), q, k, v, seg, repeats=repeats), timed(fwd_bwd(blocked), q, k, v, seg, repeats=repeats)


def whole_step(seg_row: np.ndarray, repeats: int) -> tuple[float, float]:
    """Tiny Gemma3 (6 layers, window 512, vocab 1024), one row, the train step's value_and_grad."""
    from flax import nnx

    from train import attention, loss as loss_lib, model_inputs, models

    length = seg_row.shape[-1]
    rng = np.random.default_rng(1)
    batch = {"input_ids": rng.integers(3, 1024, (1, length)).astype(np.int32), "segment_ids": seg_row[None].astype(np.int32),
             "loss_mask": (seg_row[None] > 0).astype(np.int32)}
    starts = np.r_[True, seg_row[1:] != seg_row[:-1]]
    idx = np.arange(length)
    batch["positions"] = (idx - np.maximum.accumulate(np.where(starts, idx, 0)))[None].astype(np.int32)
    times = []
    for kind in ("dense", "blocked"):
        built = models.build_model("tiny-gemma3", vocab_size=1024, seed=0, config_overrides={"sliding_window_size": WINDOW})
        model = models.apply_lora(built.model, built.spec, rank=4)
        attention.install(model, kind, TILE)
        inputs = model_inputs.make_gen_model_input_fn(attention=kind)(batch)
        grad = nnx.jit(nnx.value_and_grad(loss_lib.masked_loss_fn_with_aux, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True))
        times.append(timed(lambda m, i: grad(m, **i), model, inputs, repeats=repeats))
    return times[0], times[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--time-lengths", default="4096,8192")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-step", action="store_true", help="time the attention alone only")
    args = p.parse_args()
    lengths = sorted({int(x) for x in args.lengths.split(",")} | {int(x) for x in args.time_lengths.split(",")})
    with tempfile.TemporaryDirectory() as out:
        segs = packed_sample(lengths, out)
    work_table({L: segs[L] for L in (int(x) for x in args.lengths.split(","))})
    print("\n| L | segments in the row | attention fwd+bwd dense / blocked (s) | ratio | tiny-Gemma3 step dense / blocked (s) | ratio |")
    print("|---|---|---|---|---|---|")
    for length in (int(x) for x in args.time_lengths.split(",")):
        row = typical_row(segs[length])
        dense_s, blocked_s = attention_alone(row, args.repeats)
        step = "" if args.skip_step else whole_step(row, args.repeats)
        step_txt = f"{step[0]:.2f} / {step[1]:.2f} | {step[1] / step[0]:.2f}" if step else "- | -"
        print(f"| {length} | {len(set(row[row > 0].tolist()))} | {dense_s:.2f} / {blocked_s:.2f} | {blocked_s / dense_s:.2f} | {step_txt} |", flush=True)


if __name__ == "__main__":
    main()
