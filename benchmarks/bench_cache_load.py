"""Where a persistent-cache hit's seconds go: a cached executable's load against what it holds.

A cache hit of Gemma3 270M's (8, 2048) train step reaches step 1 in ~22 s on a v5e, 14 s of it
inside JAX's `deserialize_executable` (docs/benchmarks.md). This probe separates the suspects on
one device: N flash attentions (forward and backward; Mosaic kernels on a TPU) against the same N
as XLA's dense attention, and a program of N small arguments. Each case compiles cold in one fresh
process (its own cache folder) and loads in a second, which must be a cache hit (JAX's
`/jax/compilation_cache/cache_hits` event; a miss is recorded as such, never as a load time).

    python3 -m benchmarks.bench_cache_load --out DIR [--cases flash:1,flash:18,dense:18,flash:54,args:300]

The parent imports no JAX and opens no device (each child holds the chip alone, as on a TPU only
one process can). JSON out: DIR/bench_cache_load.json, with the machine line and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import device_machine, results_file

RESULTS_NAME = "bench_cache_load.json"
KINDS = ("flash", "dense", "args")
DEFAULT_CASES = "flash:1,flash:18,dense:18,flash:54,args:300"
MARK = "CACHE_LOAD "
CACHE_HIT, CACHE_MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def parse_case(text: str) -> tuple[str, int]:
    kind, _, count = text.partition(":")
    if kind not in KINDS or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"case {text!r}: write KIND:N, KIND one of {', '.join(KINDS)}, N >= 1")
    return kind, int(count)


def _program(kind: str, count: int, length: int) -> tuple[Any, tuple[Any, ...]]:
    """The jitted function and its arguments for one case (in the child: imports JAX)."""
    import jax
    import jax.numpy as jnp

    if kind == "args":
        xs = tuple(jnp.full((640,), i, jnp.bfloat16) for i in range(count))
        return jax.jit(lambda *xs: [x * 2 for x in xs]), xs

    from train.attention_kernels import flash_attention

    seg = jnp.ones((2, length), jnp.int32)
    q = jnp.asarray(jax.random.normal(jax.random.key(0), (2, length, 4, 256)), jnp.bfloat16)
    kv = jnp.asarray(jax.random.normal(jax.random.key(1), (2, length, 1, 256)), jnp.bfloat16)

    def attention(q, k, v):
        if kind == "dense":
            s = jnp.einsum("btnh,bsh->btns", q, k[:, :, 0])
            return jnp.einsum("btns,bsh->btnh", jax.nn.softmax(s, -1), v[:, :, 0])
        return flash_attention.flash_attention(q, k, v, seg)

    def loss(q, k, v):
        x = q
        for i in range(count):  # each call its own kernel instance, as each layer's is in the train step
            x = attention(x, k * (1 + i), v).astype(jnp.bfloat16)
        return jnp.sum(x.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, kv, kv)


def child(kind: str, count: int, length: int, cache_dir: str) -> dict[str, Any]:
    """Compile (or load) one case in this process; the timings and whether JAX's cache was hit."""
    import jax

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    events: list[str] = []
    jax.monitoring.register_event_listener(lambda event, **_: events.append(event))
    fn, args = _program(kind, count, length)  # its eager ops hit or miss the cache too: not counted
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    t1 = time.perf_counter()
    before = len(events)
    compiled = lowered.compile()
    t2 = time.perf_counter()
    during = events[before:]
    jax.block_until_ready(compiled(*args))
    hit = CACHE_HIT in during and CACHE_MISS not in during
    return {"lower_s": t1 - t0, "compile_or_load_s": t2 - t1, "cache_hit": hit, "machine": device_machine.machine()}


def _run_child(kind: str, count: int, length: int, cache_dir: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_cache_load", "--child", f"{kind}:{count}",
           "--length", str(length), "--cache-dir", cache_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1][len(MARK):])


def measure(kind: str, count: int, length: int) -> dict[str, Any]:
    """One case: cold in one process, then the hit in another, from a fresh cache folder."""
    with tempfile.TemporaryDirectory(prefix="cache-load-") as cache_dir:
        cold = _run_child(kind, count, length, cache_dir)
        hit = _run_child(kind, count, length, cache_dir)
        largest = max((os.path.getsize(os.path.join(cache_dir, n)) for n in os.listdir(cache_dir)), default=0)
    out: dict[str, Any] = {"case": f"{kind}:{count}", "length": length, "cold": cold, "hit": hit,
                           "largest_entry_bytes": largest}
    if "error" not in hit and not hit["cache_hit"]:
        out["error"] = "the second process missed the cache: no load time to report"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for bench_cache_load.json")
    p.add_argument("--cases", default=DEFAULT_CASES, help=f"KIND:N, comma-separated (default {DEFAULT_CASES})")
    p.add_argument("--length", type=int, default=1024, help="attention cases' sequence length (default 1024)")
    p.add_argument("--child", type=parse_case, help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(MARK + json.dumps(child(*args.child, args.length, args.cache_dir)), flush=True)
        return 0
    if not args.out:
        p.error("--out DIR is required")
    try:
        cases = [parse_case(c) for c in args.cases.split(",")]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    results: dict[str, Any] = {"machine": device_machine.versions(), "runs": [],
                               "command": shlex.join(["python3", "-m", "benchmarks.bench_cache_load", *(argv or sys.argv[1:])])}
    for kind, count in cases:
        run = measure(kind, count, args.length)
        results["runs"].append(run)
        hit = run["hit"]
        line = run.get("error") or hit.get("error") or (
            f"cold {run['cold']['compile_or_load_s']:.2f} s, hit: lower {hit['lower_s']:.2f} s, "
            f"load {hit['compile_or_load_s']:.2f} s, entry {run['largest_entry_bytes'] / 1e6:.1f} MB")
        print(f"{run['case']}: {line}", flush=True)
        if "machine" in hit:
            results["machine"] = hit["machine"]
    path = os.path.join(args.out, RESULTS_NAME)
    results_file.save(path, results)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
