"""`--attention flash`: one fused Pallas kernel that visits only the key blocks a query block's segments reach.

Rows hold contiguous segments, so the keys a query block needs all lie between the first key
block of its lowest segment and the causal bound (the block itself), and on Gemma3's local
layers no further back than the window. `blocked_attention.key_tile_ranges` turns the row's
segment ids into that first block per query block at run time; the kernel reads it as the
lower bound of its key loop. Nothing about the mask is static: a row of 100 short examples and
a row of one long one run the same compiled kernel, each visiting its own blocks. Inside a
visited block the token-level mask (same segment, causal, window; padding sees itself only,
as loaders.block_causal_mask_jax) is applied to the scores, so the result equals dense's.

One structure on every backend (forward, and the two backward kernels of FlashAttention-2):
- forward: grid (row, query head, query block). The block's queries stay on chip; the row's
  keys and values for the head's KV head are the kernel's input (the index map reads KV head
  n // G, so grouped query heads share K/V without a repeated copy in memory); a fori_loop
  from the first to the last key block runs the online softmax (float32 statistics), writing
  the output and the log-sum-exp.
- dq: the same grid and key range, from the saved log-sum-exp and delta = rowsum(dO * O).
- dk/dv: per key block, a loop over the query blocks that reach it: from itself to
  `query_tile_ranges`' last one (first blocks never decrease along a row, so those query blocks
  are contiguous), for each of the G query heads of its KV head (their gradients sum; K/V are
  never repeated). How the G heads' shares are summed is the one place the styles differ in
  structure (below).
Each (query block, key block) pair that runs is one the forward ran: no block without a
same-segment causal pair is read, in either pass.

Per backend (the kernel bodies are shared; only loads, iotas and vector shapes differ):
- GPU (Pallas on Triton), from jax.experimental.pallas.ops.gpu.attention: the same grid,
  loop and layout ([B, L, N, H], no transposes), with the loop's lower bound read at run
  time (the query block's first key block, loaded from a per-position array and reduced),
  the window, and grouped heads. 1-D float32 statistics, as there.
- TPU (Pallas on Mosaic): the block ranges are scalar-prefetched into SMEM
  (PrefetchScalarGridSpec) and read as the loop bounds; each row's K and V (or Q and dO for
  dk/dv) are one VMEM block whose index does not change along the query blocks, so they are
  fetched once per (row, head) and the loop slices them. Not splash's block-skipping: splash
  decides which blocks run from a MaskInfo computed from a static mask, one for the whole
  kernel call, so per-row ranges would have to come through its dynamic-mask path, which
  takes and materializes a dense [heads, q, kv] mask (the L^2 cost this kernel removes), and
  its grid still steps through every block of the static mask (at 128-token blocks a global
  layer's grid is (L/128)^2 steps per head, each a fixed cost even when skipped). Here the
  grid is L/128 steps per head and the skipped blocks cost nothing. The price: a row's K and
  V (2 x L x head_dim, double-buffered) must fit VMEM: 16 MiB at L8192 and head_dim 256, and
  G times that for dk/dv's Q and dO (64 MiB at G = 4; a v5e has 128 MiB), checked against the
  chip's VMEM before the call. Vector shapes follow JAX's TPU flash kernel (the forward's
  running statistics [bq, 128], segment ids broadcast along lanes or sublanes).
- TPU dk/dv: grid (row, KV head, key block, g), g innermost and sequential ("arbitrary"). Q,
  dO and the statistics are one block of the KV head's G query heads, fetched once per (row,
  KV head) (a block per query head would be fetched again at every step); step g adds head
  kv * G + g's share to float32 VMEM accumulators, zeroed at g = 0, and g = G - 1 writes dk, dv
  once as [B, K, L, H] in K's dtype (the output block stays put along g). Why: the kernel used
  to write float32 dk, dv per query head for the wrapper to sum and convert; on a v5e profile
  of Gemma3 270M (4 query heads over 1 KV head, head_dim 256) at (8, 2048) that write, sum and
  convert, with the statistics' lane broadcasts, took ~16 ms of a 175 ms step, all memory
  traffic. The statistics (log-sum-exp, delta) now reach both backward kernels as one
  [B, N, 8, L] float32 sublane-row copy each: dk/dv reads rows (its columns are queries), dq
  turns its block's row into a column in-kernel (as splash's dq kernel does). No [.., L, 128]
  lane broadcast reaches HBM: the forward keeps its statistics as [bq, 128] columns in VMEM and
  writes the log-sum-exp already as those rows (transposed in the kernel), the residual itself.
- GPU dk/dv: grid (row, query head, key block), float32 dk, dv per query head, summed over the
  G heads of a KV head by the wrapper: Triton runs the grid's programs in parallel, so none
  can accumulate into another's output block.
- CPU and anything else: the GPU form in Pallas interpret mode (slow; for tests and for
  `prepack verify`/`train` on a CPU, not refused).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from train.attention_kernels.blocked_attention import NEG_INF, key_tile_ranges, query_tile_ranges

GPU, TPU = "gpu", "tpu"
STYLES = (GPU, TPU)
NUM_LANES, NUM_SUBLANES = 128, 8
# Blocks. TPU: 256 tokens, by measurement on a v5e (docs/benchmarks.md, "On a TPU v5e"): Gemma3
# 270M's attention alone, fwd+bwd over its 18 layers, 0.87x block 128's time at L8192 (equal at
# L2048; 512 is 1.15x-1.3x slower), and its (8, 2048) train step 0.976x; the grid is half as many
# steps per head for a few more masked pairs per block. On a GPU, head_dim 256 (Gemma3) makes a
# 128-query block's float32 accumulator 128 KiB per program and a 128-key K or V block 64 KiB of
# shared memory per pipeline stage; 64 halves both. Not yet timed: benchmarks/bench_attention.py
# --device-all times 64 and 128 on a GPU.
DEFAULT_BLOCK = {GPU: 64, TPU: 256}
CPU_BLOCK = 128
VMEM_HEADROOM = 8 * 2**20


def default_block(backend: str | None = None) -> int:
    backend = backend or jax.default_backend()
    return DEFAULT_BLOCK.get(backend, CPU_BLOCK)


@dataclasses.dataclass(frozen=True)
class _Shape:
    batch: int
    length: int
    heads: int
    kv_heads: int
    head_dim: int
    block: int
    window: int | None
    style: str
    interpret: bool

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def blocks(self) -> int:
        return self.length // self.block


# ---------------------------------------------------------------------------------------------
# What differs between Triton and Mosaic inside the kernels.


class _Gpu:
    """Triton: 1-D vectors, 1-D iotas, broadcasting by jnp."""

    @staticmethod
    def bound(ref, b, i):
        del b, i
        return jnp.min(ref[...])  # the block's entries all hold the same bound

    @staticmethod
    def fixed_col(ref, n):
        """A per-row value of the kernel's fixed block as a column [r, 1]."""
        return ref[...][:, None]

    @staticmethod
    def moving_row(ref, start, size):
        """Per-position values of a moving block as a row [1, size] (ref: the whole row)."""
        return ref[_ds(start, size)][None, :]

    @staticmethod
    def positions(r0, rows, c0, cols):
        return (r0 + jnp.arange(rows, dtype=jnp.int32))[:, None], (c0 + jnp.arange(cols, dtype=jnp.int32))[None, :]

    @staticmethod
    def init_stat(rows, value):
        return jnp.full((rows,), value, jnp.float32)

    @staticmethod
    def row_max(s):
        return jnp.max(s, axis=1)

    @staticmethod
    def row_sum(p):
        return jnp.sum(p, axis=1)

    @staticmethod
    def widen(x, n):
        return x[:, None]

    @staticmethod
    def stat_col(ref, n):
        """A fixed query block's statistic (log-sum-exp, delta) as a column [r, 1]."""
        return _Gpu.fixed_col(ref, n)

    @staticmethod
    def store_stat(ref, x):
        ref[...] = x


