"""Peak memory of the packing job's processes as the input grows, at a fixed shard target.

    python -m benchmarks.bench_worker_memory --data DATA/opus_en_fr.jsonl --examples 1000000 2000000 3000000 \\
        [--workers auto|N] [--code-dir OTHER_CHECKOUT] [--work-dir /tmp/bench_worker_memory] [--keep-data]

For each size it writes unique translation pairs (the sample's pairs, each copy suffixed
with its copy number so no two examples are equal) to the work folder, runs
`prepack pack --format translation --max-length 512 1024 2048` on the default local runner
(FnApiRunner, multi-processing; `--workers auto` lets the job choose the number of SDK workers
from the input size, `--workers N` passes --direct_num_workers=N, the fixed count the job used
before), and samples every process of the run every 0.2 s: peak RSS (Linux VmHWM) of the
launcher and of each SDK worker.

Reports per size: launcher peak, largest SDK worker peak, shards per L, wall time, and
the ratios to the smallest size (flat = bounded by the window, not by the input).
`--code-dir` runs another checkout's code on the same files (the baseline in the same run).
The generated files are deleted at the end unless --keep (outputs too) or --keep-data.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def write_unique_pairs(source: Path, n: int, dest: Path) -> None:
    pairs = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    with dest.open("w", encoding="utf-8") as f:
        for i in range(n):
            copy, k = divmod(i, len(pairs))
            p = pairs[k]
            f.write(json.dumps({"en": f"{p['en']} ({copy})", "fr": f"{p['fr']} ({copy})"}, ensure_ascii=False) + "\n")


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _hwm_kb(pid: int) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        return int(fields["VmHWM"].split()[0]), cmd
    except (OSError, KeyError, ValueError):
        return None


def run_and_sample(cmd: list[str], env: dict[str, str], cwd: str, log: Path) -> dict:
    """Runs cmd; peak RSS (MB) of the launcher and of every SDK worker process it starts."""
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        peaks: dict[int, tuple[int, str]] = {}
        while proc.poll() is None:
            todo, seen = [proc.pid], set()
            while todo:
                pid = todo.pop()
                if pid in seen:
                    continue
                seen.add(pid)
                got = _hwm_kb(pid)
                if got:
                    peaks[pid] = (max(got[0], peaks.get(pid, (0, ""))[0]), got[1])
                todo += _children(pid)
            time.sleep(0.2)
    wall = time.monotonic() - started
    launcher = peaks.get(proc.pid, (0, ""))[0] / 1024
    workers = sorted((kb / 1024 for pid, (kb, c) in peaks.items() if "sdk_worker_main" in c and "python" in c.split(" ")[0]), reverse=True)
    return {"rc": proc.returncode, "wall_s": wall, "launcher_mb": launcher, "workers_mb": workers}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, type=Path, help="a JSONL file of {en, fr} pairs")
    ap.add_argument("--examples", nargs="+", type=int, default=[500_000, 1_000_000, 2_000_000])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/bench_worker_memory"))
    ap.add_argument("--code-dir", type=Path, default=REPO, help="checkout whose code runs (default: this one)")
    ap.add_argument("--target-shard-mb", type=float, default=256.0)
    ap.add_argument("--workers", default="auto", help="auto (the job chooses) or a fixed --direct_num_workers")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--keep-data", action="store_true", help="keep the generated inputs for another run")
    args = ap.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    code = str(args.code_dir.resolve())
    env = dict(os.environ, PYTHONPATH=code)
    rows = []
    for n in args.examples:
        data = args.work_dir / f"en_fr_unique_{n}.jsonl"
        if not data.exists():
            write_unique_pairs(args.data, n, data)
        out = args.work_dir / f"out_{n}"
        shutil.rmtree(out, ignore_errors=True)
        cmd = [sys.executable, "-m", "apps.cli", "pack", "--input", str(data), "--format", "translation",
               "--max-length", "512", "1024", "2048", "--output", str(out), "--no-progress",
               "--target-shard-mb", str(args.target_shard_mb)]
        if args.workers != "auto":
            cmd.append(f"--direct_num_workers={int(args.workers)}")
        result = run_and_sample(cmd, env, code, args.work_dir / f"log_{n}.txt")
        shards = {}
        for L in (512, 1024, 2048):
            manifest = out / f"L{L}" / "manifest.json"
            if manifest.exists():
                m = json.loads(manifest.read_text())
                shards[L] = (len(m["shards"]), max(s["num_bytes"] for s in m["shards"]) / 2**20)
        rows.append((n, result, shards))
        w = result["workers_mb"]
        print(f"{n:>10,} examples: rc {result['rc']}, wall {result['wall_s']:.0f} s, launcher {result['launcher_mb']:,.0f} MB, "
              f"{len(w)} SDK workers {', '.join(f'{x:,.0f}' for x in w)} MB, shards per L (largest MB) "
              f"{ {L: f'{c} ({mb:.0f})' for L, (c, mb) in shards.items()} }", flush=True)
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    base_n, base, _ = rows[0]
    print(f"\n| examples | workers ({args.workers}) | launcher peak MB | largest SDK worker peak MB | worker ÷ {base_n:,} "
          f"| launcher KB per example | wall s |")
    print("|---|---|---|---|---|---|---|")
    for n, r, _ in rows:
        top = max(r["workers_mb"] or [0])
        ratio = top / max(base["workers_mb"] or [1])
        print(f"| {n:,} | {len(r['workers_mb'])} | {r['launcher_mb']:,.0f} | {top:,.0f} | {ratio:.2f} | {r['launcher_mb'] * 1024 / n:.2f} | {r['wall_s']:.0f} |")
    if not args.keep and not args.keep_data:
        for n in args.examples:
            (args.work_dir / f"en_fr_unique_{n}.jsonl").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
