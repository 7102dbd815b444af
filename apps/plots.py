"""PNG plots for preflight and report pages (matplotlib, Agg backend).

Only preflight/report import this module, and only when they draw, so the
core (and the Beam workers that import it) never pays for matplotlib.
Every function takes plain rows/dicts and an output path and returns the path.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from apps.packing_table import drops_too_many
from prepack.storage import new_file

DPI = 110


def matplotlib_missing() -> str | None:
    """Why no plot can be drawn here (matplotlib is in the `report` extra, not in `pipeline`), or None.
    Commands check it before any work, so a missing extra is one line, not a traceback at the end."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return "plots need matplotlib: pip install 'tunix-prepack[report]' (or -e '.[pipeline,report]' in a checkout)"
    return None


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, works on headless hosts
    import matplotlib.pyplot as plt

    return plt


def _colors(names: Iterable[str]) -> dict[str, Any]:
    cycle = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
    return {name: cycle[i % len(cycle)] for i, name in enumerate(names)}


def _datasets(rows: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(str(r["dataset"]) for r in rows))


def _one_per_length(rows: Sequence[dict[str, Any]], dataset: str) -> list[dict[str, Any]]:
    """The dataset's rows at one batch size (densities do not depend on B), sorted by L."""
    mine = [r for r in rows if str(r["dataset"]) == dataset]
    first_b = min(int(r["batch_size"]) for r in mine)
    return sorted((r for r in mine if int(r["batch_size"]) == first_b), key=lambda r: int(r["max_length"]))


def _log2_length_axis(ax: Any, lengths: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(lengths)))
    ax.set_xticklabels([str(v) for v in sorted(set(lengths))])
    ax.minorticks_off()
    ax.set_xlabel("max length L (tokens)")


def _save(fig: Any, path: str) -> str:
    """Drawn into memory, then written as a new file renamed over `path` (never into an old
    file through another of its names)."""
    drawn = io.BytesIO()
    fig.savefig(drawn, format="png", dpi=DPI, bbox_inches="tight")
    _plt().close(fig)
    new_file.write_bytes(path, drawn.getvalue())
    return path


def density_vs_max_length(rows: Sequence[dict[str, Any]], path: str) -> str:
    """Token density (left) and target-token density (right) against L: packed solid, unpacked dashed."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True)
    names = _datasets(rows)
    colors = _colors(names)
    lengths = sorted({int(r["max_length"]) for r in rows})
    for ax, (packed_key, unpacked_key, title) in zip(
        axes,
        (
            ("packed_density", "unpacked_density", "Token density (real tokens / row slots)"),
            ("packed_target_density", "unpacked_target_density", "Target-token density (trained tokens / row slots)"),
        ),
    ):
        labels: dict[int, list[tuple[float, str, Any]]] = {}
        for name in names:
            mine = _one_per_length(rows, name)
            xs = [int(r["max_length"]) for r in mine]
            packed = [100 * float(r[packed_key]) for r in mine]
            unpacked = [100 * float(r[unpacked_key]) for r in mine]
            ax.plot(xs, packed, "-o", color=colors[name], label=f"{name} packed")
            ax.plot(xs, unpacked, "--s", color=colors[name], alpha=0.75, label=f"{name} unpacked")
            for x, y in zip(xs, unpacked):
                labels.setdefault(x, []).append((y, f"{y:.1f}", colors[name]))
        # Label unpacked points (packed ones sit near 100% and are in the table), spread apart so they never overlap.
        for x, items in labels.items():
            for y, (_, text, color) in zip(_spread([y for y, _, _ in items], gap=4.5), items):
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(7, 0), va="center", fontsize=7, color=color)
        _log2_length_axis(ax, lengths)
        ax.set_xlim(lengths[0] / 1.25, lengths[-1] * 1.35)
        ax.set_ylim(0, 105)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("density (%)")
    handles, legend_labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, legend_labels, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    fig.suptitle("Density against max length: packed (solid) vs unpacked (dashed)", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return _save(fig, path)


def _spread(values: Sequence[float], gap: float) -> list[float]:
    """Label positions for `values` (same order), moved up just enough to be `gap` apart."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = list(values)
    floor = -math.inf
    for i in order:
        out[i] = max(values[i], floor + gap)
        floor = out[i]
    return out