class _Tpu:
    """Mosaic: the forward's statistics [bq, 128], the backward's [8, L] sublane rows; segment ids broadcast
    along lanes (columns) or sublanes (rows)."""

    @staticmethod
    def bound(ref, b, i):
        return ref[b, i]  # scalar-prefetched into SMEM

    @staticmethod
    def fixed_col(ref, n):
        return _Tpu.widen(ref[...], n)

    @staticmethod
    def stat_col(ref, n):
        """A fixed query block's statistic from the sublane rows [8, r] both backward kernels read: row 0 turned
        into a column (as splash's dq kernel) and broadcast to [r, n] once, outside the key loop."""
        return jnp.broadcast_to(ref[0][:, None], (ref.shape[-1], n))

    @staticmethod
    def moving_row(ref, start, size):
        return ref[:1, _ds(start, size)]

    @staticmethod
    def positions(r0, rows, c0, cols):
        return (r0 + lax.broadcasted_iota(jnp.int32, (rows, cols), 0), c0 + lax.broadcasted_iota(jnp.int32, (rows, cols), 1))

    @staticmethod
    def init_stat(rows, value):
        return jnp.full((rows, NUM_LANES), value, jnp.float32)

    @staticmethod
    def row_max(s):
        return jnp.max(s, axis=1)[:, None]

    @staticmethod
    def row_sum(p):
        return jnp.sum(p, axis=1)[:, None]

    @staticmethod
    def widen(x, n):
        """[r, 128] lane-broadcast values -> [r, n]."""
        if n % NUM_LANES == 0:
            return jnp.tile(x, (1, n // NUM_LANES))
        if n < NUM_LANES:
            return x[:, :n]
        raise ValueError(f"a TPU flash block or head_dim must be a multiple of {NUM_LANES} or below it, got {n}")

    @staticmethod
    def store_stat(ref, x):
        """The forward's lane-broadcast [bq, 128] log-sum-exp written as the backward's sublane rows [8, bq]:
        transposed in the kernel, so no [B, N, L, 128] array reaches HBM (XLA cut that to [B, N, L]
        and relaid it out per layer: 2.5 ms of a 162 ms Gemma3 270M step at (8, 2048) on a v5e)."""
        ref[...] = x.T[:NUM_SUBLANES]


def _ds(start, size):
    from jax.experimental import pallas as pl

    return pl.ds(pl.multiple_of(start, size), size)


def _allowed(q_seg, k_seg, q_pos, k_pos, window):
    """The token-level mask: loaders.block_causal_mask_jax, and Gemma3's band on local layers."""
    ok = (k_pos <= q_pos) & (q_seg == k_seg) & ((q_seg != 0) | (q_pos == k_pos))
    if window is not None:
        ok &= q_pos - k_pos < window
    return ok


def _dot(a, b, trans_b=False):
    """a @ b (or a @ b^T) of 2-D blocks, accumulated in float32."""
    # float32 inputs: full precision (Triton would otherwise use TF32, TPUs bfloat16 passes).
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------
# Kernel bodies. Refs are 2-D [block or L, head_dim] on every backend; bounds, segment ids and
# statistics come through the style.


def _forward_kernel(bounds_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref, *, shape: _Shape, st):
    from jax.experimental import pallas as pl

    b, i = pl.program_id(0), pl.program_id(2)
    bq = bk = shape.block
    q = q_ref[...]
    q_seg = st.fixed_col(qseg_ref, bk)
    first = st.bound(bounds_ref, b, i)

    def body(kb, carry):
        o, m, l = carry
        start = kb * bk
        k = k_ref[_ds(start, bk), :]
        v = v_ref[_ds(start, bk), :]
        s = _dot(q, k, trans_b=True)  # [bq, bk] float32
        q_pos, k_pos = st.positions(i * bq, bq, start, bk)
        ok = _allowed(q_seg, st.moving_row(kseg_ref, start, bk), q_pos, k_pos, shape.window)
        s = jnp.where(ok, s, NEG_INF)
        m_next = jnp.maximum(m, st.row_max(s))
        p = jnp.where(ok, jnp.exp(s - st.widen(m_next, bk)), 0.0)
        alpha = jnp.exp(m - m_next)
        l_next = alpha * l + st.row_sum(p)
        o_next = st.widen(alpha, o.shape[-1]) * o + _dot(p.astype(v.dtype), v)
        return o_next, m_next, l_next

    init = (jnp.zeros((bq, q.shape[-1]), jnp.float32), st.init_stat(bq, NEG_INF), st.init_stat(bq, 0.0))
    o, m, l = lax.fori_loop(first, i + 1, body, init)
    # Every query sees at least itself (its own block is the loop's last), so l > 0.
    o_ref[...] = (o / st.widen(l, o.shape[-1])).astype(o_ref.dtype)
    st.store_stat(lse_ref, m + jnp.log(l))


def _dq_kernel(bounds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, dq_ref, *, shape: _Shape, st):
    from jax.experimental import pallas as pl

    b, i = pl.program_id(0), pl.program_id(2)
    bq = bk = shape.block
    q, do = q_ref[...], do_ref[...]
    q_seg = st.fixed_col(qseg_ref, bk)
    lse, delta = st.stat_col(lse_ref, bk), st.stat_col(delta_ref, bk)
    first = st.bound(bounds_ref, b, i)

    def body(kb, dq):
        start = kb * bk
        k = k_ref[_ds(start, bk), :]
        v = v_ref[_ds(start, bk), :]
        s = _dot(q, k, trans_b=True)
        q_pos, k_pos = st.positions(i * bq, bq, start, bk)
        ok = _allowed(q_seg, st.moving_row(kseg_ref, start, bk), q_pos, k_pos, shape.window)
        p = jnp.where(ok, jnp.exp(s - lse), 0.0)
        dp = _dot(do, v, trans_b=True)
        ds = p * (dp - delta)
        return dq + _dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(first, i + 1, body, jnp.zeros((bq, q.shape[-1]), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_block(j, last, q_ref, k, v, do_ref, lse_ref, delta_ref, k_seg, qseg_ref, *, shape: _Shape, st):
    """dk, dv (float32) of key block j from one query head: the loop over the query blocks j..last that reach it.
    Transposed: rows are the key block's positions, columns a query block's."""
    bq = bk = shape.block

    def body(qb, carry):
        dk, dv = carry
        start = qb * bq
        q = q_ref[_ds(start, bq), :]
        do = do_ref[_ds(start, bq), :]
        s_t = _dot(k, q, trans_b=True)  # [bk, bq]
        k_pos, q_pos = st.positions(j * bk, bk, start, bq)
        ok = _allowed(st.moving_row(qseg_ref, start, bq), k_seg, q_pos, k_pos, shape.window)
        p_t = jnp.where(ok, jnp.exp(s_t - st.moving_row(lse_ref, start, bq)), 0.0)
        dv = dv + _dot(p_t.astype(do.dtype), do)
        dp_t = _dot(v, do, trans_b=True)
        ds_t = p_t * (dp_t - st.moving_row(delta_ref, start, bq))
        dk = dk + _dot(ds_t.astype(q.dtype), q)
        return dk, dv

    zeros = jnp.zeros((bk, k.shape[-1]), jnp.float32)
    return lax.fori_loop(j, last + 1, body, (zeros, zeros))


def _dkv_kernel(bounds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kseg_ref, qseg_ref, dk_ref, dv_ref, *,
                shape: _Shape, st):
    """GPU: grid (row, query head, key block); one query head's float32 share of the key block's dk/dv (the
    wrapper sums the G heads of a KV head)."""
    from jax.experimental import pallas as pl

    b, j = pl.program_id(0), pl.program_id(2)
    dk, dv = _dkv_block(j, st.bound(bounds_ref, b, j), q_ref, k_ref[...], v_ref[...], do_ref, lse_ref, delta_ref,
                        st.fixed_col(kseg_ref, shape.block), qseg_ref, shape=shape, st=st)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dkv_grouped_kernel(bounds_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kseg_ref, qseg_ref, dk_ref, dv_ref,
                        dk_acc, dv_acc, *, shape: _Shape, st):
    """TPU: grid (row, KV head, key block, g). The query-side refs hold the G query heads of the KV head
    ([G, L, H], [G, 8, L]); step g adds head kv * G + g's share to float32 VMEM accumulators, and the last
    writes them once in the KV dtype (the dk/dv output block stays put along g, so Pallas writes it back
    once, after g = G - 1)."""
    from jax.experimental import pallas as pl

    b, j, g = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(g == 0)
    def _zero():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    dk, dv = _dkv_block(j, st.bound(bounds_ref, b, j), q_ref.at[g], k_ref[...], v_ref[...], do_ref.at[g],
                        lse_ref.at[g], delta_ref.at[g], st.fixed_col(kseg_ref, shape.block), qseg_ref,
                        shape=shape, st=st)
    dk_acc[...] += dk
    dv_acc[...] += dv

    @pl.when(g == shape.groups - 1)
    def _write():
        dk_ref[...] = dk_acc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_call wiring per style.

# TPU grids: (row, head, block) everywhere but the dk/dv kernel's (row, KV head, key block, g),
# whose g revisits one output block and so must run in order.
HEAD_GRID_SEMANTICS = ("parallel", "parallel", "arbitrary")
GROUPED_GRID_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")


def _compiler_params(shape: _Shape, vmem_bytes: int = 0, semantics: tuple[str, ...] = HEAD_GRID_SEMANTICS):
    if shape.interpret:
        return None
    if shape.style == GPU:
        from jax.experimental.pallas import triton as plgpu

        return plgpu.CompilerParams(num_warps=4 if shape.head_dim <= 64 else 8, num_stages=2)
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=_vmem_limit(vmem_bytes))


def _vmem_limit(need: int) -> int:
    from jax.experimental.pallas import tpu as pltpu

    limit = need + VMEM_HEADROOM
    try:
        capacity = pltpu.get_tpu_info().vmem_capacity_bytes
    except Exception:  # noqa: BLE001  (lowering for a TPU from another machine: no chip to ask)
        capacity = None
    if capacity is not None and need > capacity:
        raise ValueError(f"--attention flash keeps whole rows in TPU VMEM (keys and values; queries and output "
                         f"gradients of a KV head's query heads): {need / 2**20:.0f} MiB at this L, head_dim and "
                         f"grouping, the chip has {capacity / 2**20:.0f} MiB; use --attention splash or a shorter L")
    return limit if capacity is None else min(limit, capacity)


def _pallas(kernel, shape: _Shape, grid, in_specs, out_specs, out_shape, prefetch, name, vmem_bytes=0,
            scratch=(), semantics: tuple[str, ...] = HEAD_GRID_SEMANTICS):
    from jax.experimental import pallas as pl

    params = _compiler_params(shape, vmem_bytes, semantics)
    if shape.style == TPU:
        from jax.experimental.pallas import tpu as pltpu

        grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, in_specs=in_specs,
                                                 out_specs=out_specs, scratch_shapes=scratch)
        call = pl.pallas_call(kernel, grid_spec=grid_spec, out_shape=out_shape, compiler_params=params,
                              interpret=shape.interpret, name=name)
        return call(prefetch[0], *prefetch[1:])
    call = pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          compiler_params=params, interpret=shape.interpret, name=name)
    return call(*prefetch)


def _spec(block_shape, index_map):
    from jax.experimental import pallas as pl

    return pl.BlockSpec(block_shape, index_map)


def _lanes(x):
    """[..., L] -> [..., L, 128]: one value per row of a TPU vector tile (a column)."""
    return lax.broadcast_in_dim(x, (*x.shape, NUM_LANES), tuple(range(x.ndim)))


def _sublanes(x):
    """[..., L] -> [..., 8, L]: one value per lane (a row)."""
    return lax.broadcast_in_dim(x, (*x.shape[:-1], NUM_SUBLANES, x.shape[-1]), (*range(x.ndim - 1), x.ndim))


def _vmem_bytes(shape: _Shape, itemsize: int, heads: int = 1, accumulators: int = 0) -> int:
    """A TPU kernel's VMEM: its whole-row inputs, double-buffered (per head it reads, two [L, H] operands and two
    [8, L] float32 statistics rows; one [8, L] int32 segment-id row), and its [block, H] float32 accumulators."""
    row = NUM_SUBLANES * shape.length * 4
    whole_rows = 2 * (heads * (2 * shape.length * shape.head_dim * itemsize + 2 * row) + row)
    return whole_rows + accumulators * shape.block * shape.head_dim * 4


class _Specs:
    """The BlockSpecs of one style. Head-carrying arrays are [B, L, N|K, H] on a GPU (as given,
    no transposes) and [B, N|K, L, H] on a TPU (Mosaic tiles the last two dims); per-position
    rows [B, L] (segment ids, GPU bounds) and per-head statistics [B, N, L] (TPU: segment ids
    broadcast to lane or sublane tiles, statistics to sublane rows). `x` is the grid's third
    index: a query block, or a key block.

    grouped (the TPU dk/dv kernel): the grid's second index is a KV head, and the query-side
    whole rows (q, dO, statistics) are one block of that KV head's G query heads, fetched once
    per (row, KV head) and indexed by g inside the kernel."""

    def __init__(self, shape: _Shape, grouped: bool = False):
        self.s = shape
        self.grouped = grouped

    def heads(self, kv: bool, whole: bool = False):
        s, g = self.s, self.s.groups
        size = s.length if whole else s.block
        if self.grouped:
            heads = None if kv else g
            return _spec((None, heads, size, s.head_dim), lambda b, n, x, *_: (b, n, 0 if whole else x, 0))
        head = (lambda n: lax.div(n, g)) if kv and g > 1 else (lambda n: n)
        if s.style == GPU:
            return _spec((None, size, None, s.head_dim), lambda b, n, x, *_: (b, 0 if whole else x, head(n), 0))
        return _spec((None, None, size, s.head_dim), lambda b, n, x, *_: (b, head(n), 0 if whole else x, 0))

    def position_block(self):
        """Per-position values of the grid's block as a column: segment ids (and GPU bounds)."""
        s = self.s
        if s.style == GPU:
            return _spec((None, s.block), lambda b, n, x, *_: (b, x))
        return _spec((None, s.block, NUM_LANES), lambda b, n, x, *_: (b, x, 0))

    def position_row(self):
        """Per-position values of the whole row, sliced by the loop: segment ids."""
        s = self.s
        if s.style == GPU:
            return _spec((None, s.length), lambda b, n, x, *_: (b, 0))
        return _spec((None, NUM_SUBLANES, s.length), lambda b, n, x, *_: (b, 0, 0))

    def forward_stat(self):
        """The forward's log-sum-exp per query block (TPU: as the sublane rows the backward reads)."""
        return self.stat_block()

    def stat_block(self):
        """A query block's statistics for the dq kernel (TPU: its slice of the sublane rows dk/dv reads too)."""
        s = self.s
        if s.style == GPU:
            return _spec((None, None, s.block), lambda b, n, x, *_: (b, n, x))
        return _spec((None, None, NUM_SUBLANES, s.block), lambda b, n, x, *_: (b, n, 0, x))

    def stat_row(self):
        s = self.s
        if s.style == GPU:
            return _spec((None, None, s.length), lambda b, n, x, *_: (b, n, 0))
        heads = s.groups if self.grouped else None
        return _spec((None, heads, NUM_SUBLANES, s.length), lambda b, n, x, *_: (b, n, 0, 0))

    # The arrays those specs read, from [B, L] ids and [B, N, L] statistics.
    def as_block(self, x):
        return x if self.s.style == GPU else _lanes(x)

    def as_row(self, x):
        return x if self.s.style == GPU else _sublanes(x)

    def bounds(self, per_block):
        """[B, nblocks] bounds: scalar-prefetched as they are (TPU), per position (GPU)."""
        return jnp.repeat(per_block, self.s.block, axis=1) if self.s.style == GPU else per_block

    def bound_specs(self):
        return [self.position_block()] if self.s.style == GPU else []


def _style(shape: _Shape):
    return _Tpu if shape.style == TPU else _Gpu


def _forward(q, k, v, seg, shape: _Shape):
    """The output and the log-sum-exp (float32) the backward reads: [B, N, L] (GPU), [B, N, 8, L] sublane rows (TPU)."""
    sp = _Specs(shape)
    first, _ = key_tile_ranges(seg, shape.block, shape.window)
    grid = (shape.batch, shape.heads, shape.blocks)
    in_specs = sp.bound_specs() + [sp.heads(False), sp.heads(True, whole=True), sp.heads(True, whole=True),
                                   sp.position_block(), sp.position_row()]
    args = (sp.bounds(first), q, k, v, sp.as_block(seg), sp.as_row(seg))
    lse_shape = (shape.batch, shape.heads) + ((shape.length,) if shape.style == GPU else (NUM_SUBLANES, shape.length))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(lse_shape, jnp.float32)]
    kernel = functools.partial(_forward_kernel, shape=shape, st=_style(shape))
    o, lse = _pallas(kernel, shape, grid, in_specs, [sp.heads(False), sp.forward_stat()], out_shape, args,
                     "flash_forward", _vmem_bytes(shape, k.dtype.itemsize))
    return o, lse


