"""Reference implementations: the slow, obvious versions that the shipped fast paths are
tested against, and small inverses the tests read rows back with. Not shipped."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from prepack.format.rowformat import encode_rows_flat
from prepack.format import rowformat
from prepack.format.rowformat import Segment


@dataclasses.dataclass(frozen=True)
class Slot:
    row: int
    position: int  # the segment's index within the row


def slots_by_length(plan: Sequence[Sequence[int]]) -> dict[int, list[Slot]]:
    """For each length, its slots in row order: the k-th example of that length goes to the k-th slot."""
    out: dict[int, list[Slot]] = {}
    for row_index, row in enumerate(plan):
        for position, length in enumerate(row):
            out.setdefault(length, []).append(Slot(row_index, position))
    return out


def pack_unpacked(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """One item per row, in input order: the baseline every packed run is compared to."""
    for i, n in enumerate(lengths):
        if not 0 < n <= max_length:
            raise ValueError(f"item {i} has length {n}, outside 1..{max_length}")
    return [[i] for i in range(len(lengths))]


def encode_rows(
    rows: Sequence[Sequence[tuple[bytes, bytes]]], max_length: int, pad_id: int = 0
) -> Iterator[tuple[bytes, int, int]]:
    """For each row (a list of (int32 ids bytes, uint8 loss-mask bytes) segments): its
    encoded record, its real tokens and its target tokens."""
    seg_counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    segments = [seg for row in rows for seg in row]
    lens = np.fromiter((len(mask) for _, mask in segments), dtype=np.int64, count=len(segments))
    ids = np.frombuffer(b"".join(ids for ids, _ in segments), dtype=rowformat.STORAGE_DTYPE)
    mask = np.frombuffer(b"".join(m for _, m in segments), dtype=np.uint8)
    return encode_rows_flat(seg_counts, lens, ids, mask, max_length, pad_id)


def split_segments(row: Mapping[str, np.ndarray]) -> list[Segment]:
    """The inverse of build_row, up to the zeroed first-token loss."""
    seg = np.asarray(row["segment_ids"])
    out = []
    for k in range(1, int(seg.max(initial=0)) + 1):
        idx = np.flatnonzero(seg == k)
        out.append(Segment(np.asarray(row["input_ids"])[idx], np.asarray(row["loss_mask"])[idx]))
    return out


def sub_bucket(h: int, num_sub_buckets: int) -> int:
    """pipelines.planning.sub_buckets_of for one hash. Monotone in h (multiply-shift), so
    ordering by (b, h) is ordering by h."""
    return (h * num_sub_buckets) >> 64


def checkpointed_chunked_token_nll(h, projection, targets, chunk_tokens: int):
    """The chunked loss before targets-first chunks and the fused head VJP (train/step/chunked_loss.py at 90b4e18):
    every position projected, each chunk under jax.checkpoint (forward, recompute, backward: three
    projections per chunk). The baseline of benchmarks/bench_loss_skip.py and the tests' reference."""
    import jax
    import jax.numpy as jnp

    b, length, d = h.shape
    n = b * length
    chunks = -(-n // chunk_tokens)
    pad = chunks * chunk_tokens - n
    flat_h = jnp.pad(h.reshape(n, d), ((0, pad), (0, 0))).reshape(chunks, chunk_tokens, d)
    flat_t = jnp.pad(targets.reshape(n).astype(jnp.int32), (0, pad)).reshape(chunks, chunk_tokens)

    @jax.checkpoint
    def chunk_nll(args):
        hc, tc = args
        logits = projection.logits(hc).astype(jnp.float32)
        target_logit = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
        return jax.nn.logsumexp(logits, axis=-1) - target_logit

    nll = jax.lax.map(chunk_nll, (flat_h, flat_t))
    return nll.reshape(-1)[:n].reshape(b, length)
