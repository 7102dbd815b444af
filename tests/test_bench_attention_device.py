"""The prepared device benchmark (`python3 -m benchmarks.bench_attention --device-all`) runs end to end.

A device run is scarce (minutes, drawn by chance), so the command is run here on small shapes
(`--smoke`: L256, a 6-layer model of Gemma3 270M's structure, flash in Pallas interpret mode):
every attention variant agrees with dense's forward, every whole-step variant runs, and flash's
step computes dense's loss. What it cannot show here is the device's timing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


PARENT = """
import runpy, sys
sys.argv = ["bench_attention", *sys.argv[1:]]
runpy.run_module("benchmarks.bench_attention", run_name="__main__")
assert "jax" not in sys.modules, "the parent imported jax"
from jax._src import xla_bridge  # imported only now, to read the backends the run above opened (none)
print("PARENT_BACKENDS", dict(xla_bridge._backends), flush=True)
"""


def run_parent(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The benchmark as the device's parent process; afterwards it says whether it opened a backend."""
    return subprocess.run([sys.executable, "-c", PARENT, *args], capture_output=True, text=True, timeout=timeout)


COMMON = ("--smoke", "--repeats", "1", "--step-repeats", "1")


@pytest.fixture(scope="module")
def device_all(tmp_path_factory) -> dict:
    """One `--device-all --smoke` run, as the device's parent process (each part in its own child: the
    attention part, then one per step variant, merged into one JSON), read by the tests below."""
    out = tmp_path_factory.mktemp("bench_attention")
    done = run_parent("--device-all", "--budget-s", "900", "--out", str(out), *COMMON, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    return {"out": out, "done": done, "result": json.loads((out / "bench_attention.json").read_text())}


@pytest.mark.slow
def test_device_benchmark_runs_end_to_end_on_small_shapes(device_all) -> None:
    done, result = device_all["done"], device_all["result"]
    assert {"jax", "backend", "device"} <= set(result["machine"])
    assert result["rows"] == "smoke"
    assert [(r["L"], r["layer"]) for r in result["attention"]] == [(256, "global"), (256, "local")]
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


@pytest.mark.slow
def test_the_parts_merge_into_one_json_resume_and_the_parent_opens_no_device(device_all, tmp_path) -> None:
    """Only one process can hold a TPU: the parent of the step variants (and of --device-all) never
    imports JAX; each part (the attention part's child, then each step variant's) merges into one
    JSON, and a second call runs nothing already there."""
    assert "PARENT_BACKENDS {}" in device_all["done"].stdout
    result = device_all["result"]
    assert len(result["commands"]) == 2  # the attention part's, then the step part's: merged into one file
    assert all("failed" not in s and s["median_step_s"] > 0 for s in result["steps"])
    # Again, on a copy of those results: everything asked for is recorded, so nothing runs (no child
    # opens the device: none is started) and the results stay; as --part step, then as --device-all.
    out = str(tmp_path)
    shutil.copy(device_all["out"] / "bench_attention.json", tmp_path / "bench_attention.json")
    step = run_parent("--part", "step", "--variants", "dense:0:none", "--out", out, *COMMON)
    assert step.returncode == 0, step.stderr[-2000:]
    assert "PARENT_BACKENDS {}" in step.stdout and "step dense:0:none: already in" in step.stdout
    again = run_parent("--device-all", "--kinds", "dense", "--variants", "dense:0:none", "--out", out, *COMMON)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "PARENT_BACKENDS {}" in again.stdout
    assert "attention: 2 of 2 (L, layer, kind) already in" in again.stdout
    assert "step dense:0:none: already in" in again.stdout and "machine: " in again.stdout
    kept = json.loads((tmp_path / "bench_attention.json").read_text())
    assert kept["steps"] == result["steps"] and kept["attention"] == result["attention"]
    assert len(kept["commands"]) == 4


def test_results_of_other_rows_are_refused_in_one_line(tmp_path) -> None:
    (tmp_path / "bench_attention.json").write_text(json.dumps({"rows": "sha256:00", "attention": [], "steps": []}))
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_attention", "--part", "step", "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "jax" not in done.stderr
    assert done.stderr.strip().endswith("holds results on other rows (sha256:00, these are smoke); give another --out")
    assert done.stderr.count("\n") == 1


def test_the_whole_step_variants_run_flash_at_the_trainers_default_block() -> None:
    from benchmarks import bench_attention
    from train.attention_kernels import flash_attention

    for backend in ("tpu", "gpu"):
        flash = [v for v in bench_attention.step_variants(backend, smoke=False) if v.startswith("flash:")]
        assert flash == [f"flash:{flash_attention.DEFAULT_BLOCK[backend]}:layer", f"flash:{flash_attention.DEFAULT_BLOCK[backend]}:none"]