def _backward(q, k, v, seg, o, lse, do, shape: _Shape):
    sp = _Specs(shape)
    first, _ = key_tile_ranges(seg, shape.block, shape.window)
    last = query_tile_ranges(first)
    # delta = rowsum(dO * O) per head and query position, float32, [B, N, L].
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    if shape.style == GPU:
        delta = delta.transpose(0, 2, 1)
    # TPU: one sublane-row copy of delta ([B, N, 8, L], as the forward wrote the log-sum-exp), read by both kernels.
    delta = sp.as_row(delta)
    st = _style(shape)

    dq_specs = sp.bound_specs() + [sp.heads(False), sp.heads(True, whole=True), sp.heads(True, whole=True), sp.heads(False),
                                   sp.stat_block(), sp.stat_block(), sp.position_block(), sp.position_row()]
    seg_block, seg_row = sp.as_block(seg), sp.as_row(seg)
    dq_args = (sp.bounds(first), q, k, v, do, lse, delta, seg_block, seg_row)
    dq = _pallas(functools.partial(_dq_kernel, shape=shape, st=st), shape, (shape.batch, shape.heads, shape.blocks),
                 dq_specs, sp.heads(False), jax.ShapeDtypeStruct(q.shape, q.dtype), dq_args, "flash_dq",
                 _vmem_bytes(shape, q.dtype.itemsize))
    dkv_args = (sp.bounds(last), q, k, v, do, lse, delta, seg_block, seg_row)
    dk, dv = (_dkv_grouped if shape.style == TPU else _dkv_summed)(dkv_args, k, shape)
    return dq, dk, dv


