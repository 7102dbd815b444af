"""The exact fill's work budget bounds the planner's CPU on any histogram.

    python -m benchmarks.bench_planner_budget            # CPU of `--planner best` vs `bfd`, default budget
    python -m benchmarks.bench_planner_budget --fit      # also refit the cost constants, no budget

Histograms built to be hard for the fill: many distinct lengths (up to 20,000 at L 32768 and
65536, one to three examples each), many examples of a few short lengths, and segment caps. For
each: process CPU of one length's plan under `--planner best` (prepack.packing.packer.HistogramPlan
with exact_fill.DEFAULT_BUDGET_CELLS) against `--planner bfd` on the same histogram in the same
run, the work counted, and whether the fill ran past its budget (then BFD made the rows, as the
manifest's stats.planner_fallback records).

`--fit` runs each fill with no budget and fits process time = a*cells + b*chunks + c*lengths +
d*fills by least squares (relative error): b/a, c/a and d/a are the cells' worth of the fixed
costs that exact_fill.CHUNK_CELLS, LENGTH_CELLS and FILL_CELLS charge, and 9 s / a is the budget
that bounds a plan at ~9 CPU-s on the machine that ran it.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from prepack.packing import exact_fill
from prepack.packing.packer import HistogramPlan, Planner


def histograms(seed: int = 0) -> list[tuple[str, dict[int, int], int, int | None]]:
    rng = np.random.default_rng(seed)

    def distinct(L: int, n: int) -> dict[int, int]:
        lengths = rng.choice(np.arange(1, L + 1), size=n, replace=False)
        return {int(x): int(rng.integers(1, 4)) for x in lengths}

    def few_short(L: int, n: int, count: int) -> dict[int, int]:
        lengths = rng.choice(np.arange(1, max(n + 1, L // 8)), size=n, replace=False)
        return {int(x): count for x in lengths}

    cases = [(f"{n:,} distinct lengths", distinct(L, n), L, None)
             for L, n in ((2048, 2000), (4096, 2048), (8192, 5000), (16384, 10000), (32768, 5000),
                          (32768, 20000), (65536, 20000))]
    cases += [("1,000 short lengths x 50", few_short(8192, 1000, 50), 8192, None),
              ("3,000 short lengths x 5, cap 16", few_short(32768, 3000, 5), 32768, 16),
              ("4,000 distinct lengths, cap 8", distinct(8192, 4000), 8192, 8)]
    return cases


class _CountingWork(exact_fill._Work):
    """The fill's work, with its parts counted apart (for --fit)."""

    def __init__(self) -> None:
        super().__init__(budget=10**18)
        self.cells = self.chunks = self.lengths = self.fills = 0

    def fill(self, lengths: int) -> None:
        self.fills += 1
        self.lengths += lengths
        super().fill(lengths)

    def chunk(self, cells: int) -> None:
        self.chunks += 1
        self.cells += cells
        super().chunk(cells)


def budgeted(cases: list) -> list[dict]:
    out = []
    for name, hist, L, cap in cases:
        t = time.process_time()
        bfd = HistogramPlan(hist, L, Planner.BFD, cap)
        bfd_rows = len(bfd.rows())
        bfd_cpu = time.process_time() - t
        t = time.process_time()
        best = HistogramPlan(hist, L, Planner.BEST, cap)
        best_rows = len(best.rows())
        best_cpu = time.process_time() - t
        out.append(dict(name=name, L=L, cap=cap, bfd_rows=bfd_rows, best_rows=best_rows, bfd_cpu=bfd_cpu,
                        best_cpu=best_cpu, fallback=best.budget_exhausted))
        print(f"{name:34s} L{L:<6} best {best_cpu:6.2f} s ({best_rows} rows{', BFD fallback' if best.budget_exhausted else ''})"
              f"  bfd {bfd_cpu:6.2f} s ({bfd_rows} rows)", flush=True)
    return out


def fit(cases: list) -> np.ndarray:
    parts, cpu = [], []
    for name, hist, L, cap in cases:
        work = _CountingWork()
        t = time.process_time()
        for order, most_items in exact_fill.FILL_ORDERS:
            exact_fill._fill(hist, L, cap, work, order, most_items and cap is not None)
        cpu.append(time.process_time() - t)
        parts.append([work.cells, work.chunks, work.lengths, work.fills])
        print(f"{name:34s} L{L:<6} {cpu[-1]:6.2f} s  cells {work.cells:.3g} chunks {work.chunks:,} "
              f"lengths {work.lengths:,} fills {work.fills:,}", flush=True)
    X, y = np.array(parts, dtype=float), np.array(cpu)
    coef, *_ = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)
    a = coef[0]
    print(f"fit: {a * 1e9:.2f} ns a cell; a chunk {coef[1] / a:,.0f} cells, a length {coef[2] / a:,.1f}, "
          f"a fill {coef[3] / a:,.0f}; 9 CPU-s = {9 / a:.3g} cells")
    print("worst relative error of the fit:", f"{np.abs(X @ coef / y - 1).max():.1%}")
    return coef


def markdown(rows: list[dict]) -> str:
    lines = ["| histogram | L | cap | best CPU s | BFD CPU s | best / BFD | fallback | best rows | BFD rows |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['L']} | {r['cap'] or '-'} | {r['best_cpu']:.2f} | {r['bfd_cpu']:.2f} | "
                     f"{r['best_cpu'] / max(r['bfd_cpu'], 1e-9):.0f}x | {'yes' if r['fallback'] else 'no'} | "
                     f"{r['best_rows']:,} | {r['bfd_rows']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", action="store_true", help="also refit the cost constants (runs every fill unbudgeted)")
    args = ap.parse_args(argv)
    cases = histograms()
    if args.fit:
        fit(cases)
    print(markdown(budgeted(cases)))


if __name__ == "__main__":
    main()
