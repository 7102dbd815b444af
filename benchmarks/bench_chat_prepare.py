"""Per-example cost of the prepare stage (parse, template, tokenize) on plain chat, now against a
baseline checkout, in the same run: did reading real datasets' schemas (tool calls, parts, flags,
column and role maps) slow the records every run has?

    git worktree add /tmp/prepack-base 90b4e18      # the main before the formats change
    PREPACK_BENCH_DATA=... python -m benchmarks.bench_chat_prepare --baseline /tmp/prepack-base

Each checkout runs in its own interpreter (PYTHONPATH set to it) through the job's own Preparer
(pipelines/preparer.py, the same API in both), on real OASST1 conversations (`oasst1_chat.jsonl`,
benchmarks/data.py) repeated to about 6,000 records, as the raw JSON lines a worker reads. Runs
alternate between the checkouts; each figure is the best of --repeat runs of one pass after a
warm-up pass, in the process's CPU seconds (on a shared machine, wall time measures the neighbours).
Prints one line per tokenizer: examples per CPU second for each checkout and the ratio now/baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.data import DATA_DIR

INNER = r"""
import json, sys, time
from pipelines.preparer import Preparer
from pipelines.wire.records import TaskMeta
from prepack.packing.accounting import Tally

path, copies, tokenizer, chat_format = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
lines = [l for l in open(path, 'rb').read().splitlines() if l.strip()] * copies
items = [(i, i + 1, 0, line) for i, line in enumerate(lines)]  # RAW_TEXT records, as the read stage makes them
meta = TaskMeta(0, path, path, "chat.jsonl")
prep = Preparer.from_names([meta], "chat", (), tokenizer, chat_format)

def one_pass():
    tally, bad = Tally(), []
    out = 0
    for start in range(0, len(items), 512):
        templated = prep.template_records(0, items[start:start + 512], tally, bad)
        out += sum(len(b.example_ids) for b in prep.tokenize(templated, tally, bad))
    return out

def template_pass():
    tally, bad = Tally(), []
    for start in range(0, len(items), 512):
        prep.template_records(0, items[start:start + 512], tally, bad)

one_pass()
t = time.process_time()
n = one_pass()
whole = time.process_time() - t
t = time.process_time()
template_pass()
print(json.dumps({"examples": n, "seconds": whole, "template_seconds": time.process_time() - t}))
"""


def run_once(checkout: str, path: str, copies: int, tokenizer: str, chat_format: str) -> tuple[float, float]:
    """(examples per CPU second of the whole stage, CPU microseconds per example of the template step alone)."""
    env = {**os.environ, "PYTHONPATH": checkout}
    out = subprocess.run([sys.executable, "-c", INNER, path, str(copies), tokenizer, chat_format], env=env, cwd=checkout,
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["examples"] / result["seconds"], 1e6 * result["template_seconds"] / result["examples"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="a checkout of the commit to compare against")
    p.add_argument("--current", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--copies", type=int, default=10, help="how many times the sample is repeated")
    args = p.parse_args(argv)
    path = os.path.join(DATA_DIR, "oasst1_chat.jsonl")
    if not os.path.exists(path):
        print(f"no {path}: set PREPACK_BENCH_DATA to a folder holding oasst1_chat.jsonl (benchmarks/data.py)", file=sys.stderr)
        return 2
    for tokenizer, chat_format in (("gemma3", "gemma"), ("qwen3", "qwen3")):
        best = {"baseline": 0.0, "current": 0.0}
        template = {"baseline": float("inf"), "current": float("inf")}
        for _ in range(args.repeat):
            for name in ("baseline", "current"):
                rate, us = run_once(getattr(args, name), path, args.copies, tokenizer, chat_format)
                best[name], template[name] = max(best[name], rate), min(template[name], us)
        print(f"{tokenizer}/{chat_format}: baseline {best['baseline']:,.0f} examples/CPU-s, now {best['current']:,.0f} "
              f"examples/CPU-s, now/baseline {best['current'] / best['baseline']:.3f}; the template step alone "
              f"{template['baseline']:.1f} -> {template['current']:.1f} us/example")
    return 0


if __name__ == "__main__":
    sys.exit(main())