def _dkv_specs(sp: _Specs):
    return sp.bound_specs() + [sp.heads(False, whole=True), sp.heads(True), sp.heads(True), sp.heads(False, whole=True),
                               sp.stat_row(), sp.stat_row(), sp.position_block(), sp.position_row()]


def _dkv_grouped(args, k, shape: _Shape):
    """TPU: dk, dv summed over the G query heads of each KV head inside the kernel, [B, K, L, H] in k's dtype."""
    from jax.experimental.pallas import tpu as pltpu

    sp = _Specs(shape, grouped=True)
    grid = (shape.batch, shape.kv_heads, shape.blocks, shape.groups)
    out = jax.ShapeDtypeStruct(k.shape, k.dtype)
    accumulators = [pltpu.VMEM((shape.block, shape.head_dim), jnp.float32)] * 2
    kernel = functools.partial(_dkv_grouped_kernel, shape=shape, st=_Tpu)
    vmem = _vmem_bytes(shape, k.dtype.itemsize, heads=shape.groups, accumulators=2)
    return _pallas(kernel, shape, grid, _dkv_specs(sp), [sp.heads(True)] * 2, [out, out], args, "flash_dkv", vmem,
                   scratch=accumulators, semantics=GROUPED_GRID_SEMANTICS)


def _dkv_summed(args, k, shape: _Shape):
    """GPU: float32 dk, dv per query head (grid programs run in parallel: none can accumulate into another's
    output), then the G query heads of each KV head (head n belongs to KV head n // G) summed."""
    sp = _Specs(shape)
    q = args[1]
    grid = (shape.batch, shape.heads, shape.blocks)
    partial = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    kernel = functools.partial(_dkv_kernel, shape=shape, st=_style(shape))
    dk, dv = _pallas(kernel, shape, grid, _dkv_specs(sp), [sp.heads(False)] * 2, [partial, partial], args, "flash_dkv")
    sizes = list(q.shape)
    sizes[2:3] = [shape.kv_heads, shape.groups]  # [B, L, N, H] -> [B, L, K, G, H]
    return tuple(x.reshape(sizes).sum(axis=3).astype(k.dtype) for x in (dk, dv))