def row_reduction(rows: Sequence[dict[str, Any]], path: str) -> str:
    """Row reduction (examples / packed rows) and the expected throughput gain per batch size, against L."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = _datasets(rows)
    colors = _colors(names)
    lengths: list[int] = []
    for name in names:
        mine = _one_per_length(rows, name)
        xs = [int(r["max_length"]) for r in mine]
        lengths += xs
        ys = [float(r["row_reduction"]) for r in mine]
        left.plot(xs, ys, "-o", color=colors[name], label=name)
        for x, y in zip(xs, ys):
            left.annotate(f"{y:.1f}x", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7,
                          color=colors[name])
    batch_sizes = sorted({int(r["batch_size"]) for r in rows})
    styles = ["-o", "--s", ":^", "-.d", "-v", "--P"]
    for name in names:
        for i, b in enumerate(batch_sizes):
            mine = sorted((r for r in rows if str(r["dataset"]) == name and int(r["batch_size"]) == b),
                          key=lambda r: int(r["max_length"]))
            xs, ys = [int(r["max_length"]) for r in mine], [float(r["throughput_gain"]) for r in mine]
            right.plot(xs, ys, styles[i % len(styles)], color=colors[name], label=f"{name} B={b}")
            # Every batch size gets its values; the first above its points, the others below, so they do not collide.
            above = i % 2 == 0
            for x, y in zip(xs, ys):
                right.annotate(f"{y:.1f}x", (x, y), textcoords="offset points", xytext=(0, 6 if above else -7),
                               ha="center", va="bottom" if above else "top", fontsize=7, color=colors[name])
    for ax, values in ((left, [float(r["row_reduction"]) for r in rows]), (right, [float(r["throughput_gain"]) for r in rows])):
        _log2_length_axis(ax, lengths)
        ax.margins(x=0.08, y=0.12)
        if any(v > 0 for v in values):  # a log axis of nothing but zeros only draws warnings
            ax.set_yscale("log", base=2)
            _times_ticks(ax)
        ax.grid(True, which="major", alpha=0.3)
    left.set_title("Row reduction: unpacked rows / packed rows", fontsize=10)
    right.set_title("Expected target-token throughput gain (per step, fixed B x L)", fontsize=10)
    left.legend(fontsize=8)
    right.legend(fontsize=7, ncol=max(1, len(batch_sizes) // 3))
    fig.suptitle("What packing saves", fontsize=11)
    return _save(fig, path)


# Tick candidates for "N x" axes: 1-1.5-2-3 per octave reads well on a log2 scale.
_NICE_TIMES = sorted({m * 2.0 ** e for e in range(-4, 12) for m in (1.0, 1.5)} | {3.0 * 2.0 ** e for e in range(-4, 11)})


def _times_ticks(ax: Any, most: int = 8) -> None:
    """Ticks on a log "N x" axis that cover the data range (log2's default puts them at powers of 2 only,
    so values from 3.1x to 23.6x got 4x, 8x, 16x), thinned to at most `most`, no minor ticks."""
    from matplotlib.ticker import FixedLocator, NullLocator

    lo, hi = ax.get_ylim()
    ticks = [t for t in _NICE_TIMES if lo <= t <= hi]
    while len(ticks) > most:
        ticks = ticks[::2]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(_times_formatter())


def _times_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:g}x")


def length_histogram(histograms: dict[str, dict[int, int]], max_lengths: Sequence[int], path: str) -> str:
    """Tokens per example, one panel per dataset, log-spaced bins, a line at every max length
    labelled with the share of examples longer than it."""
    plt = _plt()
    names = list(histograms)
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.6 * max(1, len(names)) + 0.4), squeeze=False)
    colors = _colors(names)
    all_lengths = [n for h in histograms.values() for n in h] + list(max_lengths)
    hi = max(all_lengths, default=2)
    lo = max(1, min((n for h in histograms.values() for n in h), default=1))
    edges = _log_edges(lo, hi)
    for ax, name in zip(axes[:, 0], names):
        hist = histograms[name]
        total = sum(hist.values())
        ax.hist(list(hist), bins=edges, weights=list(hist.values()), color=colors[name], alpha=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlim(edges[0], max(all_lengths) * 1.9)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # headroom for the L labels
        for i, L in enumerate(sorted(max_lengths)):
            over = sum(c for n, c in hist.items() if n > L)
            flagged = drops_too_many(over, total)
            ax.axvline(L, color="#d62728" if flagged else "black", linestyle="--", linewidth=1)
            # Short lines, and neighbours at two heights: one octave apart, a long label ran into the next one's box.
            text = f" L={L}\n {over:,} over\n {_pct(over, total)}" + (" dropped!" if flagged else "")
            ax.text(L, 0.97 if i % 2 == 0 else 0.62, text, transform=ax.get_xaxis_transform(), va="top", ha="left",
                    fontsize=7, color="#d62728" if flagged else "black", fontweight="bold" if flagged else "normal",
                    bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none", "pad": 1})
        ax.set_ylabel("examples")
        ax.set_title(f"{name}: {total:,} examples", fontsize=10, loc="left")
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_formatter(_int_formatter())
    axes[-1, 0].set_xlabel("tokens per example (log scale)")
    fig.suptitle("Example lengths and max lengths", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def _pct(part: int, whole: int) -> str:
    if not whole:
        return "-"
    share = 100 * part / whole
    return "<0.1%" if 0 < share < 0.1 else f"{share:.1f}%"


def _log_edges(lo: int, hi: int, per_octave: int = 8) -> list[float]:
    start, stop = math.floor(math.log2(lo)), math.ceil(math.log2(hi * 1.1))
    count = max(1, (stop - start) * per_octave)
    return [2 ** (start + i / per_octave) for i in range(count + 1)]


def _int_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:g}")


def preflight_plots(rows: Sequence[dict[str, Any]], histograms: dict[str, dict[int, int]], max_lengths: Sequence[int],
                    output: str) -> list[str]:
    """The preflight figures into `output`; the histogram only when lengths are known."""
    paths = [
        density_vs_max_length(rows, os.path.join(output, "density_vs_max_length.png")),
        row_reduction(rows, os.path.join(output, "row_reduction.png")),
    ]
    if any(histograms.values()):
        paths.append(length_histogram(histograms, max_lengths, os.path.join(output, "length_histogram.png")))
    return paths


def _smooth(values: Sequence[float]) -> list[float]:
    """Trailing mean over ~2% of the run, so the trend shows through per-step noise."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    window = max(1, len(v) // 50)
    if window == 1:
        return v.tolist()
    cum = np.cumsum(np.concatenate([[0.0], v]))
    idx = np.arange(1, len(v) + 1)
    lo = np.maximum(0, idx - window)
    return ((cum[idx] - cum[lo]) / (idx - lo)).tolist()


