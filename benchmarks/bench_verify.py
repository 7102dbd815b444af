"""`prepack verify` rows/s, local and gs://, against reading the same shards raw in the same run.

For each max length, one synthetic shard set (testkit.shard_sets: 1..4 segments per row, rows
50-100% full, random ids, so zstd cannot shrink it much) is written, then timed:
- raw read: every shard's sha256 and every record read in order (ArrayRecordReader with
  readahead), nothing decoded: the disk-speed floor verify is held to;
- verify: apps.verify.verify_length (sha256, decode into numpy batches, every rule, the recount);
- per-row checker: the row-at-a-time way (ShardView[i], then rowformat.check_row), on the first
  --per-row-rows rows only;
- gs:// verify: the same set in the tests' GCS emulator (testkit/gcs_emulator.py) behind the
  proxy of benchmarks/bench_loader_gcs.py holding every request --delay-ms (default 50), a
  fresh shard cache each run, downloads included.

    python -m benchmarks.bench_verify
    python -m benchmarks.bench_verify --lengths 2048 --rows 4000 --delay-ms 50
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[512, 2048], help="max lengths (default 512 2048)")
    p.add_argument("--rows", nargs="+", type=int, default=[16_000, 4_000], help="rows per set, one per length (default 16000 4000)")
    p.add_argument("--num-shards", type=int, default=8, help="shards per set (default 8)")
    p.add_argument("--per-row-rows", type=int, default=2_000, help="rows the per-row checker reads (default 2000)")
    p.add_argument("--delay-ms", type=float, default=50.0, help="ms the proxy holds each gs:// request (default 50)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each local measurement, best kept (default 3)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def build(folder: str, max_length: int, num_rows: int, num_shards: int) -> int:
    """A synthetic set whose manifest carries the figures verify recounts; returns its bytes."""
    import numpy as np

    from testkit.shard_sets import build_shard_set

    manifest = build_shard_set(folder, num_rows=num_rows, num_shards=num_shards, max_length=max_length)
    with open(os.path.join(folder, "manifest.json")) as f:
        data = json.load(f)
    from loaders import open_shards

    with open_shards(folder) as view:
        segments = np.concatenate([b["segment_ids"].max(axis=1) for k in range(num_shards) for b in view.scan(k)])
    data["stats"].update(rows=num_rows, segments_per_row={"min": int(segments.min()), "mean": float(segments.mean()),
                                                          "max": int(segments.max())})
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return sum(s.num_bytes for s in manifest.shards)


def raw_read(folder: str) -> int:
    """sha256 and every record of every shard, in order, undecoded; returns the rows read."""
    from array_record.python.array_record_module import ArrayRecordReader

    from prepack import storage
    from loaders.shards import _SCAN_OPTIONS, read_manifest

    rows = 0
    for info in read_manifest(folder).shards:
        path = os.path.join(folder, info.path)
        assert storage.sha256(path) == info.sha256
        reader = ArrayRecordReader(path, _SCAN_OPTIONS)
        count = reader.num_records()
        for start in range(0, count, 256):
            rows += len(reader.read(start, min(count, start + 256)))
        reader.close()
    return rows


def per_row(folder: str, limit: int) -> int:
    from loaders import open_shards
    from prepack.format import rowformat

    with open_shards(folder) as view:
        n = min(limit, len(view))
        for i in range(n):
            rowformat.check_row(view[i], view.max_length)
    return n


def verify_rows(path: str) -> int:
    from apps.verify import verify_length

    result = verify_length(path)
    assert result.failure is None, result.failure
    return result.recount.rows


def timed(fn, repeats: int) -> dict:
    best = None
    for _ in range(repeats):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        rows = fn()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if best is None or wall < best["seconds"]:
            best = {"rows": rows, "seconds": wall, "rows_per_s": rows / wall, "cpu_us_per_row": 1e6 * cpu / rows}
    return best


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = _parse(raw)
    if len(args.rows) != len(args.lengths):
        print("error: give one --rows per --lengths", file=sys.stderr)
        return 2
    from testkit.gcs_emulator import start_emulator
    from testkit.http_delay_proxy import start_proxy

    results = []
    with tempfile.TemporaryDirectory(prefix="bench_verify_") as tmp, start_emulator(os.path.join(tmp, "emulator")) as emulator:
        for max_length, num_rows in zip(args.lengths, args.rows):
            folder = os.path.join(tmp, f"L{max_length}")
            set_bytes = build(folder, max_length, num_rows, args.num_shards)
            url = emulator.url("sets", f"L{max_length}")
            for name in sorted(os.listdir(folder)):
                emulator.upload_file(os.path.join(folder, name), f"{url}/{name}")
            base = {"max_length": max_length, "rows_in_set": num_rows, "set_mb": set_bytes / 1e6}
            raw_read(folder)  # warms the page cache: every local measurement reads from memory alike
            results.append({**base, "what": "raw read (sha256 + records, local)", **timed(lambda: raw_read(folder), args.repeats)})
            results.append({**base, "what": "prepack verify, local", **timed(lambda: verify_rows(folder), args.repeats)})
            results.append({**base, "what": f"per-row check_row, local (first {args.per_row_rows:,} rows)",
                            **timed(lambda: per_row(folder, args.per_row_rows), 1)})
            with start_proxy(emulator.endpoint, delay_ms=args.delay_ms) as proxy:
                os.environ["STORAGE_EMULATOR_HOST"] = proxy.endpoint

                def remote() -> int:
                    os.environ["PREPACK_SHARD_CACHE"] = tempfile.mkdtemp(prefix="cache_", dir=tmp)
                    try:
                        return verify_rows(url)
                    finally:
                        shutil.rmtree(os.environ.pop("PREPACK_SHARD_CACHE"), ignore_errors=True)

                results.append({**base, "what": f"prepack verify, gs:// ({args.delay_ms:g} ms per request, fresh cache)",
                                **timed(remote, 1)})
                os.environ["STORAGE_EMULATOR_HOST"] = emulator.endpoint
            print(f"done L{max_length}", file=sys.stderr)
    report(results, raw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def report(results: list[dict], argv: Sequence[str]) -> None:
    import platform

    print(f"\nHost: {os.cpu_count()} cores, Python {platform.python_version()}.\n")
    print("| L | rows | set MB | what | rows/s | vs raw read | CPU µs/row |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    raw = {r["max_length"]: r["rows_per_s"] for r in results if r["what"].startswith("raw read")}
    for r in results:
        print(f"| {r['max_length']} | {r['rows']:,} | {r['set_mb']:.0f} | {r['what']} | {r['rows_per_s']:,.0f} | "
              f"{r['rows_per_s'] / raw[r['max_length']]:.2f}× | {r['cpu_us_per_row']:.0f} |")
    print("\nCommand: `" + " ".join(["python -m benchmarks.bench_verify", *argv]) + "`")


if __name__ == "__main__":
    sys.exit(main())
