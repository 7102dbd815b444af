"""Chooses the row record encoding by measurement.

Compares the int32 [5, L] layout of prepack.format.rowformat with a narrow layout
(int32 ids, uint16 positions/segments, uint8 masks), on disk with and
without zstd, and the decode time of one row.

    python -m benchmarks.bench_row_encoding --max-length 2048 --rows 2000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import timeit

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

from prepack.format import rowformat


def synthetic_rows(n: int, max_length: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Rows packed from zipf-distributed token ids and lognormal example lengths (SFT-like)."""
    rng = np.random.default_rng(seed)
    # Frequent tokens are not small ids in real vocabularies: map zipf ranks to random ids.
    rank_to_id = rng.permutation(262_144).astype(np.int32)
    rows = []
    for _ in range(n):
        segments, used = [], 0
        while True:
            length = int(np.clip(rng.lognormal(4.3, 0.8), 8, max_length))
            if used + length > max_length:
                break
            ids = rank_to_id[np.minimum(rng.zipf(1.2, length), 262_143)]
            mask = np.zeros(length, np.uint8)
            mask[length // 3 :] = 1
            segments.append(rowformat.Segment(ids, mask))
            used += length
        rows.append(rowformat.build_row(segments or [rowformat.Segment(np.ones(4, np.int32), np.ones(4, np.uint8))], max_length))
    return rows


# The alternative that was measured and not chosen: int32 ids, uint16
# positions/segments, uint8 masks (10 bytes per token instead of 20).
NARROW = {"input_ids": "<i4", "loss_mask": "u1", "valid_mask": "u1", "positions": "<u2", "segment_ids": "<u2"}


def encode_narrow(row, max_length):
    return b"".join(np.asarray(row[f]).astype(dt).tobytes() for f, dt in NARROW.items())


def decode_narrow(record, max_length, widen):
    out, offset = {}, 0
    for f, dt in NARROW.items():
        dt = np.dtype(dt)
        v = np.frombuffer(record, dt, count=max_length, offset=offset)
        offset += dt.itemsize * max_length
        out[f] = v.astype(np.int32) if widen and dt != np.int32 else v
    return out


def file_bytes(records, options):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.array_record")
        w = ArrayRecordWriter(path, options)
        for r in records:
            w.write(r)
        w.close()
        size = os.path.getsize(path)
        reader = ArrayRecordReader(path)
        idx = list(np.random.default_rng(0).permutation(len(records))[:500])
        t = timeit.timeit(lambda: [reader.read([i]) for i in idx], number=3) / (3 * len(idx))
        reader.close()
    return size, t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=2000)
    args = ap.parse_args()
    L = args.max_length
    rows = synthetic_rows(args.rows, L)
    tokens = args.rows * L
    layouts = {
        "int32 [5, L] (rowformat v1, chosen)": (lambda r: rowformat.encode_row(r, L), lambda b: rowformat.decode_row(b, L),
                                                lambda b: rowformat.decode_row(b, L)),
        "narrow dtypes": (lambda r: encode_narrow(r, L), lambda b: decode_narrow(b, L, False),
                          lambda b: decode_narrow(b, L, True)),
    }
    print(f"L={L}, rows={args.rows}")
    print("| layout | raw B/token | zstd:3 B/token | uncompressed file B/token | decode views (us) | decode to int32 (us) | read 1 record (us, zstd) |")
    print("|---|---|---|---|---|---|---|")
    for name, (enc, dec_view, dec_wide) in layouts.items():
        records = [enc(r) for r in rows]
        rec = records[0]
        n = 20000
        t_view = timeit.timeit(lambda: dec_view(rec), number=n) / n * 1e6
        t_wide = timeit.timeit(lambda: dec_wide(rec), number=n) / n * 1e6
        z_size, t_read = file_bytes(records, "group_size:1,zstd:3")
        u_size, _ = file_bytes(records, "group_size:1,uncompressed")
        print(f"| {name} | {len(rec) / L:.1f} | {z_size / tokens:.2f} | {u_size / tokens:.2f} | {t_view:.2f} | {t_wide:.2f} | {t_read * 1e6:.1f} |")


if __name__ == "__main__":
    main()
