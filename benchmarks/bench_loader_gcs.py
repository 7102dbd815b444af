"""Reading shard sets from gs:// at step speed: rows/s and host CPU per row at 20 and 50 ms per request.

The rig, all on this machine and rerunnable:
- the GCS emulator of the tests (tests/gcs_emulator.py), holding the shard sets;
- a proxy in front of it that holds every request 20 or 50 ms and counts them
  (testkit/http_delay_proxy.py): the round trip to real GCS, minus TLS;
- a network namespace with loopback only (`unshare -rn`), so nothing leaves
  the machine and nothing else shares the path. The script re-runs itself
  inside one unless --no-netns.

Each run: a fresh shard cache, make_dataset with its defaults (one host, seed 0),
then `--batches` batches (default: one epoch). Reported per run: time from the
make_dataset call to the first batch, rows/s over the whole run (from the
make_dataset call, so the downloads count), rows/s after the first batch,
client CPU µs per row (process_time of this process, all threads: the
downloads and hashing included; the emulator and proxy are other processes),
and HTTP requests per row seen by the proxy. The same sets are read from local
disk in the same run: the baseline for CPU, and the stand-in for a gcsfuse
mount with a warm file cache (a local path with read_threads=16, the loader's
choice on a FUSE mount).

    python -m benchmarks.bench_loader_gcs                          # 8x2048 and 16x512, 20 and 50 ms
    python -m benchmarks.bench_loader_gcs --shapes 8x2048 --delays 50 --batches 300
    python -m benchmarks.bench_loader_gcs --code /path/to/other/checkout --batches 300   # same rig, other loader code
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IN_NETNS_FLAG = "--in-netns"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["8x2048", "16x512"], help="BxL shapes (default 8x2048 16x512)")
    p.add_argument("--delays", nargs="+", type=float, default=[20.0, 50.0], help="ms each request is held (default 20 50)")
    p.add_argument("--batches", type=int, default=None, help="batches per run (default: one epoch of the set)")
    p.add_argument("--min-rows", type=int, default=16_384, help="rows in each shard set (packed rows repeated)")
    p.add_argument("--num-shards", type=int, default=8, help="shards per set (default 8)")
    p.add_argument("--synthetic", action="store_true", help="synthetic rows even if the real samples are there")
    p.add_argument("--code", default=None, help="import loaders/prepack from this checkout instead (for before/after)")
    p.add_argument("--no-netns", action="store_true", help="run in the current network namespace")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument(IN_NETNS_FLAG, action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _reexec_in_netns(argv: list[str]) -> int:
    """Runs this script again in a new user+network namespace where only loopback exists."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        print("error: unshare and ip (util-linux, iproute2) are needed for the loopback-only namespace; "
              "install them or pass --no-netns", file=sys.stderr)
        return 2
    cmd = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", sys.executable, "-m", "benchmarks.bench_loader_gcs", *argv, IN_NETNS_FLAG]
    return subprocess.call(cmd, cwd=ROOT)


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = _parse(raw)
    if not args.no_netns and not args.in_netns:
        return _reexec_in_netns(raw)
    if args.code:
        sys.path.insert(0, os.path.abspath(args.code))
    import loaders  # noqa: F401  (first, so --code decides which loaders every later import sees)

    from benchmarks import bench_loader
    from testkit.gcs_emulator import start_emulator
    from testkit.http_delay_proxy import start_proxy

    try:
        if args.synthetic:
            raise ImportError("--synthetic")
        examples = bench_loader.RealExamples(bench_loader.DATA_DIR)
    except (ImportError, FileNotFoundError) as e:
        print(f"note: {e}; using synthetic examples", file=sys.stderr)
        examples = bench_loader.SyntheticExamples()
    tokenized = [examples.tokenize(item) for item in examples.records]

    results = []
    with tempfile.TemporaryDirectory(prefix="bench_loader_gcs_") as tmp, start_emulator(os.path.join(tmp, "emulator")) as emulator:
        for batch_size, max_length in bench_loader.parse_shapes(args.shapes):
            shape = f"{batch_size}x{max_length}"
            folder = os.path.join(tmp, "sets", f"L{max_length}")
            _, n_rows = build_set(bench_loader, tokenized, max_length, folder, examples.identity(), args.min_rows, args.num_shards)
            url = emulator.url("sets", f"{shape}-L{max_length}")
            set_bytes = 0
            for name in sorted(os.listdir(folder)):
                emulator.upload_file(os.path.join(folder, name), f"{url}/{name}")
                set_bytes += os.path.getsize(os.path.join(folder, name))
            batches = args.batches or n_rows // batch_size
            base = {"shape": shape, "rows_in_set": n_rows, "set_bytes": set_bytes, "shards": args.num_shards, "batches": batches}

            results.append({**base, "source": "local disk (defaults)", **run(folder, batch_size, batches, tmp)})
            results.append({**base, "source": "local path as gcsfuse stand-in (read_threads=16)", **run(folder, batch_size, batches, tmp, read_threads=16)})
            for delay in args.delays:
                with start_proxy(emulator.endpoint, delay_ms=delay) as proxy:
                    os.environ["STORAGE_EMULATOR_HOST"] = proxy.endpoint
                    os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = proxy.endpoint  # older loaders read gs:// in C++
                    proxy.reset()
                    m = run(url, batch_size, batches, tmp)
                    stats = proxy.stats()
                    os.environ["STORAGE_EMULATOR_HOST"] = os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = emulator.endpoint
                m.update(requests=stats["requests"], connections=stats["connections"], requests_per_row=stats["requests"] / m["rows"],
                         mb_down=stats["bytes_down"] / 1e6)
                results.append({**base, "source": f"gs://, {delay:g} ms per request", **m})
            print(f"done {shape}", file=sys.stderr)

    report(results, examples.description, raw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def build_set(bench_loader, tokenized, max_length: int, folder: str, identity: dict, min_rows: int, num_shards: int) -> tuple[int, int]:
    """The packed set of bench_loader.build_prepacked, with `num_shards` shards.

    The repeated rows are shuffled (fixed seed) so that no two shards hold the same
    bytes: the shard cache is content-addressed and would fetch identical shards once.
    """
    import numpy as np

    from testkit import plans
    from prepack.format import rowformat
    from shardset_builder import build_shard_set

    examples = [bench_loader.truncate(e, max_length) for e in tokenized]
    plan = plans.pack_best_fit_decreasing([len(e[0]) for e in examples], max_length)
    rows = [rowformat.build_row([rowformat.Segment(*examples[i]) for i in row], max_length) for row in plan]
    written = rows * max(1, -(-min_rows // len(rows)))
    written = [written[i] for i in np.random.default_rng(0).permutation(len(written))]
    build_shard_set(folder, rows=written, num_shards=num_shards, max_length=max_length, tokenizer=identity)
    return len(rows), len(written)


def run(path: str, batch_size: int, batches: int, tmp: str, **options) -> dict:
    """make_dataset with its defaults (plus `options`) on a fresh shard cache; times `batches` batches."""
    import loaders

    cache = tempfile.mkdtemp(prefix="cache_", dir=tmp)
    os.environ["PREPACK_SHARD_CACHE"] = cache  # older loaders ignore it
    cpu0, wall0 = time.process_time(), time.perf_counter()
    it = iter(loaders.make_dataset(path, batch_size, seed=0, shard_index=0, shard_count=1, **options))
    rows = len(next(it)["input_ids"])
    first = time.perf_counter() - wall0
    for _ in range(batches - 1):
        rows += len(next(it)["input_ids"])
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    if hasattr(it, "close"):
        it.close()
    shutil.rmtree(cache, ignore_errors=True)
    return {
        "rows": rows,
        "first_batch_s": first,
        "rows_per_s": rows / wall,
        "rows_per_s_after_first": (rows - batch_size) / max(wall - first, 1e-9),
        "cpu_us_per_row": 1e6 * cpu / rows,
    }


def report(results: list[dict], inputs: str, argv: Sequence[str]) -> None:
    import platform

    print(f"\nInputs: {inputs}. Host: {os.cpu_count()} cores, Python {platform.python_version()}. "
          "gs:// through the GCS emulator behind a delaying proxy, loopback-only network namespace.\n")
    print("| B×L | source | first batch s | rows/s | rows/s after first | CPU µs/row | CPU vs local | requests/row | connections |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    local = {r["shape"]: r["cpu_us_per_row"] for r in results if r["source"].startswith("local disk")}
    for r in results:
        req = f"{r['requests_per_row']:.4f}" if "requests_per_row" in r else "–"
        conns = str(r["connections"]) if "connections" in r else "–"
        print(f"| {r['shape']} | {r['source']} | {r['first_batch_s']:.2f} | {r['rows_per_s']:,.0f} | {r['rows_per_s_after_first']:,.0f} | "
              f"{r['cpu_us_per_row']:.0f} | {r['cpu_us_per_row'] / local[r['shape']]:.2f}× | {req} | {conns} |")
    print()
    for r in results:
        if r["source"].startswith("local disk"):
            print(f"- {r['shape']}: {r['rows']:,} rows read ({r['batches']} batches) of a set of {r['rows_in_set']:,} rows in "
                  f"{r['shards']} shards, {r['set_bytes'] / 1e6:.0f} MB.")
    print("\nCommand: `" + " ".join(["python -m benchmarks.bench_loader_gcs", *[a for a in argv if a != IN_NETNS_FLAG]]) + "`")


if __name__ == "__main__":
    sys.exit(main())