# ---------------------------------------------------------------------------------------------
# The differentiable op.


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, seg, shape: _Shape):
    return _forward(q, k, v, seg, shape)[0]


def _flash_fwd(q, k, v, seg, shape: _Shape):
    o, lse = _forward(q, k, v, seg, shape)
    return o, (q, k, v, seg, o, lse)


def _flash_bwd(shape: _Shape, res, do):
    q, k, v, seg, o, lse = res
    dq, dk, dv = _backward(q, k, v, seg, o, lse, do, shape)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(query: jax.Array, key: jax.Array, value: jax.Array, segment_ids: jax.Array, *,
                    window: int | None = None, block: int | None = None, style: str | None = None,
                    interpret: bool | None = None) -> jax.Array:
    """softmax(q k^T + mask) v for [B, L, N, H] scaled queries and [B, L, K, H] keys/values (N = K * G).

    The mask is blocked_attention's (same segment, causal, window; padding sees itself).
    style: "gpu" (Triton) or "tpu" (Mosaic); default by the backend, the GPU form elsewhere.
    interpret: Pallas interpret mode; default off on GPU and TPU, on elsewhere.
    """
    backend = jax.default_backend()
    style = style or (TPU if backend == "tpu" else GPU)
    if style not in STYLES:
        raise ValueError(f"unknown flash style {style!r}; choose one of {STYLES}")
    interpret = (backend not in ("gpu", "tpu")) if interpret is None else interpret
    b, length, n, h = query.shape
    kv_heads = key.shape[2]
    block = min(block or default_block(backend), length)
    if length % block:
        raise ValueError(f"--attention flash needs a sequence length that is a multiple of its block {block}, got {length}")
    if style == TPU and block % NUM_LANES:
        raise ValueError(f"--attention flash on a TPU needs blocks that are multiples of {NUM_LANES}, got {block}")
    if n % kv_heads:
        raise ValueError(f"{n} query heads do not group over {kv_heads} KV heads")
    padded = _padded_head_dim(h, style)
    q, k, v = (_pad_last(x, padded) for x in (query, key, value))
    if style == TPU:
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    shape = _Shape(b, length, n, kv_heads, padded, block, window, style, interpret)
    out = _flash(q, k, v, segment_ids.astype(jnp.int32), shape)
    if style == TPU:
        out = out.transpose(0, 2, 1, 3)
    return out[..., :h].astype(value.dtype)


def _padded_head_dim(h: int, style: str) -> int:
    """Triton blocks are powers of two; Mosaic's widening needs <= 128 or a multiple of 128."""
    if style == GPU:
        return max(16, 1 << (h - 1).bit_length())
    return h if h <= NUM_LANES else -(-h // NUM_LANES) * NUM_LANES


def _pad_last(x: jax.Array, size: int) -> jax.Array:
    # Zero columns add nothing to q k^T and give zero output columns (sliced off).
    return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])
