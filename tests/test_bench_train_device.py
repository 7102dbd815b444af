"""benchmarks/bench_train_device.py: `prepack train` runs, one process each, merged into one resumable JSON.

On the device each run holds the chip alone, so the benchmark's own process imports no JAX; here
one tiny run per layout (tiny Gemma3, a 256-id vocabulary, rows built without Beam) checks the
figures come from the trainer's summary and that a second call runs nothing already recorded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks import bench_train_device as bench
from prepack.format import rowformat
from testkit import train_batches as testing
from testkit.shard_sets import TEST_TOKENIZER, build_shard_set

VOCAB, LENGTH = 256, 64
LENGTHS = (20, 15, 21, 30, 25, 9, 17, 30)
PACKED = ((0, 1, 2), (3, 4, 5), (6, 7))

PARENT = """
import runpy, sys
sys.argv = ["bench_train_device", *sys.argv[1:]]
try:
    runpy.run_module("benchmarks.bench_train_device", run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
assert "jax" not in sys.modules, "the parent imported jax"
print("PARENT_WITHOUT_JAX", flush=True)
"""


def build_work_dir(work) -> None:
    """WORK/gemma3/<packed|unpacked>/L64 as --pack lays them out (rows built here, without Beam)."""
    examples = testing.make_examples(LENGTHS, VOCAB, seed=2)
    tokenizer = {**TEST_TOKENIZER, "vocab_size": VOCAB}
    layouts = {"packed": PACKED, "unpacked": tuple((i,) for i in range(len(LENGTHS)))}
    for layout, plan in layouts.items():
        rows = [rowformat.build_row([examples[i] for i in row], LENGTH) for row in plan]
        build_shard_set(work / "gemma3" / layout / f"L{LENGTH}", rows=rows, rows_per_shard=[len(rows)], max_length=LENGTH,
                        tokenizer=tokenizer)


def test_the_plan_puts_gemma3_270m_first_then_the_others_at_8x2048() -> None:
    runs = bench.planned_runs(bench.build_parser().parse_args(["--attention", "flash", "--layouts", "packed"]))
    keys = [(r.model, r.batch, r.length) for r in runs]
    assert keys[:5] == [("gemma3-270m", 16, 1024), ("gemma3-270m", 8, 2048), ("gemma3-270m", 2, 8192),
                        ("qwen3-0.6b", 8, 2048), ("gemma3-1b", 8, 2048)]
    assert len(keys) == 9 and len(set(keys)) == 9


def test_tiny_runs_record_the_trainers_figures_and_resume(tmp_path) -> None:
    build_work_dir(tmp_path / "work")
    args = ["--work-dir", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--models", "tiny-gemma3",
            "--shapes", f"2x{LENGTH}", "--attention", "dense", "--steps", "3", "--budget-target-tokens", "1000"]
    done = subprocess.run([sys.executable, "-c", PARENT, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PARENT_WITHOUT_JAX" in done.stdout
    results = json.loads((tmp_path / "out" / bench.RESULTS_NAME).read_text())
    runs = results["runs"]
    assert set(runs) == {f"tiny-gemma3 2x{LENGTH} packed dense remat=none", f"tiny-gemma3 2x{LENGTH} unpacked dense remat=none"}
    for key, run in runs.items():
        assert "failed" not in run, run
        assert run["timed_steps"] == 2 and run["median_step_time_s"] > 0 and run["first_step_time_s"] > 0
        assert run["target_tokens_per_s"] > 0 and run["tokens_per_s"] >= run["target_tokens_per_s"]
        assert "device_peak_bytes" in run and run["device_kind"] == "cpu"  # None on a CPU: it reports no memory
        assert run["command"].startswith("python3 -m apps.cli train --shards ") and "--weights random --dtype bfloat16" in run["command"]
    packed, unpacked = (runs[f"tiny-gemma3 2x{LENGTH} {layout} dense remat=none"] for layout in ("packed", "unpacked"))
    assert packed["mean_target_density"] > unpacked["mean_target_density"]
    assert {"jax", "device", "backend"} <= set(results["machine"])
    assert f"Time to 1,000 target tokens" in done.stdout
    # Again: both runs are in the results, so nothing runs and the figures stay.
    again = subprocess.run([sys.executable, "-c", PARENT, *args], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already in") == 2 and "$ python3 -m apps.cli train" not in again.stdout
    assert json.loads((tmp_path / "out" / bench.RESULTS_NAME).read_text())["runs"] == runs


def test_time_to_a_budget_is_the_budget_over_each_layouts_rate() -> None:
    runs = {"m 2x64 packed dense remat=none": {"target_tokens_per_s": 100.0, "first_step_time_s": 10.0},
            "m 2x64 unpacked dense remat=none": {"target_tokens_per_s": 25.0, "first_step_time_s": 2.0}}
    (t,) = bench.budget_times(runs, 1000.0)
    assert (t["packed_s"], t["unpacked_s"], t["unpacked_over_packed"]) == (10.0, 40.0, 4.0)
    assert (t["packed_with_first_step_s"], t["unpacked_with_first_step_s"]) == (20.0, 42.0)


def test_missing_shard_sets_are_one_line(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_train_device", "--work-dir", str(tmp_path / "none"),
                           "--out", str(tmp_path / "out"), "--models", "tiny-gemma3", "--shapes", "2x64"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"bench_train_device: no shard set at {tmp_path / 'none'}/gemma3/packed/L64")


def test_a_run_is_the_trainers_own_command_with_the_profile_and_extra_options() -> None:
    args = bench.build_parser().parse_args(["--work-dir", "W", "--out", "O", "--profile", "P", "--train-args", "--seed 3"])
    run = bench.Run("qwen3-0.6b", 8, 2048, "unpacked", "splash", "none")
    cmd = bench.train_cmd(run, args, "M.jsonl")
    assert cmd[1:4] == ["-m", "apps.cli", "train"] and cmd[cmd.index("--shards") + 1] == os.path.join("W", "qwen3", "unpacked", "L2048")
    assert cmd[cmd.index("--profile-steps") + 1] == "10:13" and cmd[cmd.index("--profile-dir") + 1] == "P"
    assert cmd[-2:] == ["--seed", "3"] and cmd[cmd.index("--attention") + 1] == "splash"
    assert cmd[cmd.index("--batch-size") + 1] == "8" and cmd[cmd.index("--metrics-out") + 1] == "M.jsonl"


def test_a_run_past_its_budget_keeps_what_the_trainer_said_last(tmp_path, monkeypatch) -> None:
    """The child's output is saved whether it ends or is stopped: a run cut off by the budget says where it was."""
    talker = "import sys, time; print('compiling'); print('step 3: loss 1.5', file=sys.stderr, flush=True); time.sleep(30)"
    monkeypatch.setattr(bench, "train_cmd", lambda run, args, metrics: [sys.executable, "-c", talker])
    args = bench.build_parser().parse_args(["--out", str(tmp_path), "--label", "gqa,tile=256"])
    run = bench.Run("gemma3-270m", 8, 2048, "packed", "flash", "none", "gqa,tile=256")
    result = bench.one_run(run, args, timeout=3)
    assert result["failed"] == "no result within 3 s (the time budget); last said: step 3: loss 1.5"
    assert result["log"] == str(tmp_path / "logs" / "gemma3-270m_8x2048_packed_flash_remat_none_gqa_tile_256.log")
    assert open(result["log"]).read().splitlines() == ["compiling", "step 3: loss 1.5"]
