"""Attention work and time per kind (`--attention dense|blocked|flash|splash`) on packed rows of the shipped sample.

1. Work (`--work`): the (query, key) pairs each kind computes per row and query head on every row
   of the packed sample (`prepack pack --sample`, Alpaca-like rows; `--alpaca`: the benchmarks'
   real Alpaca sample, benchmarks/data.py) at each L, against the
   token-level ideal (same-segment causal pairs, sum of s (s + 1) / 2; within the window on
   Gemma3's local layers), from the rows' segment ids (train/measurement/flops.py): dense L x L; splash the
   blocks of its static causal (local) mask at its 512 block; blocked at tiles 128/256/512 and
   flash at blocks 64/128, the tiles from each query tile's lowest segment (key_tile_ranges).

    python -m benchmarks.bench_attention --work [--lengths 1024,2048,4096,8192] [--alpaca]

2. CPU time per blocked tile (`--tiles`): the attention alone (forward + backward, Gemma3 270M's
   heads, one row, bf16) on a typical packed row at each L (the row whose tile work is the median:
   BFD opens rows with the longest examples, so the first row is the atypical one), blocked at
   each tile against dense, global and local layers, weighted over Gemma3 270M's 3 global and 15
   local layers:

    python -m benchmarks.bench_attention --tiles 128,256,512 --time-lengths 4096,8192 [--repeats 3]

   (without --tiles: the older dense-against-blocked table, with a whole tiny-Gemma3 step.)

3. On an accelerator: prepared commands. The rows are packed on this machine and saved, so the
   device machine needs only jax and numpy (it packs nothing and imports no loaders, Tunix or flax):

    python -m benchmarks.bench_attention --time-lengths 4096,8192,16384 --save-rows .bench_rows/rows.npz   # here
    python3 -m benchmarks.bench_attention --device-all --rows .bench_rows/rows.npz --out DIR               # on the device

   Only one process can hold a TPU, so the process that runs --device-all never opens a backend
   (it imports no JAX): (a) runs in a child, then each variant of (b) in its own child, one after
   another. (a) the attention alone, forward + backward, Gemma3 270M's heads, bf16, one row, global
   and local (window 512) layers at each saved L: dense, blocked, flash at each of its blocks (GPU
   64 and 128; TPU 128, 256 and 512), cuDNN's two forms on a GPU, splash on a TPU, each checked against dense's
   forward first; ms and XLA's temp memory per compiled call; (b) one whole train step of a Gemma3
   270M-shaped LoRA model (benchmarks/gemma3_step.py: random bf16 weights, rank 16, chunked loss)
   at (4, 8192) on four typical packed rows, flash against dense (and splash on a TPU), with
   --remat layer and without: median step time, the process's peak device memory and XLA's temp
   bytes. A variant that runs out of memory or time is reported as such.

   The parts also run alone, in separate calls (six variants at ~99 s of compile each do not fit
   one 10-minute call); each merges its results into DIR/bench_attention.json (--out, default
   $OUT) and leaves out what the file already holds, so a call that ran out of time is resumed by
   running it again:

    python3 -m benchmarks.bench_attention --part attention --rows .bench_rows/rows.npz --out DIR [--kinds flash,splash] [--at-lengths 8192]
    python3 -m benchmarks.bench_attention --part step --rows .bench_rows/rows.npz --out DIR --variants flash:128:layer,splash:512:layer

   A variant that ran, or did not fit (out of memory), is final; one that failed otherwise or ran
   out of time is run again. `--smoke` runs the same on small shapes (any backend, Pallas
   interpret mode off a GPU/TPU) to check the script end to end. The older `--rows NPZ [--cudnn]`
   runs (a) alone and prints it, without JSON.

   dense in (a) and (b) is Tunix 0.1.7's Gemma3 `Attention.block` step (dense_attention, in
   benchmarks/gemma3_step.py beside the step that also times it): logits of the scaled queries,
   `where(mask, logits, K_MASK)` with the block-causal mask of loaders/mask.py (and, on local
   layers, Tunix's sliding band |q - k| < window), softmax, probabilities cast to
   the values' dtype, times v. The mask is built inside the jitted call, as in the train step.
   cuDNN: `jax.nn.dot_product_attention(implementation="cudnn")` given the same mask (as an
   additive bias, is_causal, and local_window_size on local layers) and cuDNN's packed layout
   (jax._src.cudnn.fused_attention_stablehlo.dot_product_attention with per-segment q_offsets /
   q_seqlen, padding in no segment).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import results_file
from benchmarks.gemma3_step import block_causal_mask, dense_attention

TILE = 512  # blocked's tile in the older CPU table and the device table (its default there when timed)
HEADS, KV_HEADS, HEAD_DIM, WINDOW = 4, 1, 256, 512  # Gemma3 270M
LAYERS_LOCAL, LAYERS_GLOBAL = 15, 3


# --alpaca: the benchmarks' real Alpaca sample instead of the shipped one (benchmarks/data.py).
INPUT: str | None = None


def packed_sample(lengths: list[int], out: str) -> dict[int, np.ndarray]:
    """The shipped sample (or INPUT, an Alpaca JSONL) packed at each L; returns every row's segment ids per L."""
    import loaders

    source = ["--input", INPUT, "--format", "alpaca"] if INPUT else ["--sample"]
    cmd = [sys.executable, "-m", "apps.cli", "pack", *source, "--output", out, "--overwrite", "--max-length", *map(str, lengths)]
    subprocess.run(cmd, check=True, capture_output=True)
    segs = {}
    for length in lengths:
        view = loaders.open_shards(os.path.join(out, f"L{length}"))
        segs[length] = np.stack([np.asarray(view[i]["segment_ids"]) for i in range(len(view))])
    return segs


