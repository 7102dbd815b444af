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

3. On an accelerator (docs/benchmarks.md, "The attention default per backend"): the attention
   alone, forward + backward, Gemma3 270M's heads, bf16, one row, for global layers and for
   local layers (window 512), blocked against dense (and, with --cudnn, cuDNN's flash attention),
   in milliseconds with XLA's temp memory per compiled call. The rows are packed here and saved,
   so the device machine needs only jax and numpy (it packs nothing, imports no loaders/tunix/flax):

    python -m benchmarks.bench_attention --time-lengths 4096,8192,16384 --save-rows .bench_rows/rows.npz
    python -m benchmarks.bench_attention --rows .bench_rows/rows.npz --repeats 20 [--cudnn]

   dense there is Tunix 0.1.7's Gemma3 `Attention.block` step, written inline: logits of the
   scaled queries, `where(mask, logits, K_MASK)` with the block-causal mask of
   loaders/mask.py (and, on local layers, Tunix's sliding band |q - k| < window), softmax,
   probabilities cast to the values' dtype, times v. The mask is built inside the jitted call,
   as in the train step. --cudnn adds `jax.nn.dot_product_attention(implementation="cudnn")`
   given the same mask (as an additive bias, is_causal, and local_window_size on local layers)
   and cuDNN's packed layout (jax._src.cudnn.fused_attention_stablehlo.dot_product_attention
   with per-segment q_offsets / q_seqlen, padding in no segment): each variant's forward output
   is checked against dense at every real position before it is timed.
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


def block_causal_mask(seg, window: int | None = None):
    """[B, L, L] bool: loaders/mask.py's block-causal mask (pad queries see themselves), and on a
    local layer Tunix's sliding band triu(-w + 1) * tril(w - 1); jax.numpy only."""
    import jax.numpy as jnp

    length = seg.shape[-1]
    q, k = seg[:, :, None], seg[:, None, :]
    causal = jnp.tril(jnp.ones((length, length), bool))
    eye = jnp.eye(length, dtype=bool)
    mask = ((q == k) & causal & (q != 0)) | (eye & (q == 0))
    if window is not None:
        ones = jnp.ones((length, length), bool)
        mask &= (jnp.triu(ones, -window + 1) & jnp.tril(ones, window - 1))[None]
    return mask


def dense_attention(q, k, v, seg, mask):
    """Tunix 0.1.7 Gemma3 Attention.block's softmax(q k^T) v with GQA, for [B, L, N, H] scaled q."""
    import jax
    import jax.numpy as jnp

    from train.blocked_attention import NEG_INF  # Tunix's K_MASK

    b, length, n, h = q.shape
    kv = k.shape[2]
    s = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, length, kv, n // kv, h), k).reshape(b, length, n, length)
    s = jnp.where(mask[:, :, None, :], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("BTKGS,BSKH->BTKGH", p.reshape(b, length, kv, n // kv, length), v).reshape(b, length, n, h)


def attention_alone(seg_row: np.ndarray, repeats: int) -> tuple[float, float]:
    import jax
    import jax.numpy as jnp

    from loaders import block_causal_mask_jax
    from train.blocked_attention import blocked_attention

    length = seg_row.shape[-1]
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, length, HEADS, HEAD_DIM)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(1, length, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(1, length, KV_HEADS, HEAD_DIM)), jnp.bfloat16)
    seg = jnp.asarray(seg_row[None])

    def dense(q, k, v, seg):  # Tunix's Gemma3 global attention, as its Attention.block computes it
        return dense_attention(q, k, v, seg, block_causal_mask_jax(seg))

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


def save_rows(lengths: list[int], path: str) -> None:
    """Packs the sample at each L and saves each L's typical row (int32 [L]) as key L<n> of an .npz."""
    with tempfile.TemporaryDirectory() as out:
        segs = packed_sample(lengths, out)
    rows = {f"L{length}": typical_row(segs[length]).astype(np.int32) for length in lengths}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez(path, **rows)
    for key, row in rows.items():
        print(f"{key}: {len(set(row[row > 0].tolist()))} segments, {int((row == 0).sum())} padding -> {path}")


def cudnn_packed_args(seg_row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[1, M] lengths and [1, M + 1] offsets of the row's real segments, for cuDNN's packed layout."""
    ids = seg_row.tolist()
    starts = [i for i in range(len(ids)) if ids[i] != 0 and (i == 0 or ids[i - 1] != ids[i])]
    ends = [i + 1 for i in range(len(ids)) if ids[i] != 0 and (i == len(ids) - 1 or ids[i + 1] != ids[i])]
    lengths = np.asarray([e - b for b, e in zip(starts, ends)], np.int32)
    offsets = np.asarray(starts + [-1], np.int32)
    return lengths[None], offsets[None]


def _attention_fns(length: int, window: int | None, seg_row: np.ndarray, cudnn: bool) -> dict:
    """name -> f(q, k, v, seg) for one row; dense, blocked and (cudnn) the two cuDNN variants."""
    import jax
    import jax.numpy as jnp

    from train.blocked_attention import blocked_attention

    fns = {
        "dense": lambda q, k, v, seg: dense_attention(q, k, v, seg, block_causal_mask(seg, window)),
        "blocked": lambda q, k, v, seg: blocked_attention(q, k, v, seg, tile=TILE, window=window),
    }
    if cudnn:
        local = None if window is None else (window - 1, 0)

        def cudnn_mask(q, k, v, seg):
            mask = block_causal_mask(seg, window)[:, None]  # [B, 1, T, S]: broadcast over heads
            return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=1.0, is_causal=True,
                                                local_window_size=local, implementation="cudnn")

        lens, offs = (jnp.asarray(x) for x in cudnn_packed_args(seg_row))

        def cudnn_packed(q, k, v, seg):
            from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention as dpa

            return dpa(q, k, v, q_seqlen=lens, kv_seqlen=lens, q_offsets=offs, kv_offsets=offs, scale=1.0,
                       mask_type=MaskType.PADDING_CAUSAL, sliding_window_length=window)

        fns["cudnn (mask)"] = cudnn_mask
        fns["cudnn (packed)"] = cudnn_packed
    return fns


def _fwd_bwd(f):
    import jax
    import jax.numpy as jnp

    return jax.jit(jax.grad(lambda q, k, v, seg: jnp.sum(f(q, k, v, seg).astype(jnp.float32)), argnums=(0, 1, 2)))


def _temp_gib(compiled) -> float | None:
    try:
        return compiled.memory_analysis().temp_size_in_bytes / 2**30
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def device_table(rows: dict[int, np.ndarray], repeats: int, cudnn: bool, sets: int = 3) -> None:
    """The attention alone on the default device: ms per fwd+bwd call (median, inputs rotated
    over `sets` random draws), blocked / dense, XLA temp memory per call, forward error vs dense."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, device {dev.device_kind}", flush=True)
    results = []
    for length, seg_row in sorted(rows.items()):
        real = jnp.asarray(seg_row[None] > 0)[..., None, None]
        rng = np.random.default_rng(length)
        draws = [tuple(jnp.asarray(rng.normal(size=(1, length, n, HEAD_DIM)) * scale, jnp.bfloat16)
                       for n, scale in ((HEADS, HEAD_DIM ** -0.5), (KV_HEADS, 1.0), (KV_HEADS, 1.0))) for _ in range(sets)]
        seg = jnp.asarray(seg_row[None].astype(np.int32))
        segments = len(set(seg_row[seg_row > 0].tolist()))
        for layer, window in (("global", None), ("local", WINDOW)):
            row = {"L": length, "layer": layer, "segments": segments}
            ref = None
            for name, f in _attention_fns(length, window, seg_row, cudnn).items():
                try:
                    out = jax.jit(f)(*draws[0], seg).astype(jnp.float32)
                    if ref is None:
                        ref = out  # dense comes first
                    err = float(jnp.linalg.norm(jnp.where(real, out - ref, 0)) / jnp.linalg.norm(jnp.where(real, ref, 0)))
                    fn = _fwd_bwd(f).lower(*draws[0], seg).compile()  # compiled once: timed and measured
                    temp = _temp_gib(fn)
                    for i in range(sets):  # warm every input set
                        jax.block_until_ready(fn(*draws[i], seg))
                    times = []
                    for r in range(repeats):
                        q, k, v = draws[r % sets]
                        start = time.perf_counter()
                        jax.block_until_ready(fn(q, k, v, seg))
                        times.append(time.perf_counter() - start)
                    row[name] = (statistics.median(times) * 1e3, temp, err)
                except Exception as e:  # noqa: BLE001 - report and go on (OOM, unsupported cuDNN config)
                    row[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                print(f"L{length} {layer} {name}: {row[name]}", flush=True)
            results.append(row)
    try:
        stats = dev.memory_stats() or {}
        print(f"process peak device memory: {stats.get('peak_bytes_in_use', 0) / 2**30:.1f} GiB", flush=True)
    except Exception:  # noqa: BLE001
        pass
    names = [n for n in ("dense", "blocked", "cudnn (mask)", "cudnn (packed)") if n in results[0]]

    def cell(v):
        if isinstance(v, str):
            return v
        ms, temp, err = v
        return f"{ms:.2f} ms" + (f" ({temp:.2f} GiB)" if temp is not None else "") + (f", err {err:.1e}" if err else "")

    print("\n| L | layer | segments | " + " | ".join(names) + " | blocked / dense |")
    print("|---|---|---|" + "---|" * len(names) + "---|")
    for row in results:
        d, b = row["dense"], row["blocked"]
        ratio = f"{b[0] / d[0]:.2f}" if not isinstance(d, str) and not isinstance(b, str) else "-"
        print(f"| {row['L']} | {row['layer']} | {row['segments']} | " + " | ".join(cell(row[n]) for n in names) + f" | {ratio} |")
    print("\nms: median fwd+bwd call; (GiB): XLA temp memory of the compiled fwd+bwd; err: forward output's "
          "relative L2 difference from dense at real positions.", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--time-lengths", default="4096,8192")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-step", action="store_true", help="time the attention alone only")
    p.add_argument("--save-rows", metavar="NPZ", help="pack the sample at --time-lengths, save each L's typical row, exit")
    p.add_argument("--rows", metavar="NPZ", help="time the attention alone (global and local layers, ms) on these saved "
                   "rows; packs nothing (for a device machine with jax and numpy only)")
    p.add_argument("--cudnn", action="store_true", help="with --rows: also cuDNN flash attention (GPU only)")
    args = p.parse_args()
    if args.save_rows:
        save_rows(sorted({int(x) for x in args.time_lengths.split(",")}), args.save_rows)
        return
    if args.rows:
        with np.load(args.rows) as data:
            device_table({int(k[1:]): data[k] for k in data.files}, args.repeats, args.cudnn)
        return
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