def loss_curves(runs: Sequence[Any], path: str, budget: float | None = None) -> str:
    """Loss against cumulative target tokens (left) and against cumulative time (right), one colour per run.

    `runs` are report.Run objects (label, packing, loss, cum_target_tokens, cum_time, time_to)."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    colors = _colors(r.label for r in runs)
    for run in runs:
        name = f"{run.label} ({run.packing})" if run.packing and run.packing != run.label else run.label
        c = colors[run.label]
        style = "--" if run.packing == "unpacked" else "-"
        for ax, xs in ((left, run.cum_target_tokens), (right, run.cum_time)):
            if len(run.loss) > 50:
                ax.plot(xs, run.loss, color=c, alpha=0.2, linewidth=0.8)
            ax.plot(xs, _smooth(run.loss), style, color=c, linewidth=1.8, label=name)
        for step, loss in run.evals:  # eval losses, placed at the step they followed
            i = min(max(int(step) - 1, 0), len(run.loss) - 1)
            for ax, xs in ((left, run.cum_target_tokens), (right, run.cum_time)):
                ax.plot([xs[i]], [loss], "D", color=c, markeredgecolor="black", markersize=6)
        if budget is not None:
            t = run.time_to(budget)
            if t == t:  # not NaN
                right.axvline(t, color=c, linestyle=":", linewidth=1)
    if budget is not None:
        left.axvline(budget, color="black", linestyle=":", linewidth=1)
        left.text(budget, 0.98, " budget", transform=left.get_xaxis_transform(), va="top", fontsize=8)
    left.set_xlabel("target tokens trained (cumulative)")
    right.set_xlabel("training time (s, sum of step times)")
    # Runs of the same steps train very different token counts (packed rows hold more targets), so a
    # linear axis squeezes the shorter curve into a sliver at the left: then both axes go log.
    for ax, series in ((left, [r.cum_target_tokens for r in runs]), (right, [r.cum_time for r in runs])):
        ends = [float(s[-1]) for s in series if len(s)]
        starts = [float(s[0]) for s in series if len(s)]
        if len(ends) > 1 and min(starts) > 0 and max(ends) > 3 * min(ends):
            ax.set_xscale("log")
            ax.set_xlabel(ax.get_xlabel() + ", log scale")
    left.set_ylabel("loss")
    left.set_title("Loss against target tokens", fontsize=10)
    right.set_title("Loss against time (dotted: time to reach the budget)", fontsize=10)
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    left.xaxis.set_major_formatter(_si_formatter())
    if any(run.evals for run in runs):
        left.plot([], [], "D", color="white", markeredgecolor="black", label="eval loss")
    left.legend(fontsize=8)
    fig.suptitle("Training loss: packed vs unpacked", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)


def _si_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    def fmt(v: float, _: Any) -> str:
        for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(v) >= scale:
                return f"{v / scale:g}{suffix}"
        return f"{v:g}"

    return FuncFormatter(fmt)


def budget_bars(table: Sequence[dict[str, Any]], path: str, budget: float | None = None) -> str:
    """Horizontal bars: seconds each run needs to reach the same target-token budget, with the speed-up."""
    plt = _plt()
    rows = [r for r in table if r["time_to_budget_s"] == r["time_to_budget_s"]]  # runs that reached it
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.55 * max(1, len(rows))))
    colors = _colors(r["run"] for r in table)
    labels = [f"{r['run']} ({r['packing']})" if r["packing"] not in ("", "-", r["run"]) else r["run"] for r in rows]
    times = [float(r["time_to_budget_s"]) for r in rows]
    ax.barh(labels, times, color=[colors[r["run"]] for r in rows], alpha=0.85)
    for y, (t, r) in enumerate(zip(times, rows)):
        speed = r["speedup"]
        note = f" {t:.1f} s" + (f"  ({speed:.2f}x)" if speed == speed else "")
        ax.text(t, y, note, va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(times, default=1) * 1.3)
    ax.set_xlabel("seconds to reach the budget")
    title = "Time to the same useful-token budget"
    if budget is not None:
        title += f": {budget:,.0f} target tokens"
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def _mix_columns(rows: Sequence[dict[str, Any]]) -> list[tuple[int, str]]:
    """One column per shard set: (L, packing), packing "" where the rows do not say (preflight's preview)."""
    return sorted({(int(r["max_length"]), str(r.get("packing", ""))) for r in rows})


def _mix_label(column: tuple[int, str]) -> str:
    L, packing = column
    return f"L{L} {packing}" if packing else f"L{L}"


def mixture_shares(rows: Sequence[dict[str, Any]], weight_of: str, path: str) -> str:
    """A mixture's mix per shard set (max length, and packed or unpacked where rows say): stacked shares
    of weight_of (asked beside realized), and how many times each source's kept examples are used.
    rows: prepack.packing.mixture.preview's (or the manifest's mixture.sources with a max_length and
    packing each)."""
    plt = _plt()
    columns = _mix_columns(rows)
    sources = list(dict.fromkeys(str(r.get("source", r.get("name"))) for r in rows))
    colors = _colors(sources)
    by = {(int(r["max_length"]), str(r.get("packing", "")), str(r.get("source", r.get("name")))): r for r in rows}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11 + max(0, len(columns) - 3), 4.2))
    x = np.arange(len(columns))
    for offset, key, label, alpha in ((-0.2, "requested_share", "asked", 0.45), (0.2, "realized_share", "mix", 1.0)):
        bottom = np.zeros(len(columns))
        for s in sources:
            values = np.array([by[(*c, s)][key] * 100 if (*c, s) in by else 0.0 for c in columns])
            left.bar(x + offset, values, 0.36, bottom=bottom, color=colors[s], alpha=alpha,
                     label=s if key == "realized_share" else None, edgecolor="white")
            bottom += values
    left.set_xticks(x)
    left.set_xticklabels([f"{_mix_label(c)}\nasked | mix" for c in columns])
    left.set_ylabel(f"share of {weight_of.replace('_', ' ')} (%)")
    left.set_ylim(0, 100)
    left.set_title("Shares per shard set (faded: asked)")
    left.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    width = 0.8 / max(1, len(sources))
    for i, s in enumerate(sources):
        right.bar(x + (i - (len(sources) - 1) / 2) * width, [by[(*c, s)]["repeats"] if (*c, s) in by else 0.0 for c in columns],
                  width, color=colors[s], label=s)
    right.axhline(1.0, color="0.5", lw=0.8, ls="--")
    right.set_xticks(x)
    right.set_xticklabels([_mix_label(c).replace(" ", "\n") for c in columns])
    right.set_ylabel("times each kept example is used")
    right.set_title("Repeats (< 1: down-sampled)")
    fig.tight_layout()
    return _save(fig, path)


