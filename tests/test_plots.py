"""Plot details a reader relies on: ticks across the data, labels that are all there and do not overlap."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from apps import plots  # noqa: E402


def test_times_axis_ticks_cover_the_values():
    # Values from 3.1x to 23.6x used to get ticks at 4x, 8x and 16x only.
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [3.1, 9.0, 23.6])
    ax.set_yscale("log", base=2)
    plots._times_ticks(ax)
    lo, hi = ax.get_ylim()
    ticks = [t for t in ax.get_yticks() if lo <= t <= hi]
    plt.close(fig)
    assert ticks == [3, 4, 6, 8, 12, 16, 24]
    assert all(b / a <= 2 for a, b in zip(ticks, ticks[1:]))  # no octave without a tick


def _labels(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_gain_panel_labels_every_batch_size(tmp_path, monkeypatch):
    rows = [{"dataset": "d", "max_length": L, "batch_size": b, "row_reduction": r, "throughput_gain": g}
            for L, r in ((256, 3.1), (512, 6.0), (1024, 11.9))
            for b, g in ((8, r * 0.98), (16, r * 0.9))]
    drawn = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.setdefault("labels", _labels(fig)) and path)
    plots.row_reduction(rows, str(tmp_path / "r.png"))
    want = {f"{r['throughput_gain']:.1f}x" for r in rows} | {f"{r['row_reduction']:.1f}x" for r in rows}
    assert want <= set(drawn["labels"])


def test_histogram_labels_are_whole_and_flag_big_drops(tmp_path, monkeypatch):
    hist = {30: 100, 200: 195, 300: 160}  # 355 of 455 over L=128 (78%), 160 over L=256 (35.2%), none over 512
    drawn = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.setdefault("texts", [t for ax in fig.axes for t in ax.texts]) and path)
    plots.length_histogram({"d": hist}, [128, 256, 512], str(tmp_path / "h.png"))
    by_text = {t.get_text(): t for t in drawn["texts"]}
    assert " L=256\n 160 over\n 35.2% dropped!" in by_text and " L=512\n 0 over\n 0.0%" in by_text
    assert by_text[" L=256\n 160 over\n 35.2% dropped!"].get_color() == "#d62728"
    assert by_text[" L=512\n 0 over\n 0.0%"].get_color() == "black"
    heights = [t.get_position()[1] for t in drawn["texts"]]
    assert heights[0] != heights[1] and heights[1] != heights[2]  # neighbours sit at different heights
