"""The loss head in one kernel: a chunk's NLL and dL/dh without its [N, V] logits in memory.

The chunked loss (train/step/chunked_loss.py) computes, per chunk of N positions, the logits
z = h W^T against the frozen output projection W [V, D], then lse(z) - z_target and, for the
backward pass, dL/dh = softmax(z) W - W[target]. Through XLA the [N, V] logits are written
to and read back from HBM several times (matmul out, logsumexp, the softmax's gradient, the
second matmul's operand): on a TPU those passes cost more than the two matmuls themselves
(Gemma3's V = 262,144).

Both results are one attention forward: queries h, keys W, values W, one head, no mask and
no scaling. Its output is softmax(h W^T) W and its log-sum-exp residual is lse(z). So JAX's
splash kernel (jax.experimental.pallas.ops.tpu.splash_attention, MQA form: one shared key
and value array) computes them with the logits kept on chip, an online softmax over vocabulary
blocks, and the same two matmuls per position (4 N V D FLOPs, as through XLA). The target's
logit and W[target] are a gather of N rows, done in XLA.

Used where it is exact and compiles: a TPU (Mosaic), bfloat16 projections, no final logit
soft-cap (its derivative is not attention-shaped). A vocabulary that is no multiple of the
key block is padded with zero rows that a key segment id masks out. Elsewhere `reason_unfused`
says why and the chunked loss keeps the XLA path. On other backends the kernel runs in Pallas
interpret mode, for tests only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

AUTO, XLA, FUSED = "auto", "xla", "fused"
KINDS = (AUTO, XLA, FUSED)
LANES = 128
# Queries per kernel block: the vocabulary (2 x V x D bytes, as keys and as values) is streamed
# once per query block, so a block of bq queries does bq FLOPs per byte read; v5e's MXU needs
# about 240 (197 TFLOP/s over 819 GB/s). 512 keeps the block's buffers and float32 accumulator
# (about 9 MiB at D 640) inside the default scoped VMEM.
QUERY_BLOCK = 512
KEY_BLOCK = 512


def use_fused(kind: str, dtype: object, softcap: float | None, backend: str | None = None) -> bool:
    """--loss-kernel: fused where asked (refused earlier where it cannot be exact), and under auto
    on a TPU wherever it is exact; XLA otherwise."""
    if kind == XLA:
        return False
    if kind == FUSED:
        return True
    return (backend or jax.default_backend()) == "tpu" and reason_unfused(dtype, softcap) is None


def reason_unfused(dtype: object, softcap: float | None) -> str | None:
    """Why the fused head would not compute what the XLA path does, or None (bfloat16, no soft-cap)."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return f"a {jnp.dtype(dtype).name} projection (the kernel's matmuls are bfloat16; float32 stays exact through XLA)"
    if softcap:
        return "a final logit soft-cap (its gradient is not softmax(z) W)"
    return None


def chunk_tokens_for(chunk_tokens: int) -> int:
    """The query block the kernel uses for a chunk: QUERY_BLOCK or the chunk itself when smaller
    (a chunk must be a multiple of 128 positions)."""
    return min(QUERY_BLOCK, chunk_tokens)


def check_chunk(chunk_tokens: int) -> str | None:
    block = chunk_tokens_for(chunk_tokens)
    if chunk_tokens % LANES or chunk_tokens % block:
        return (f"--loss-chunk-tokens {chunk_tokens} with the fused head: use a multiple of {LANES} "
                f"(and of {QUERY_BLOCK} above it)")
    return None


def _kernel(chunk_tokens: int, vocab_padded: int, key_block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    bq = chunk_tokens_for(chunk_tokens)
    sizes = splash.BlockSizes(block_q=bq, block_kv=key_block, block_kv_compute=key_block)
    mask = mask_lib.MultiHeadMask([mask_lib.FullMask((chunk_tokens, vocab_padded))])
    with jax.ensure_compile_time_eval():  # the mask's block tables are constants, not the trace's values
        return splash.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, save_residuals=True,
                                      interpret=interpret)


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """The projection as the kernel reads it, made once per step (`prepare`), outside the chunk loop:
    rows [V', D] bfloat16 (V' = V padded to a multiple of key_block), and real [V'] int32 (1 for a
    vocabulary row, 0 for padding) where V' != V."""

    rows: jax.Array
    real: jax.Array | None
    key_block: int


def prepare(matrix: jax.Array, transposed: bool) -> Vocabulary:
    """matrix [V, D] when transposed, else [D, V] -> the kernel's keys and values. Made inside the chunk
    loop, the cast, transpose or padding copied the whole [V, D] projection once per chunk: Qwen3's
    151,936 rows are no multiple of 512, and its (8, 2048) step on a v5e took 1.2% longer at
    --loss-chunk-tokens 512 than at 1024 (twice the chunks, twice the copies; docs/benchmarks.md)."""
    w = (matrix if transposed else matrix.T).astype(jnp.bfloat16)  # [V, D]
    vocab = w.shape[0]
    key_block = KEY_BLOCK if vocab >= KEY_BLOCK else LANES
    padded = -(-vocab // key_block) * key_block
    if padded == vocab:
        return Vocabulary(w, None, key_block)
    rows = jnp.pad(w, ((0, padded - vocab), (0, 0)))
    return Vocabulary(rows, jnp.asarray(np.arange(padded) < vocab, jnp.int32), key_block)  # 0: padding, never matched


def nll_and_dh(vocabulary: Vocabulary, h: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One chunk: h [N, D] and int targets [N] against the prepared projection -> (NLL [N] float32,
    dL/dh [N, D] in h's dtype)."""
    w = vocabulary.rows
    hq = h.astype(jnp.bfloat16)
    segments = None
    if vocabulary.real is not None:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

        segments = splash.SegmentIds(q=jnp.ones((h.shape[0],), jnp.int32), kv=vocabulary.real)
    kernel = _kernel(int(h.shape[0]), int(w.shape[0]), vocabulary.key_block, jax.default_backend() != "tpu")
    out, (lse,) = kernel(hq[None], w, w, segment_ids=segments)
    rows = jnp.take(w, targets, axis=0)  # [N, D]: W[target]
    target_logit = jnp.einsum("nd,nd->n", hq, rows, preferred_element_type=jnp.float32)
    nll = lse[0].astype(jnp.float32) - target_logit
    dh = out[0].astype(jnp.float32) - rows.astype(jnp.float32)
    return nll, dh.astype(h.dtype)
