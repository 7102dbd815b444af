"""Where a profiled train step's device time goes, by category (MFU from a profile).

    python -m benchmarks.profile_categories dump PROFILE_DIR EVENTS.json.gz   # on the machine that profiled
    python -m benchmarks.profile_categories table EVENTS.json.gz [--steps N]  # anywhere, no accelerator needed

`prepack train --profile-steps A:B --profile-dir DIR` writes an XSpace (`*.xplane.pb`). `dump` reads it
with `jax.profiler.ProfileData` and keeps each device op (its name, start, duration and the stats that
say what it is: the HLO text, the JAX name stack) in a small gzipped JSON. `table` puts every op of the
traced train steps in one category, in this order (the first that matches):

- attention: ops under the `segment_attention` name scope (train/attention.py: the flash and splash
  kernels, the blocked tiles, their backward passes);
- head and loss: ops under `loss_head` (train/chunked_loss.py: the projection, log-sum-exp, dL/dh,
  the fused head's kernel);
- LoRA matmuls: matrix products whose operands or result have the adapter's rank as a dimension;
- base matmuls: the other matrix products (convolution and dot ops, and fusions holding one);
- copies and transposes: copy, transpose, bitcast-convert, dynamic-update-slice and async copies;
- norms and elementwise: everything else on the device (loop and reduce fusions: RMS norms, RoPE,
  the optimizer's update, casts);
- host gaps: the time inside a step's span (first op start to last op end of one train-step
  execution) when no op runs, plus the idle time between consecutive steps.
Each category's share is of the steps' wall time; MFU's lost time is read off it.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
from collections import defaultdict

CATEGORIES = ("base matmuls", "LoRA matmuls", "head and loss", "attention", "norms and elementwise",
              "copies and transposes", "host gaps")
KEEP_STATS = ("long_name", "tf_op", "hlo_category", "hlo_op", "hlo_module", "program_id", "flops", "bytes_accessed",
              "model_flops", "source", "deduplicated_name")


def dump(profile_dir: str, out: str) -> int:
    from jax.profiler import ProfileData

    found = sorted(glob.glob(os.path.join(profile_dir, "**", "*.xplane.pb"), recursive=True))
    if not found:
        print(f"{profile_dir}: no *.xplane.pb below it", file=sys.stderr)
        return 2
    data = ProfileData.from_file(found[-1])
    planes = []
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = []
        for line in plane.lines:
            events = []
            for ev in line.events:
                stats = {k: (v if not isinstance(v, str) else v[:600]) for k, v in ev.stats if k in KEEP_STATS}
                events.append({"name": ev.name, "start_ns": ev.start_ns, "duration_ns": ev.duration_ns, "stats": stats})
            lines.append({"name": line.name, "events": events})
        planes.append({"name": plane.name, "lines": lines})
    with gzip.open(out, "wt") as f:
        json.dump({"xplane": os.path.relpath(found[-1], profile_dir), "planes": planes}, f)
    print(f"{out}: {sum(len(l['events']) for p in planes for l in p['lines'])} device events from {found[-1]}")
    return 0


_MATMUL = re.compile(r"\b(convolution|dot)\(|= \S+ (convolution|dot)\b|kind=kOutput|\bconvolution\b")
_COPY = re.compile(r"^(copy|transpose|bitcast|dynamic-update-slice|copy-start|copy-done|slice)")


def _shapes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\[([0-9,]*)\]", text)]


def category(ev: dict, rank: int) -> str:
    stats = ev.get("stats", {})
    scope = str(stats.get("tf_op", "")) + " " + str(stats.get("long_name", ""))
    name = ev["name"]
    if "segment_attention" in scope:
        return "attention"
    if "loss_head" in scope:
        return "head and loss"
    long_name = str(stats.get("long_name", name))
    hlo_category = str(stats.get("hlo_category", ""))
    if "convolution" in hlo_category or _MATMUL.search(long_name) or name.startswith(("convolution", "dot")):
        if any(rank in s for s in _shapes(long_name)):
            return "LoRA matmuls"
        return "base matmuls"
    if _COPY.match(name) or "copy" in hlo_category or "transpose" in hlo_category:
        return "copies and transposes"
    return "norms and elementwise"


def _op_line(plane: dict) -> list[dict]:
    for line in plane["lines"]:
        if line["name"] == "XLA Ops":
            return line["events"]
    return max(plane["lines"], key=lambda l: len(l["events"]))["events"] if plane["lines"] else []


def _step_spans(plane: dict) -> list[tuple[int, int]]:
    """(start, end) of each train-step execution: the XLA Modules line's jit(train_step) events."""
    for line in plane["lines"]:
        if line["name"] == "XLA Modules":
            spans = [(e["start_ns"], e["start_ns"] + e["duration_ns"]) for e in line["events"] if "train_step" in e["name"]]
            if spans:
                return spans
    return []


def table(events_path: str, rank: int, steps: int | None) -> dict:
    with gzip.open(events_path, "rt") as f:
        data = json.load(f)
    plane = next(p for p in data["planes"] if "TPU" in p["name"] or "GPU" in p["name"])
    spans = _step_spans(plane)
    if steps:
        spans = spans[-steps:]
    if not spans:
        raise SystemExit(f"{events_path}: no train_step execution on {plane['name']}'s XLA Modules line")
    lo, hi = spans[0][0], spans[-1][1]
    busy: dict[str, float] = defaultdict(float)
    names: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for ev in _op_line(plane):
        start, end = ev["start_ns"], ev["start_ns"] + ev["duration_ns"]
        if end <= lo or start >= hi or not any(a <= start < b for a, b in spans):
            continue
        cat = category(ev, rank)
        busy[cat] += ev["duration_ns"]
        names[cat][ev["name"]] += ev["duration_ns"]
    wall = hi - lo
    busy["host gaps"] = max(0.0, wall - sum(busy.values()))
    per_step = {c: busy.get(c, 0.0) / len(spans) / 1e9 for c in CATEGORIES}
    top = {c: sorted(((n, t / len(spans) / 1e9) for n, t in names[c].items()), key=lambda x: -x[1])[:5] for c in names}
    return {"steps": len(spans), "step_s": wall / len(spans) / 1e9, "seconds_per_step": per_step,
            "share": {c: per_step[c] / (wall / len(spans) / 1e9) for c in CATEGORIES}, "top_ops": top}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("profile_dir")
    d.add_argument("out")
    t = sub.add_parser("table")
    t.add_argument("events")
    t.add_argument("--rank", type=int, default=8, help="the LoRA rank (LoRA matmuls are told by it)")
    t.add_argument("--steps", type=int, default=None, help="the last N traced steps only")
    t.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.cmd == "dump":
        return dump(args.profile_dir, args.out)
    result = table(args.events, args.rank, args.steps)
    print(f"{result['steps']} traced steps, {result['step_s'] * 1e3:.1f} ms a step")
    print("| category | ms a step | share |")
    print("|---|---|---|")
    for c in CATEGORIES:
        print(f"| {c} | {result['seconds_per_step'][c] * 1e3:.1f} | {result['share'][c]:.1%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