def series_with_gaps(loss: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """A source's loss per step, smoothed over the steps that have it and NaN at the steps that do
    not (so the line breaks there instead of joining across), and which steps stand alone (a
    present step whose neighbours are both absent: no line segment shows it, a marker must)."""
    v = np.asarray(loss, dtype=np.float64)
    present = np.isfinite(v)
    smoothed = np.full(v.shape, np.nan)
    if present.any():
        smoothed[present] = _smooth(v[present])
    before = np.concatenate([[False], present[:-1]])
    after = np.concatenate([present[1:], [False]])
    return smoothed, present & ~before & ~after


def source_loss_curves(runs: Sequence[Any], path: str) -> str:
    """Each mixture source's training loss against step, one colour per source, one line style
    per run (report.Run.loss_by_source). A step without the source breaks its line; a step with
    the source between two without it is a marker."""
    plt = _plt()
    names = list(dict.fromkeys(n for run in runs for n in run.loss_by_source))
    colors = _colors(names)
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(9, 4.4))
    for k, run in enumerate(runs):
        for name in names:
            loss = run.loss_by_source.get(name)
            if loss is None:
                continue
            ys, alone = series_with_gaps(loss)
            if not np.isfinite(ys).any():
                continue
            label = name if len(runs) == 1 else f"{name} ({run.label})"
            joined = bool((np.isfinite(ys) & ~alone).any())  # some step has a present neighbour: a line shows
            ax.plot(run.steps, ys, styles[k % len(styles)], color=colors[name], lw=1.6, label=label if joined else None)
            if alone.any():
                ax.plot(run.steps[alone], ys[alone], "o", color=colors[name], markersize=4,
                        label=None if joined else label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss of the source's target tokens")
    ax.set_title("Loss by mixture source")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return _save(fig, path)


def reward_curves(runs: Sequence[Any], path: str) -> str:
    """Runs of an objective that logs TRL's rewards (report.Run.objective_metrics: a DPO run's): the
    rewards' margin and accuracy (left), the chosen and rejected rewards (right), against step; one
    colour per run."""
    plt = _plt()
    colors = _colors([run.label for run in runs])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    acc_axis = left.twinx()
    for run in runs:
        c = colors[run.label]
        label = run.label if len(runs) > 1 else None
        left.plot(run.steps, run.objective_metrics["rewards/margins"], "-", color=c, lw=1.6, label=f"margin{f' ({label})' if label else ''}")
        acc_axis.plot(run.steps, run.objective_metrics["rewards/accuracies"], ":", color=c, lw=1.4, label=f"accuracy{f' ({label})' if label else ''}")
        right.plot(run.steps, run.objective_metrics["rewards/chosen"], "-", color=c, lw=1.6, label=f"chosen{f' ({label})' if label else ''}")
        right.plot(run.steps, run.objective_metrics["rewards/rejected"], "--", color=c, lw=1.6, label=f"rejected{f' ({label})' if label else ''}")
    left.axhline(0, color="0.6", lw=0.8)
    right.axhline(0, color="0.6", lw=0.8)
    left.set_xlabel("step")
    left.set_ylabel("rewards/margins (chosen - rejected)")
    acc_axis.set_ylabel("rewards/accuracies (dotted)")
    acc_axis.set_ylim(-0.02, 1.02)
    left.set_title("Reward margin and accuracy")
    right.set_xlabel("step")
    right.set_ylabel("reward: beta (log pi - log ref)")
    right.set_title("Chosen and rejected rewards")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    lines = left.get_legend_handles_labels()
    more = acc_axis.get_legend_handles_labels()
    left.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, frameon=False)
    right.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return _save(fig, path)


