"""The prepared device benchmark (`python3 -m benchmarks.bench_attention --device-all`) runs end to end.

A device run is scarce (minutes, drawn by chance), so the command is run here on small shapes
(`--smoke`: L256, a 6-layer model of Gemma3 270M's structure, flash in Pallas interpret mode):
every attention variant agrees with dense's forward, every whole-step variant runs, and flash's
step computes dense's loss. What it cannot show here is the device's timing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_device_benchmark_runs_end_to_end_on_small_shapes(tmp_path) -> None:
    cmd = [sys.executable, "-m", "benchmarks.bench_attention", "--device-all", "--smoke", "--budget-s", "900",
           "--repeats", "1", "--step-repeats", "1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "bench_attention.json").read_text())
    assert {"jax", "backend", "device"} <= set(result["machine"])
    for row in result["attention"]:
        for name in ("dense", "blocked", "flash 64", "flash 128"):
            ms, _, err = row[name]  # a failed variant is a string: unpacking it fails the test
            assert ms > 0 and err < 1e-2, (row["layer"], name, err)
    steps = {s["variant"]: s for s in result["steps"]}
    assert set(steps) == {"flash:64:layer", "dense:0:layer", "flash:64:none", "dense:0:none"}
    assert all("failed" not in s and s["median_step_s"] > 0 for s in steps.values()), steps
    # Same weights, same batch: the first step's loss is the same with either attention.
    for remat in ("layer", "none"):
        assert steps[f"flash:64:{remat}"]["losses"][0] == pytest.approx(steps[f"dense:0:{remat}"]["losses"][0], abs=2e-3)
    assert "flash / dense step time" in done.stdout