def work_table(segs: dict[int, np.ndarray]) -> None:
    from train.attention_kernels.blocked_attention import tile_work

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
    from train.attention_kernels.blocked_attention import tile_work

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
    from train.attention_kernels.blocked_attention import blocked_attention

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

    from train.attention_kernels import attention
    from train.model import models
    from train.step import loss as loss_lib, model_inputs

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
    """Packs the sample at each L; saves each L's typical row (int32 [L]) as key L<n>, and all its
    rows ([rows, L], the whole-step benchmark's batch comes from them) as all_L<n>, in one .npz."""
    with tempfile.TemporaryDirectory() as out:
        segs = packed_sample(lengths, out)
    rows = {f"L{length}": typical_row(segs[length]).astype(np.int32) for length in lengths}
    rows.update({f"all_L{length}": segs[length].astype(np.int32) for length in lengths})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez(path, **rows)
    for key, row in rows.items():
        if key.startswith("L"):
            print(f"{key}: {len(set(row[row > 0].tolist()))} segments, {int((row == 0).sum())} padding -> {path}")


def load_rows(path: str) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """(typical row per L, all rows per L; the latter empty for an .npz saved before it had them)."""
    with np.load(path) as data:
        typical = {int(k[1:]): data[k] for k in data.files if k.startswith("L")}
        every = {int(k[5:]): data[k] for k in data.files if k.startswith("all_L")}
    return typical, every