def eval_generate_curves(runs: Sequence[Any], path: str) -> str:
    """`prepack train --eval-generate`: the held-out prompts' scores against step, one colour per
    run (report.Run.eval_generate): exact match (and tool-call accuracy where scored) on the left,
    the reference NLL on the right."""
    plt = _plt()
    colors = _colors([run.label for run in runs])
    fig, (rates, nll) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in runs:
        records = run.eval_generate
        if not records:
            continue
        steps = [r["step"] for r in records]
        color = colors[run.label]
        for key, style, name in (("exact_match", "-o", "exact match"), ("full_call_accuracy", "--s", "full-call accuracy")):
            values = [np.nan if r.get(key) is None else 100 * r[key] for r in records]
            if np.isfinite(values).any():
                rates.plot(steps, values, style, color=color, lw=1.6, markersize=4,
                           label=name if len(runs) == 1 else f"{name} ({run.label})")
        values = [np.nan if r.get("reference_nll") is None else r["reference_nll"] for r in records]
        nll.plot(steps, values, "-o", color=color, lw=1.6, markersize=4, label=run.label)
    rates.set_ylim(-3, 103)
    rates.set_ylabel("% of held-out prompts")
    rates.set_title("Generated answers right")
    nll.set_ylabel("mean NLL of the reference reply (nats/token)")
    nll.set_title("Reference NLL")
    from matplotlib.ticker import MaxNLocator

    for ax in (rates, nll):
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return _save(fig, path)
