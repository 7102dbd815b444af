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


def _lines(drawn):
    def capture(fig, path):
        drawn["lines"] = [(line.get_xdata(), line.get_ydata(), line.get_marker(), line.get_label()) for ax in fig.axes for line in ax.lines]
        drawn["legend"] = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
        drawn["ticks"] = [[t.get_text() for t in ax.get_xticklabels()] for ax in fig.axes]
        return path
    return capture


def test_source_loss_breaks_at_absent_steps_and_marks_a_lone_point(tmp_path, monkeypatch):
    import math
    from types import SimpleNamespace

    import numpy as np

    nan = math.nan
    run = SimpleNamespace(label="r", steps=np.arange(1, 8), loss_by_source={
        "alpaca": np.array([3.0, 2.9, 2.8, 2.7, 2.6, 2.5, 2.4]),
        "fr": np.array([3.3, 3.2, nan, nan, 3.1, 3.0, 2.9]),  # absent at steps 3 and 4
        "chat": np.array([nan, nan, nan, 2.5, nan, nan, nan]),  # one point
    })
    drawn = {}
    monkeypatch.setattr(plots, "_save", _lines(drawn))
    plots.source_loss_curves([run], str(tmp_path / "s.png"))
    by_label = {label: (x, y, marker) for x, y, marker, label in drawn["lines"] if not label.startswith("_")}
    assert set(by_label) == set(drawn["legend"]) == {"alpaca", "fr", "chat"}
    x, y, marker = by_label["fr"]
    assert list(x) == [1, 2, 3, 4, 5, 6, 7] and np.isnan(y[2:4]).all() and np.isfinite(np.delete(y, [2, 3])).all()
    assert marker in ("None", "", None)  # fr has neighbours everywhere it is present: a line, broken at 3-4
    x, y, marker = by_label["chat"]
    assert list(x) == [4] and list(y) == [2.5] and marker == "o"  # drawn, not only in the legend


def test_series_with_gaps_smooths_present_steps_only():
    import math

    import numpy as np

    ys, alone = plots.series_with_gaps([1.0, math.nan, 2.0, 3.0, math.nan, 5.0])
    assert np.isnan(ys[[1, 4]]).all() and list(alone) == [True, False, False, False, False, True]


def test_mixture_shares_has_one_column_per_shard_set(tmp_path, monkeypatch):
    rows = [{"max_length": L, "packing": p, "name": s, "requested_share": 0.5, "realized_share": 0.5, "repeats": r}
            for L, p, r in ((512, "packed", 1.4), (512, "unpacked", 1.4), (1024, "packed", 0.8)) for s in ("a", "b")]
    drawn = {}
    monkeypatch.setattr(plots, "_save", _lines(drawn))
    plots.mixture_shares(rows, "target_tokens", str(tmp_path / "m.png"))
    assert drawn["ticks"][0] == ["L512 packed\nasked | mix", "L512 unpacked\nasked | mix", "L1024 packed\nasked | mix"]
    # preflight's preview rows carry no packing: columns are lengths alone.
    plots.mixture_shares([{k: v for k, v in r.items() if k != "packing"} for r in rows if r["packing"] == "packed"],
                         "target_tokens", str(tmp_path / "m.png"))
    assert drawn["ticks"][0] == ["L512\nasked | mix", "L1024\nasked | mix"]
