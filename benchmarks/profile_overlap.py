"""The dispatch overlap in a `prepack train --profile-steps` trace: does the host run ahead of the device?

Reads the Perfetto/Chrome trace JAX writes beside the XSpace (`plugins/profile/*/*.trace.json.gz`)
and lists, per traced train step: when the host's call of the jitted train step returned
(`PjitFunction(train_step)`: the step is dispatched), when the device's execution of it ran
(on a CPU backend: XLA's `ThunkExecutor::Execute (wait for completion)` on a PjRt client thread),
and when the host began its next loop iteration (Tunix's `train` StepTraceAnnotation). A next
iteration that begins before the step's execution ends means the host prepared and dispatched
the next step while the device worked: the overlap a per-step host sync removes.

    python -m benchmarks.profile_overlap TRACE_DIR_OR_FILE
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sys


def load(path: str) -> list[dict]:
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "**", "*.trace.json.gz"), recursive=True))
        if not found:
            raise SystemExit(f"{path}: no *.trace.json.gz below it")
        path = found[-1]
    with gzip.open(path) as f:
        return json.load(f)["traceEvents"]


def spans(events: list[dict], match) -> list[tuple[float, float]]:
    """(start, end) in seconds of the matching complete events; nested copies of one call (the same
    start) counted once."""
    found = {}
    for e in events:
        if e.get("ph") == "X" and match(e["name"]):
            start = round(e["ts"] / 1e6, 4)
            found[start] = max(found.get(start, 0.0), (e["ts"] + e["dur"]) / 1e6)
    return sorted(found.items())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    events = load(args[0])
    dispatch = spans(events, lambda n: n.startswith("PjitFunction(train_step"))
    execute = spans(events, lambda n: n == "ThunkExecutor::Execute (wait for completion)")
    steps = spans(events, lambda n: n == "train")
    t0 = min(s for s, _ in steps + dispatch) if steps or dispatch else 0.0
    print("| step (traced) | dispatch returned (s) | device ran (s) | next iteration began (s) | host ahead of the device by (s) |")
    print("|---|---|---|---|---|")
    runs = [(a, b) for a, b in execute if b - a > 0.01]  # the train step's executions, in order (eval steps are short)
    for i, (_, returned) in enumerate(dispatch):
        run = runs[i] if i < len(runs) else None
        nxt = next((a for a, _ in steps if a >= returned - 1e-6), None)
        ahead = (run[1] - nxt) if run and nxt is not None else None
        print(f"| {i + 1} | {returned - t0:.3f} | {'' if run is None else f'{run[0] - t0:.3f}-{run[1] - t0:.3f}'} | "
              f"{'' if nxt is None else f'{nxt - t0:.3f}'} | {'' if ahead is None else f'{ahead:.3f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