def typical_batch(rows: np.ndarray, batch: int) -> np.ndarray:
    """`batch` rows around the median tile work (or the typical row repeated, with fewer rows)."""
    from train.attention_kernels.blocked_attention import tile_work

    if len(rows) < batch:
        return np.repeat(typical_row(rows)[None], batch, axis=0)
    order = np.argsort([tile_work(r[None], TILE).pairs_computed for r in rows], kind="stable")
    first = max(0, min(len(rows) - batch, len(rows) // 2 - batch // 2))
    return rows[np.sort(order[first:first + batch])]


# --- 1. Work --------------------------------------------------------------------------------------

# (kind, tile or block) in the work table: dense's L x L, splash at its default block, blocked at
# each tile, flash at its GPU (64) and TPU/CPU (128) blocks.
WORK_KINDS = (("dense", None), ("splash", 512), ("blocked", 512), ("blocked", 256), ("blocked", 128), ("flash", 128), ("flash", 64))


def work_counts(segs: dict[int, np.ndarray]) -> list[dict]:
    """Per L and layer kind: mean segments, ideal pairs per row, and each kind's pairs / ideal (sums over rows;
    per_row: min, median, max of each row's own ratio)."""
    from train.measurement import flops

    out = []
    for length, seg in sorted(segs.items()):
        segments = float(np.mean([len(set(r[r > 0].tolist())) for r in seg]))
        for layer, window in (("global", None), ("local", WINDOW)):
            ideal = flops.ideal_pairs(seg, window)
            row = {"L": length, "layer": layer, "rows": len(seg), "segments": segments, "ideal_per_row": float(ideal.mean())}
            for kind, tile in WORK_KINDS:
                pairs = flops.attention_pairs(kind, seg, tile or length, window)
                row[f"{kind} {tile}" if tile else kind] = float(pairs.sum() / ideal.sum())
                ratio = pairs / ideal
                row[f"per_row {kind} {tile}" if tile else f"per_row {kind}"] = [float(ratio.min()), float(np.median(ratio)), float(ratio.max())]
            out.append(row)
    return out


def print_work(rows: list[dict]) -> None:
    names = [f"{k} {t}" if t else k for k, t in WORK_KINDS]
    print("Pairs computed per row and query head / the token-level ideal (same-segment causal pairs):\n")
    print("| L | layer | rows | segments/row | ideal pairs/row | " + " | ".join(names) + " |")
    print("|---|---|---|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['L']} | {r['layer']} | {r['rows']} | {r['segments']:.1f} | {r['ideal_per_row']:,.0f} | "
              + " | ".join(f"{r[n]:.1f}x" for n in names) + " |")
    print("\nPer row (flash 128 and blocked 256 pairs / that row's ideal): min / median / max over the rows:\n")
    print("| L | layer | flash 128 | blocked 256 |")
    print("|---|---|---|---|")
    for r in rows:
        cells = [" / ".join(f"{x:.1f}x" for x in r[f"per_row {n}"]) for n in ("flash 128", "blocked 256")]
        print(f"| {r['L']} | {r['layer']} | " + " | ".join(cells) + " |")
    print("\nOver Gemma3 270M's 3 global + 15 local layers (pairs / ideal, summed over layers):\n")
    print("| L | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for length in sorted({r["L"] for r in rows}):
        g, loc = (next(r for r in rows if r["L"] == length and r["layer"] == x) for x in ("global", "local"))
        ideal = LAYERS_GLOBAL * g["ideal_per_row"] + LAYERS_LOCAL * loc["ideal_per_row"]
        cells = [(LAYERS_GLOBAL * g["ideal_per_row"] * g[n] + LAYERS_LOCAL * loc["ideal_per_row"] * loc[n]) / ideal for n in names]
        print(f"| {length} | " + " | ".join(f"{c:.1f}x" for c in cells) + " |", flush=True)


# --- 2. CPU time per blocked tile ----------------------------------------------------------------


def _qkv(length: int, seed: int, sets: int = 1):
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    return [tuple(jnp.asarray(rng.normal(size=(1, length, n, HEAD_DIM)) * scale, jnp.bfloat16)
                  for n, scale in ((HEADS, HEAD_DIM ** -0.5), (KV_HEADS, 1.0), (KV_HEADS, 1.0))) for _ in range(sets)]


def tile_times(rows: dict[int, np.ndarray], tiles: list[int], repeats: int) -> list[dict]:
    """CPU seconds of the attention alone, fwd + bwd, dense and blocked at each tile, per L and layer kind."""
    import jax.numpy as jnp

    from train.attention_kernels.blocked_attention import blocked_attention
    from train.measurement import flops

    out = []
    for length, seg_row in sorted(rows.items()):
        (q, k, v), = _qkv(length, length)
        seg = jnp.asarray(seg_row[None].astype(np.int32))
        for layer, window in (("global", None), ("local", WINDOW)):
            ideal = float(flops.ideal_pairs(seg_row[None], window)[0])
            row = {"L": length, "layer": layer, "segments": len(set(seg_row[seg_row > 0].tolist()))}
            row["dense"] = (timed(_fwd_bwd(lambda q, k, v, s: dense_attention(q, k, v, s, block_causal_mask(s, window))),
                                  q, k, v, seg, repeats=repeats), length * length / ideal)
            for tile in tiles:
                f = _fwd_bwd(lambda q, k, v, s, t=tile: blocked_attention(q, k, v, s, tile=t, window=window))
                work = float(flops.attention_pairs("blocked", seg_row[None], tile, window)[0]) / ideal
                row[f"blocked {tile}"] = (timed(f, q, k, v, seg, repeats=repeats), work)
                print(f"L{length} {layer} blocked {tile}: {row[f'blocked {tile}'][0]:.2f} s, work {work:.1f}x ideal", flush=True)
            out.append(row)
    return out


def print_tile_times(rows: list[dict], tiles: list[int]) -> None:
    names = ["dense"] + [f"blocked {t}" for t in tiles]
    print("\nCPU seconds, attention alone fwd + bwd (work: pairs computed / ideal):\n")
    print("| L | layer | segments | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['L']} | {r['layer']} | {r['segments']} | " + " | ".join(f"{r[n][0]:.2f} s ({r[n][1]:.1f}x)" for n in names) + " |")
    print("\nWeighted over Gemma3 270M's 3 global + 15 local layers (s per row), and against dense:\n")
    print("| L | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for length in sorted({r["L"] for r in rows}):
        g, loc = (next(r for r in rows if r["L"] == length and r["layer"] == x) for x in ("global", "local"))
        total = {n: LAYERS_GLOBAL * g[n][0] + LAYERS_LOCAL * loc[n][0] for n in names}
        print(f"| {length} | " + " | ".join(f"{total[n]:.1f} s ({total[n] / total['dense']:.2f})" for n in names) + " |", flush=True)


# --- 3. On an accelerator ------------------------------------------------------------------------


def cudnn_packed_args(seg_row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[1, M] lengths and [1, M + 1] offsets of the row's real segments, for cuDNN's packed layout."""
    ids = seg_row.tolist()
    starts = [i for i in range(len(ids)) if ids[i] != 0 and (i == 0 or ids[i - 1] != ids[i])]
    ends = [i + 1 for i in range(len(ids)) if ids[i] != 0 and (i == len(ids) - 1 or ids[i + 1] != ids[i])]
    lengths = np.asarray([e - b for b, e in zip(starts, ends)], np.int32)
    offsets = np.asarray(starts + [-1], np.int32)
    return lengths[None], offsets[None]


def flash_blocks(backend: str, length: int) -> list[int]:
    """The flash blocks timed: a GPU's 64 and 128 (Triton: the smaller spills less at head_dim 256); on a TPU
    128, 256 and 512 (the v5e's MXU is 128 wide; larger query blocks mean fewer grid steps per head)."""
    blocks = [128, 256, 512] if backend == "tpu" else [64, 128]
    return [b for b in blocks if length % b == 0]


def _attention_fns(length: int, window: int | None, seg_row: np.ndarray, cudnn: bool, backend: str) -> dict:
    """name -> f(q, k, v, seg) for one row: dense, blocked, flash at each block; cuDNN's two forms
    (cudnn) on a GPU; splash on a TPU."""
    import jax
    import jax.numpy as jnp

    from train.attention_kernels.blocked_attention import blocked_attention
    from train.attention_kernels.flash_attention import flash_attention

    tile = min(TILE, length)
    fns = {
        "dense": lambda q, k, v, seg: dense_attention(q, k, v, seg, block_causal_mask(seg, window)),
        "blocked": lambda q, k, v, seg: blocked_attention(q, k, v, seg, tile=tile, window=window),
    }
    for block in flash_blocks(backend, length):
        fns[f"flash {block}"] = lambda q, k, v, seg, b=block: flash_attention(q, k, v, seg, window=window, block=b)
    if backend == "tpu":
        from train.attention_kernels.attention import splash_attention

        fns["splash"] = lambda q, k, v, seg: splash_attention(q, k, v, seg, window=window, block=tile)
    if cudnn and backend == "gpu":
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


def device_table(rows: dict[int, np.ndarray], repeats: int, cudnn: bool, sets: int = 3, deadline: float | None = None,
                 kinds: set[str] | None = None, done: set[tuple[int, str]] = frozenset()) -> list[dict]:
    """The attention alone on the default device: ms per fwd+bwd call (median, inputs rotated over
    `sets` random draws), XLA temp memory per call, forward error vs dense. Stops at `deadline`.
    kinds: time only these (the first word of a name: dense, blocked, flash, splash, cudnn); dense's
    forward is the reference either way. done: (L, layer, kind) already recorded, left out."""
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    backend = jax.default_backend()
    print(f"jax {jax.__version__}, backend {backend}, device {dev.device_kind}", flush=True)
    results = []
    for length, seg_row in sorted(rows.items()):
        real = jnp.asarray(seg_row[None] > 0)[..., None, None]
        draws = _qkv(length, length, sets)
        seg = jnp.asarray(seg_row[None].astype(np.int32))
        segments = len(set(seg_row[seg_row > 0].tolist()))
        for layer, window in (("global", None), ("local", WINDOW)):
            row = {"L": length, "layer": layer, "segments": segments}
            fns = {name: f for name, f in _attention_fns(length, window, seg_row, cudnn, backend).items()
                   if (kinds is None or name.split()[0] in kinds) and (length, layer, name.split()[0]) not in done}
            if not fns:
                continue
            dense = lambda q, k, v, seg, w=window: dense_attention(q, k, v, seg, block_causal_mask(seg, w))  # noqa: E731
            ref = jax.jit(dense)(*draws[0], seg).astype(jnp.float32)  # the reference forward
            for name, f in fns.items():
                if deadline is not None and time.perf_counter() > deadline:
                    row[name] = SKIPPED
                    continue
                try:
                    out = jax.jit(f)(*draws[0], seg).astype(jnp.float32)
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
                except Exception as e:  # noqa: BLE001 - report and go on (OOM, unsupported config, a kernel that fails)
                    row[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                print(f"L{length} {layer} {name}: {row[name]}", flush=True)
            results.append(row)
    try:
        stats = dev.memory_stats() or {}
        print(f"process peak device memory: {stats.get('peak_bytes_in_use', 0) / 2**30:.1f} GiB", flush=True)
    except Exception:  # noqa: BLE001
        pass
    print_device_table(results)
    return results


def print_device_table(results: list[dict]) -> None:
    if not results:
        return
    names = list(dict.fromkeys(n for r in results for n in r if n not in ("L", "layer", "segments")))

    def cell(v):
        if isinstance(v, str):
            return v
        ms, temp, err = v
        return f"{ms:.2f} ms" + (f" ({temp:.2f} GiB)" if temp is not None else "") + (f", err {err:.1e}" if err else "")

    def ratio(row, name):
        d, x = row.get("dense"), row.get(name)
        return f"{x[0] / d[0]:.2f}" if isinstance(d, (tuple, list)) and isinstance(x, (tuple, list)) else "-"

    others = [n for n in names if n != "dense"]
    print("\n| L | layer | segments | " + " | ".join(names) + " | " + " | ".join(f"{n} / dense" for n in others) + " |")
    print("|---|---|---|" + "---|" * (len(names) + len(others)))
    for row in results:
        print(f"| {row['L']} | {row['layer']} | {row['segments']} | " + " | ".join(cell(row.get(n, "-")) for n in names)
              + " | " + " | ".join(ratio(row, n) for n in others) + " |")
    print("\nms: median fwd+bwd call; (GiB): XLA temp memory of the compiled fwd+bwd; err: forward output's "
          "relative L2 difference from dense at real positions.", flush=True)
    lengths = sorted({r["L"] for r in results})
    print("\nOver Gemma3 270M's 3 global + 15 local layers, ms per row (and / dense):\n")
    print("| L | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for length in lengths:
        g = next((r for r in results if r["L"] == length and r["layer"] == "global"), None)
        loc = next((r for r in results if r["L"] == length and r["layer"] == "local"), None)
        if g is None or loc is None:
            continue
        cells = []
        for n in names:
            if all(isinstance(v, (tuple, list)) for v in (g.get(n), loc.get(n), g.get("dense"), loc.get("dense"))):
                total = LAYERS_GLOBAL * g[n][0] + LAYERS_LOCAL * loc[n][0]
                dense = LAYERS_GLOBAL * g["dense"][0] + LAYERS_LOCAL * loc["dense"][0]
                cells.append(f"{total:.1f} ({total / dense:.2f})")
            else:
                cells.append("-")
        print(f"| {length} | " + " | ".join(cells) + " |", flush=True)


STEP_BATCH, STEP_LENGTH = 4, 8192


def step_variant(spec: str, rows_path: str | None, smoke: bool, repeats: int) -> dict:
    """One whole-step variant "KIND:TILE:REMAT" in this process: compile, warm, time; peak memory."""
    import jax

    from benchmarks import gemma3_step as g3

    kind, tile, remat = spec.split(":")
    shape = g3.SMOKE if smoke else g3.GEMMA3_270M
    length, batch = (256, 2) if smoke else (STEP_LENGTH, STEP_BATCH)
    rows = smoke_rows(length, batch) if smoke or rows_path is None else None
    if rows is None:
        typical, every = load_rows(rows_path)
        rows = typical_batch(every[length], batch) if length in every else np.repeat(typical[length][None], batch, axis=0)
    data = {k: jax.device_put(v) for k, v in g3.batch_from_rows(rows, shape.vocab).items()}
    base, lora = g3.init(shape)
    step = g3.make_step(shape, kind, int(tile), remat == "layer")
    started = time.perf_counter()
    compiled = step.lower(lora, base, data).compile()
    compile_s = time.perf_counter() - started
    temp = _temp_gib(compiled)
    losses, times = [], []
    for i in range(repeats + 2):
        start = time.perf_counter()
        loss, lora = compiled(lora, base, data)
        loss = float(jax.block_until_ready(loss))
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - start)
        losses.append(loss)
    try:
        peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    except Exception:  # noqa: BLE001
        peak = None
    segments = int(sum(len(set(r[r > 0].tolist())) for r in rows))
    return {"variant": spec, "kind": kind, "tile": int(tile), "remat": remat, "batch": batch, "length": length,
            "segments": segments, "compile_s": compile_s, "median_step_s": statistics.median(times),
            "steps_s": times, "losses": losses, "peak_gib": None if peak is None else peak / 2**30, "temp_gib": temp}


def smoke_rows(length: int, batch: int, mean: int = 40) -> np.ndarray:
    """Alpaca-like packed rows without packing: segment lengths drawn around `mean`, a padded tail."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(batch):
        lengths = np.maximum(2, rng.geometric(1 / mean, size=4 * length // mean))
        row = np.repeat(np.arange(1, len(lengths) + 1), lengths)[: length - int(rng.integers(0, mean))]
        out.append(np.pad(row, (0, length - len(row))))
    return np.stack(out).astype(np.int32)


def step_variants(backend: str, smoke: bool) -> list[str]:
    """flash against dense, each with --remat layer and without (flash first: dense may not fit).
    Flash at the trainer's default block for the backend (train/attention_kernels/flash_attention.DEFAULT_BLOCK; this
    process imports no JAX, so the figure is repeated here and a test holds the two equal)."""
    block = 256 if backend == "tpu" else 64
    if smoke:
        block = 64
    kinds = [f"flash:{block}", "dense:0"] + ([f"splash:512"] if backend == "tpu" else [])
    return [f"{k}:{remat}" for remat in ("layer", "none") for k in kinds]


def step_variant_line(spec: str, rows_path: str | None, smoke: bool, repeats: int) -> dict:
    """The child's result: step_variant's, with the machine; an out-of-memory failure is a result
    too (recorded and not retried), any other exception propagates (the parent records the exit)."""
    from benchmarks.device_machine import machine

    try:
        result = step_variant(spec, rows_path, smoke, repeats)
    except Exception as e:  # noqa: BLE001 - only XLA's allocation failures are results
        from train.measurement.out_of_memory import is_out_of_memory

        if not is_out_of_memory(e):
            raise
        result = {"variant": spec, "failed": f"{OUT_OF_MEMORY}: {str(e).splitlines()[0][:200]}"}
    return {**result, "machine": machine()}


def run_step_variant(spec: str, args: argparse.Namespace, timeout: float) -> dict:
    """One variant in its own process (the one that holds the device while it runs)."""
    cmd = [sys.executable, "-m", "benchmarks.bench_attention", "--step-variant", spec, "--repeats", str(args.step_repeats)]
    if args.rows:
        cmd += ["--rows", args.rows]
    if args.smoke:
        cmd.append("--smoke")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": spec, "failed": f"no result within {timeout:.0f} s (the time budget)"}
    for line in done.stdout.splitlines():
        if line.startswith("STEP "):
            return json.loads(line[5:])
    err = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"variant": spec, "failed": f"exit {done.returncode}: {err[:300]}"}


def print_steps(results: list[dict]) -> None:
    print("\n| variant (kind:tile:remat) | rows x L | segments | median step | peak device memory | XLA temp | compile | losses |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "failed" in r:
            print(f"| {r['variant']} | - | - | {r['failed']} | | | | |")
            continue
        peak = f"{r['peak_gib']:.1f} GiB" if r.get("peak_gib") is not None else "-"
        temp = f"{r['temp_gib']:.1f} GiB" if r.get("temp_gib") is not None else "-"
        print(f"| {r['variant']} | {r['batch']} x {r['length']} | {r['segments']} | {r['median_step_s'] * 1e3:.0f} ms | {peak} | {temp} "
              f"| {r['compile_s']:.0f} s | {r['losses'][0]:.3f} .. {r['losses'][-1]:.3f} |")
    by = {r["variant"]: r for r in results if "failed" not in r}
    for remat in ("layer", "none"):
        flash = next((r for v, r in by.items() if v.startswith("flash:") and v.endswith(":" + remat)), None)
        dense = by.get(f"dense:0:{remat}")
        if flash and dense:
            print(f"remat {remat}: flash / dense step time {flash['median_step_s'] / dense['median_step_s']:.2f}"
                  + (f", peak memory {flash['peak_gib'] / dense['peak_gib']:.2f}" if flash.get("peak_gib") and dense.get("peak_gib") else ""),
                  flush=True)


# --- The device run in parts: results merged into one JSON, resumable ------------------------------
#
# Only one process can hold a TPU. So the process that spawns children never opens a backend (it
# imports no JAX): `--device-all` runs the attention part in a child, then each step variant in a
# child, one after another; `--part attention` runs in the process itself (it spawns nothing);
# `--part step` spawns one child per variant. Every part merges its results into OUT/bench_attention.json
# and leaves out what that file already holds, so the parts can run in separate calls.

RESULTS_NAME = "bench_attention.json"
SKIPPED = "skipped: out of the time budget"
OUT_OF_MEMORY = "out of memory"


def results_path(args: argparse.Namespace) -> str:
    out = args.out or os.environ.get("OUT")
    if not out:
        raise SystemExit("bench_attention: give --out DIR (or set $OUT): the parts merge their results into DIR/" + RESULTS_NAME)
    return os.path.join(out, RESULTS_NAME)


def rows_source(args: argparse.Namespace) -> str:
    """What the timed rows are: 'smoke', or the saved .npz's sha256 (results of other rows never merge)."""
    if args.smoke:
        return "smoke"
    import hashlib

    with open(args.rows, "rb") as f:
        return "sha256:" + hashlib.sha256(f.read()).hexdigest()


def load_results(path: str, source: str) -> dict:
    """The JSON so far (empty when there is none); refuses one made on other rows."""
    new = not os.path.exists(path)
    empty = {"machine": {}, "attention": [], "steps": [], "commands": []}
    try:
        data = results_file.load(path, empty, lambda d: all(isinstance(d.get(k), list) for k in ("attention", "steps")))
    except results_file.UnreadableResults as e:
        raise SystemExit(f"bench_attention: {path}: unreadable ({e}); move it away or give another --out") from None
    if new:
        data["rows"] = source
    if data.get("rows") != source:
        raise SystemExit(f"bench_attention: {path} holds results on other rows ({data.get('rows')}, these are {source}); "
                         "give another --out")
    return data


save_results = results_file.save


def attention_kinds(backend: str) -> set[str]:
    """The kinds the attention part times on a backend (the first words of _attention_fns' names)."""
    return {"dense", "blocked", "flash"} | ({"splash"} if backend == "tpu" else set()) | ({"cudnn"} if backend == "gpu" else set())


def attention_done(data: dict) -> set[tuple[int, str, str]]:
    """(L, layer, kind) recorded: timed, or failed (a kernel that fails fails again; a fresh --out retries);
    not those skipped for time."""
    return {(r["L"], r["layer"], name.split()[0]) for r in data["attention"] for name, v in r.items()
            if name not in ("L", "layer", "segments") and v != SKIPPED}


def merge_attention(old: list[dict], fresh: list[dict]) -> list[dict]:
    """Rows by (L, layer); a fresh row's kinds replace or join the recorded row's."""
    rows = {(r["L"], r["layer"]): dict(r) for r in old}
    for r in fresh:
        rows.setdefault((r["L"], r["layer"]), {}).update(r)
    return [rows[k] for k in sorted(rows, key=lambda k: (k[0], k[1] != "global"))]


def step_done(result: dict) -> bool:
    """A variant's result is final when it ran, or did not fit (out of memory is not retried)."""
    return "failed" not in result or str(result["failed"]).startswith(OUT_OF_MEMORY)


def record_command(data: dict) -> None:
    data["commands"].append(" ".join(["python3", "-m", "benchmarks.bench_attention", *sys.argv[1:]]))


def part_attention(args: argparse.Namespace) -> None:
    """(a) the attention alone, in this process (it holds the device; it spawns nothing). Opens the
    device only when some (L, layer, kind) asked for is not recorded yet."""
    started = time.perf_counter()
    path, source = results_path(args), rows_source(args)
    data = load_results(path, source)
    rows = {256: smoke_rows(256, 1)[0]} if args.smoke else load_rows(args.rows)[0]
    if args.at_lengths:
        wanted = {int(x) for x in args.at_lengths.split(",")}
        rows = {L: r for L, r in rows.items() if L in wanted}
    kinds = set(args.kinds.split(",")) if args.kinds else attention_kinds(args.backend or detected_backend())
    done = attention_done(data)
    asked = {(L, layer, k) for L in rows for layer in ("global", "local") for k in kinds}
    if asked & done:
        print(f"attention: {len(asked & done)} of {len(asked)} (L, layer, kind) already in {path}, left out", flush=True)
    if asked <= done:
        return
    from benchmarks.device_machine import line, machine

    info = machine()
    print(f"machine: {line(info)}", flush=True)
    fresh = device_table(rows, args.repeats, cudnn=info["backend"] == "gpu", deadline=started + args.budget_s,
                         kinds=kinds, done=done)
    data["attention"] = merge_attention(data["attention"], fresh)
    data["machine"] = info
    record_command(data)
    save_results(path, data)
    print(f"-> {path}", flush=True)


def detected_backend() -> str:
    """tpu / gpu / cpu from what is installed, without importing JAX or opening a device."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is not None:
        return "tpu"
    if any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin")):
        return "gpu"
    return "cpu"


def part_steps(args: argparse.Namespace, deadline: float) -> None:
    """(b) each whole-step variant in its own process; this one imports no JAX."""
    path, source = results_path(args), rows_source(args)
    data = load_results(path, source)
    variants = args.variants.split(",") if args.variants else step_variants(args.backend or detected_backend(), args.smoke)
    for spec in variants:
        recorded = next((r for r in data["steps"] if r.get("variant") == spec), None)
        if recorded is not None and step_done(recorded):
            print(f"step {spec}: already in {path}, skipped", flush=True)
            continue
        left = deadline - time.perf_counter()
        result = ({"variant": spec, "failed": SKIPPED} if left < 30 else run_step_variant(spec, args, left))
        print(f"step {spec}: {json.dumps(result)}", flush=True)
        info = result.pop("machine", None)
        if info:
            data["machine"] = info
        data["steps"] = [r for r in data["steps"] if r.get("variant") != spec] + [result]
        save_results(path, data)  # after each variant: a call that ends later keeps it
    record_command(data)
    save_results(path, data)
    print_steps([r for r in data["steps"] if r.get("variant") in variants])
    print(f"-> {path}", flush=True)


def device_all(args: argparse.Namespace) -> None:
    """(a) then (b), each in its own process(es), within --budget-s: this process opens no device."""
    started = time.perf_counter()
    deadline = started + args.budget_s
    path = results_path(args)
    cmd = [sys.executable, "-m", "benchmarks.bench_attention", "--part", "attention", "--repeats", str(args.repeats),
           "--budget-s", str(0.55 * args.budget_s), "--out", os.path.dirname(path)]  # (a): at most 55%
    for flag, value in (("--rows", args.rows), ("--kinds", args.kinds), ("--at-lengths", args.at_lengths), ("--backend", args.backend)):
        if value:
            cmd += [flag, value]
    if args.smoke:
        cmd.append("--smoke")
    try:
        done = subprocess.run(cmd, timeout=max(1.0, 0.6 * args.budget_s))
        if done.returncode:
            print(f"attention part: exit {done.returncode} (its results so far are in {results_path(args)})", flush=True)
    except subprocess.TimeoutExpired:
        print("attention part: out of the time budget", flush=True)
    part_steps(args, deadline)
    data = load_results(results_path(args), rows_source(args))
    if data["machine"]:
        from benchmarks.device_machine import line

        print(f"machine: {line(data['machine'])}", flush=True)
    print_device_table(data["attention"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,4096,8192")
    p.add_argument("--time-lengths", default="4096,8192")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", action="store_true", help="the work table of every kind at --lengths, then exit")
    p.add_argument("--tiles", default=None, help="CPU: time blocked at these tiles (e.g. 128,256,512) against dense")
    p.add_argument("--skip-step", action="store_true", help="time the attention alone only")
    p.add_argument("--save-rows", metavar="NPZ", help="pack the sample at --time-lengths, save each L's typical row "
                   "and all its rows, exit")
    p.add_argument("--rows", metavar="NPZ", help="saved rows: time the attention alone (global and local layers, ms) "
                   "on them; packs nothing (for a device machine with jax and numpy only)")
    p.add_argument("--cudnn", action="store_true", help="with --rows: also cuDNN flash attention (GPU only)")
    p.add_argument("--device-all", action="store_true", help="with --rows (or --smoke): the attention alone, then the "
                   "whole-step variants, each part in its own process(es) (this one opens no device), within --budget-s")
    p.add_argument("--part", choices=["attention", "step"], default=None,
                   help="one part of --device-all: attention (in this process) or step (each variant in its own process)")
    p.add_argument("--variants", default=None, help="--part step / --device-all: these variants KIND:TILE:REMAT, comma-separated "
                   "(default: flash and dense (and splash on a TPU), each with --remat layer and none)")
    p.add_argument("--kinds", default=None, help="--part attention: time only these kinds (dense,blocked,flash,splash,cudnn)")
    p.add_argument("--at-lengths", default=None, help="--part attention: only these of the saved lengths")
    p.add_argument("--backend", choices=["tpu", "gpu", "cpu"], default=None,
                   help="--part step: the variant list's backend (default: from what is installed; JAX is not imported)")
    p.add_argument("--budget-s", type=float, default=540.0, help="--device-all's (or one part's) wall-time budget")
    p.add_argument("--step-repeats", type=int, default=5, help="timed steps per whole-step variant (after 2 warm-up steps)")
    p.add_argument("--step-variant", default=None, help=argparse.SUPPRESS)  # one variant, in its own process
    p.add_argument("--smoke", action="store_true", help="small shapes: check the device run end to end on any machine")
    p.add_argument("--out", default=None, help="the device parts' results folder: DIR/bench_attention.json, merged and "
                   "resumed (default: $OUT when set)")
    p.add_argument("--alpaca", action="store_true", help="pack the benchmarks' Alpaca sample ($PREPACK_BENCH_DATA/alpaca.jsonl, "
                   "benchmarks/data.py) instead of the shipped one")
    args = p.parse_args()
    if args.alpaca:
        from benchmarks.data import DATA_DIR

        global INPUT
        INPUT = os.path.join(DATA_DIR, "alpaca.jsonl")
    if args.step_variant:
        print("STEP " + json.dumps(step_variant_line(args.step_variant, args.rows, args.smoke, args.repeats)), flush=True)
        return
    if args.device_all or args.part:
        if not (args.rows or args.smoke):
            p.error("--device-all and --part need --rows NPZ (saved with --save-rows) or --smoke")
        if args.device_all:
            device_all(args)
        elif args.part == "attention":
            part_attention(args)
        else:
            part_steps(args, time.perf_counter() + args.budget_s)
        return
    if args.save_rows:
        save_rows(sorted({int(x) for x in args.time_lengths.split(",")}), args.save_rows)
        return
    if args.rows:
        typical, _ = load_rows(args.rows)
        device_table(typical, args.repeats, args.cudnn)
        return
    work_lengths = [int(x) for x in args.lengths.split(",")]
    time_lengths = [int(x) for x in args.time_lengths.split(",")]
    with tempfile.TemporaryDirectory() as out:
        segs = packed_sample(sorted(set(work_lengths) | set(time_lengths)), out)
    if args.work:
        print_work(work_counts({L: segs[L] for L in work_lengths}))
        return
    if args.tiles:
        tiles = [int(x) for x in args.tiles.split(",")]
        print_tile_times(tile_times({L: typical_row(segs[L]) for L in time_lengths}, tiles, args.repeats), tiles)
        return
    work_table({L: segs[L] for L in work_lengths})
    print("\n| L | segments in the row | attention fwd+bwd dense / blocked (s) | ratio | tiny-Gemma3 step dense / blocked (s) | ratio |")
    print("|---|---|---|---|---|---|")
    for length in time_lengths:
        row = typical_row(segs[length])
        dense_s, blocked_s = attention_alone(row, args.repeats)
        step = "" if args.skip_step else whole_step(row, args.repeats)
        step_txt = f"{step[0]:.2f} / {step[1]:.2f} | {step[1] / step[0]:.2f}" if step else "- | -"
        print(f"| {length} | {len(set(row[row > 0].tolist()))} | {dense_s:.2f} / {blocked_s:.2f} | {blocked_s / dense_s:.2f} | {step_txt} |", flush=True)


if __name__ == "__main__":
    main()
