"""Where a profiled train step's device time goes, by category (MFU from a profile).

    python -m benchmarks.profile_categories dump PROFILE_DIR EVENTS.json.gz   # on the machine that profiled
    python -m benchmarks.profile_categories table EVENTS.json.gz [--steps N]  # anywhere, no accelerator needed

`prepack train --profile-steps A:B --profile-dir DIR` writes an XSpace (`*.xplane.pb`). `dump` reads it
with `jax.profiler.ProfileData` and keeps each device op (its name, start, duration and the stats that
say what it is: the HLO text, the JAX name stack) in a small gzipped JSON. `table` puts every op of the
traced train steps in one category, in this order (the first that matches):

- attention: ops under the `segment_attention` name scope (train/attention_kernels/attention.py: the flash and splash
  kernels, the blocked tiles, their backward passes);
- head and loss: ops under `loss_head` (train/step/chunked_loss.py: the projection, log-sum-exp, dL/dh,
  the fused head's kernel);
- LoRA matmuls: matrix products whose operands or result have the adapter's rank as a dimension;
- base matmuls: the other matrix products (convolution and dot ops, and fusions holding one);
- copies and transposes: copy, transpose, bitcast-convert, dynamic-update-slice and async copies;
- norms and elementwise: everything else on the device (loop and reduce fusions: RMS norms, RoPE,
  the optimizer's update, casts);
- host gaps: the time of a step (from its start to the next step's start) when no op runs on
  the device.
Each category's share is of the steps' wall time; MFU's lost time is read off it.
"""

from __future__ import annotations

import argparse
import dataclasses
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


_OPCODE = re.compile(r"%([A-Za-z_\-]+?)[.\d]*\s*=")
_SHAPE = re.compile(r"\b(bf16|f32|f16|s32|u32|s8|u8|pred)\[([0-9,]*)\]")
_COPY = ("copy", "slice", "transpose", "bitcast", "dynamic-update-slice", "dynamic_update_slice", "dynamic-slice",
         "dynamic_slice", "concatenate", "pad")


@dataclasses.dataclass(frozen=True)
class Dims:
    """What tells the ops of one model and step apart in the HLO text of a TPU profile's ops."""

    rank: int  # LoRA's rank: a LoRA product's output or adapter has it as its last dimension
    vocab: int  # the output projection's V


def category(name: str, dims: Dims) -> str:
    """One device op's category, from its HLO text (the profile's op name): see the module doc."""
    head = name.split(" calls=")[0].split(", metadata=")[0]
    shapes = [tuple(int(d) for d in s.split(",") if d) for _, s in _SHAPE.findall(head)]
    match = _OPCODE.match(name)
    opcode = match.group(1) if match else name.split(" ")[0]
    custom = re.search(r'custom_call_target="([^"]+)"', name)
    kernel = opcode if custom else ""
    if "splash_mqa" in kernel or any(dims.vocab in s for s in shapes):
        return "head and loss"
    if kernel.startswith(("flash", "splash_mha")):
        return "attention"
    matmul = "kind=kOutput" in head or opcode.startswith(("convolution", "dot"))
    if matmul and any(s and s[-1] == dims.rank for s in shapes):
        return "LoRA matmuls"
    if matmul:
        return "base matmuls"
    if opcode.startswith(_COPY):
        return "copies and transposes"
    if any(len(s) == 4 for s in shapes):  # [B, L, heads, head_dim] and its statistics: around the kernels
        return "attention"
    return "norms and elementwise"


def _self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """Each op with its own time: a control-flow op (while, cond) spans its body's ops on the same line."""
    ordered = sorted(events, key=lambda e: (e["start_ns"], -e["duration_ns"]))
    own = [float(e["duration_ns"]) for e in ordered]
    stack: list[tuple[int, float]] = []
    for i, e in enumerate(ordered):
        while stack and stack[-1][1] <= e["start_ns"]:
            stack.pop()
        if stack:
            own[stack[-1][0]] -= e["duration_ns"]
        stack.append((i, e["start_ns"] + e["duration_ns"]))
    return list(zip(ordered, own))


def _line(plane: dict, name: str) -> list[dict]:
    return next((line["events"] for line in plane["lines"] if line["name"] == name), [])


def table(events_path: str, dims: Dims, steps: int | None) -> dict:
    with gzip.open(events_path, "rt") as f:
        data = json.load(f)
    plane = next(p for p in data["planes"] if "TPU" in p["name"] or "GPU" in p["name"])
    starts = [e["start_ns"] for e in _line(plane, "XLA Modules") if "train_step" in e["name"]]
    starts = starts[1:]  # the first traced execution can start before the trace did
    if steps:
        starts = starts[-(steps + 1):]
    windows = list(zip(starts, starts[1:]))  # one step: from its start to the next step's start
    if not windows:
        raise SystemExit(f"{events_path}: fewer than 3 train_step executions on {plane['name']}'s XLA Modules line")
    ops = [e for e in _line(plane, "XLA Ops") if any(a <= e["start_ns"] < b for a, b in windows)]
    busy: dict[str, float] = defaultdict(float)
    names: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for ev, own in _self_times(ops):
        cat = category(ev["name"], dims)
        busy[cat] += own
        names[cat][ev["name"].split(" = ")[0]] += own
    n = len(windows)
    period = (windows[-1][1] - windows[0][0]) / n / 1e9
    per_step = {c: busy.get(c, 0.0) / n / 1e9 for c in CATEGORIES}
    per_step["host gaps"] = max(0.0, period - sum(per_step.values()))  # no op on the device
    top = {c: sorted(((k, t / n / 1e9) for k, t in names[c].items()), key=lambda x: -x[1])[:5] for c in names}
    return {"steps": n, "step_s": period, "seconds_per_step": per_step,
            "share": {c: per_step[c] / period for c in CATEGORIES}, "top_ops": top}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("profile_dir")
    d.add_argument("out")
    t = sub.add_parser("table")
    t.add_argument("events")
    t.add_argument("--rank", type=int, default=8, help="the LoRA rank (LoRA matmuls are told by it)")
    t.add_argument("--vocab", type=int, default=262144, help="the output projection's V (the head's ops are told by it)")
    t.add_argument("--steps", type=int, default=None, help="the last N traced steps only")
    t.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.cmd == "dump":
        return dump(args.profile_dir, args.out)
    result = table(args.events, Dims(args.rank, args.vocab), args.steps)
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
