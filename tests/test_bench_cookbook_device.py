"""benchmarks/bench_cookbook_device.py: equal epochs, one schedule, the order and estimate of the runs, and a
device call (child processes only) that resumes, exports what the CPU needs and is imported here.

The device call runs two tiny `prepack train` runs (tiny Gemma3, a 256-id vocabulary, rows built
without Beam); the figures of the real model are the chip's to produce, not a test's.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from benchmarks import bench_cookbook_device as cook
from prepack.format import rowformat
from testkit import train_batches as testing
from testkit.shard_sets import TEST_TOKENIZER, build_shard_set

VOCAB, LENGTH = 256, 64
LENGTHS = (20, 15, 21, 30, 25, 9, 17, 30)
PACKED = ((0, 1, 2), (3, 4), (5, 6), (7,))  # as many rows as a batch: the trainer refuses fewer

PARENT = """
import runpy, sys
sys.argv = ["bench_cookbook_device", *sys.argv[1:]]
try:
    runpy.run_module("benchmarks.bench_cookbook_device", run_name="__main__")
except SystemExit as e:
    assert not e.code, e.code
assert "jax" not in sys.modules, "the parent imported jax"
print("PARENT_WITHOUT_JAX", flush=True)
"""


def real_plan() -> dict:
    """The recipe with the sets --prepare made of the two tasks (their rows and lengths as packed)."""
    plan = cook.recipe(smoke=False)
    shapes = {"tools": ({"length": 384, "rows": 80}, {"length": 192, "rows": 160}, 30),
              "identity": ({"length": 128, "rows": 143}, {"length": 64, "rows": 450}, 36)}
    for task, (packed, unpacked, heldout) in shapes.items():
        plan["tasks"][task].update({"layouts": {"packed": packed, "unpacked": unpacked}, "heldout_prompts": heldout})
    plan["dpo"].update({"length": 384, "rows": 47})
    return plan


def option(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_both_layouts_train_the_same_epochs_on_one_schedule_scaled_to_their_steps() -> None:
    plan = real_plan()
    runs = {r.key: r for r in cook.planned_runs(plan)}
    command = lambda key: cook.train_command(plan, runs[key], "W", "O", "/tmp/weights/g.gguf", "/tmp/xla")  # noqa: E731
    packed, unpacked = command("train tools packed seed=0"), command("train tools unpacked seed=1")
    assert (option(packed, "--steps"), option(unpacked, "--steps")) == ("60", "120")  # 3 epochs of 80 and 160 rows, 4 a step
    assert option(command("train identity unpacked seed=0"), "--steps") == str(math.ceil(450 / 4))
    for flag, value in (("--learning-rate", "0.001"), ("--lr-schedule", "cosine"), ("--warmup-ratio", "0.05"),
                        ("--batch-size", "4"), ("--lora-rank", "8"), ("--remat", "none"), ("--weights", "/tmp/weights/g.gguf"),
                        ("--compile-cache", "/tmp/xla"), ("--dtype", "bfloat16"), ("--attention", "dense")):
        assert option(packed, flag) == option(unpacked, flag) == value, flag
    assert (option(packed, "--seed"), option(unpacked, "--seed")) == ("0", "1")
    assert option(packed, "--shards") == os.path.join("W", "device", "tools", "packed", "L384")
    assert option(unpacked, "--shards") == os.path.join("W", "device", "tools", "unpacked", "L192")
    assert option(unpacked, "--eval-shards") == os.path.join("W", "device", "tools", "eval", "L192")  # the same records at each L
    assert option(unpacked, "--save-lora") == os.path.join("O", "adapters", "tools-unpacked-seed1")
    assert "--eval-shards" not in cook.train_command(plan, runs["train tools packed seed=0"], "W", "O", None, None, evaluate=False)
    dpo = command("dpo packed seed=0")
    assert option(dpo, "--objective") == "dpo" and option(dpo, "--shards") == os.path.join("W", "device", "dpo", "packed", "L384")
    assert option(dpo, "--steps") == str(math.ceil(2 * 47 / 4)) and "--save-lora" not in dpo and "--eval-shards" not in dpo


def test_the_runs_come_tool_calls_first_and_the_cpu_scores_what_needs_transformers() -> None:
    runs = cook.planned_runs(real_plan())
    device = [r.key for r in runs if r.where == cook.DEVICE]
    assert device == ["train tools packed seed=0", "train tools unpacked seed=0", "train tools packed seed=1",
                      "train tools unpacked seed=1", "train identity packed seed=0", "train identity unpacked seed=0",
                      "score identity base", "score identity packed seed=0", "score identity unpacked seed=0",
                      "dpo packed seed=0", "generate identity packed seed=0 batch=1", "generate identity packed seed=0 batch=32",
                      "train identity packed seed=1", "train identity unpacked seed=1", "score identity packed seed=1",
                      "score identity unpacked seed=1"]  # batch 8: the scoring run's
    here = [r.key for r in runs if r.where == cook.HERE]
    assert here == ["score tools base", "score tools packed seed=0", "score tools unpacked seed=0", "score tools packed seed=1",
                    "score tools unpacked seed=1", "score identity base @cpu", "score identity packed seed=0 @cpu"]
    assert len({r.name for r in runs}) == len(runs)  # one file name each
    plan = real_plan()
    by_key = {r.key: r for r in runs}
    tools = cook.generate_command(plan, by_key["score tools packed seed=0"], "W", "O", "A", None, None)
    assert option(tools, "--tokenizer") == "hf:" + os.path.join("W", "here", "tools", "tokenizer") and option(tools, "--lora") == "A"
    speed = cook.generate_command(plan, by_key["generate identity packed seed=0 batch=1"], "W", "O", "A", "g.gguf", "/tmp/xla")
    assert option(speed, "--input") == os.path.join("W", "device", "identity", "throughput.jsonl")
    assert (option(speed, "--batch-size"), option(speed, "--max-prompts"), option(speed, "--weights")) == ("1", "48", "g.gguf")
    assert "--tokenizer" not in speed and "--score" in speed  # the score summary holds the tokens/s


def test_the_estimate_counts_one_cold_compile_per_shape_and_nothing_for_done_runs() -> None:
    plan = real_plan()
    runs = [r for r in cook.planned_runs(plan) if r.where == cook.DEVICE]
    costs = cook.estimates(runs, plan)
    cold, cached = costs["train tools packed seed=0"], costs["train tools packed seed=1"]
    assert cold - cached == pytest.approx(cook.TRAIN_COMPILE_S[False] - cook.TRAIN_COMPILE_S[True]
                                          + cook.EVAL_COMPILE_S[False] - cook.EVAL_COMPILE_S[True])
    assert costs["train identity unpacked seed=0"] == pytest.approx(costs["train identity packed seed=0"], abs=5)  # each compiles its L
    assert 1200 < sum(costs.values()) < 1900  # the fifth session's sixteen runs: ~1,650 s of processes
    without_eval = cook.estimates(runs, plan, evaluate=False)
    assert without_eval["train tools packed seed=0"] == pytest.approx(cold - cook.EVAL_COMPILE_S[False] - 2 * cook.STEP_FLOOR_S)
    assert without_eval["dpo packed seed=0"] == costs["dpo packed seed=0"]  # DPO evaluates nothing either way
    done = cook.estimates(runs, plan, {"train tools packed seed=0"})
    assert done["train tools packed seed=0"] == 0 and done["train tools packed seed=1"] == cached  # a warm machine's cache


def test_train_figures_put_the_first_step_apart(tmp_path) -> None:
    steps = [{"step": i + 1, "loss": loss, "step_time_s": t} for i, (loss, t) in
             enumerate([(3.0, 20.0), (2.0, 0.1), (1.5, 0.1), (1.0, 0.3), (0.5, 0.1)])]
    summary = {"steps": 5, "first_step_time_s": 20.0, "median_step_time_s": 0.1, "final_loss": 0.5, "eval_loss": 0.7,
               "evals": [{"step": 0, "loss": 3.1}, {"step": 5, "loss": 0.7}], "mfu": 0.4}
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*steps, {"eval": summary["evals"][1]}, {"summary": summary}]))
    figures = cook.train_figures(str(path), rows_per_epoch=6, batch_size=4)  # an epoch is the last 2 steps
    assert figures["train_s"] == pytest.approx(20.6) and figures["steps_s"] == pytest.approx(0.6)
    assert figures["compile_s"] == pytest.approx(19.9) and figures["train_without_compile_s"] == pytest.approx(0.7)
    assert figures["last_epoch_loss"] == pytest.approx(0.75) and figures["eval_loss"] == 0.7 and figures["mfu"] == 0.4
    assert figures["evals"] == [{"step": 0, "loss": 3.1}, {"step": 5, "loss": 0.7}]
    assert cook.train_figures(str(tmp_path / "none.jsonl"), 6, 4) is None


class WordTokenizer:
    """One id per word: the chip's and the CPU's texts re-encoded alike."""

    def __init__(self) -> None:
        self.words: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.words.setdefault(w, len(self.words)) for w in text.split()]

    def decode(self, ids) -> str:
        names = {i: w for w, i in self.words.items()}
        return " ".join(names[i] for i in ids)


def write_generations(path, completions: dict[str, str]) -> str:
    path.write_text("".join(json.dumps({"id": k, "completion": v}) + "\n" for k, v in completions.items()))
    return str(path)


def test_the_verdict_is_read_against_the_seeds_spread(capsys) -> None:
    train = lambda s, e: {"train_s": s, "train_without_compile_s": s - 9.0, "process_s": s + 40.0, "eval_loss": e}  # noqa: E731
    runs = {"train tools packed seed=0": train(10.0, 0.50), "train tools packed seed=1": train(12.0, 0.52),
            "train tools unpacked seed=0": train(20.0, 0.51), "train tools unpacked seed=1": train(24.0, 0.49),
            "score tools packed seed=0": {"full_call_accuracy": 1.0}, "score tools packed seed=1": {"full_call_accuracy": 0.9},
            "score tools unpacked seed=0": {"full_call_accuracy": 0.95}, "score tools unpacked seed=1": {"failed": "exit 1"}}
    cook.print_layout_summary(runs, "tools", [0, 1])
    rows = capsys.readouterr().out.splitlines()
    assert rows[-2] == "| packed | 11.0 ± 1.000 | 2.000 ± 1.000 | 0.510 ± 0.010 | 95.0% ± 5.0% | - | - | - |"
    assert rows[-1] == "| unpacked | 22.0 ± 2.000 | 13.0 ± 2.000 | 0.500 ± 0.010 | 95.0% | - | - | - |"
    ratios = cook.layout_ratios(runs, "tools", [0, 1])
    assert ratios["chip s to the end of training"] == "packed 11.0 s, one per row 22.0 s, 2.00x"
    assert ratios["less the compile"] == "packed 2.0 s, one per row 13.0 s, 6.50x"


def test_greedy_agreement_counts_the_leading_equal_tokens_and_shows_where_they_part(tmp_path, capsys) -> None:
    cpu = write_generations(tmp_path / "cpu.jsonl", {"a": "I am Parcel , a small assistant", "b": "The team made me", "c": "x y"})
    chip = write_generations(tmp_path / "chip.jsonl", {"a": "I am Parcel , a tiny assistant", "b": "The team made me", "c": "z"})
    counts = {c["id"]: c for c in cook.compare_generations(cpu, chip, WordTokenizer())}
    assert counts["a"] == {"id": "a", "equal": 5, "cpu": 7, "chip": 7, "before": "am Parcel , a", "cpu_next": "small assistant",
                           "chip_next": "tiny assistant"}
    assert counts["b"]["equal"] == counts["b"]["cpu"] == 4 and counts["c"]["equal"] == 0
    summary = cook.agreement_summary(list(counts.values()))
    assert (summary["prompts"], summary["all_equal"], summary["min"], summary["median"]) == (3, 1, 0, 4)
    assert [c["id"] for c in summary["parted"]] == ["a", "c"]
    cook.print_agreement([{"run": "score identity base", **summary}])
    assert "  score identity base, a: 5 of 7 equal; after 'am Parcel , a': CPU 'small assistant', chip 'tiny assistant'" \
        in capsys.readouterr().out
    other = write_generations(tmp_path / "other.jsonl", {"a": "I", "d": "?"})
    with pytest.raises(cook.CookbookError, match=r"other\.jsonl: not the prompts of .*cpu\.jsonl \(3 ids differ\)"):
        cook.compare_generations(cpu, other, WordTokenizer())


def test_merging_takes_finished_runs_and_keeps_ones_already_there() -> None:
    into = {"machine": {"jax": "0.10.2"}, "runs": {"a": {"failed": "exit 1: x"}, "b": {"v": 1}}, "commands": ["c1"]}
    other = {"machine": {"device": "TPU v5 lite"}, "runs": {"a": {"v": 2}, "b": {"v": 3}, "c": {"failed": "exit 1"}},
             "commands": ["c1", "c2"]}
    assert cook.merge_results(into, other) == ["a"]
    assert into["runs"] == {"a": {"v": 2}, "b": {"v": 1}} and into["commands"] == ["c1", "c2"]
    assert into["machine"] == {"jax": "0.10.2", "device": "TPU v5 lite"}


def build_work_dir(work) -> dict:
    """WORK/device as --prepare lays it out for the tool-call task (rows built here, without Beam) and its plan."""
    examples = testing.make_examples(LENGTHS, VOCAB, seed=2)
    tokenizer = {**TEST_TOKENIZER, "vocab_size": VOCAB}
    sets = {"packed": PACKED, "unpacked": tuple((i,) for i in range(len(LENGTHS))), "eval": ((0,), (1,), (2,), (3,))}
    for layout, plan in sets.items():
        rows = [rowformat.build_row([examples[i] for i in row], LENGTH) for row in plan]
        build_shard_set(work / "device" / "tools" / layout / f"L{LENGTH}", rows=rows, rows_per_shard=[len(rows)],
                        max_length=LENGTH, tokenizer=tokenizer)
    plan = cook.recipe(smoke=True)
    plan["tasks"]["tools"].update({"layouts": {"packed": {"length": LENGTH, "rows": 4}, "unpacked": {"length": LENGTH, "rows": 8}},
                                   "heldout_prompts": 4})
    plan["tasks"]["identity"].update({"layouts": {"packed": {"length": LENGTH, "rows": 4}, "unpacked": {"length": LENGTH, "rows": 8}},
                                      "heldout_prompts": 4})
    plan["dpo"].update({"length": LENGTH, "rows": 3})
    (work / "device" / cook.PLAN).write_text(json.dumps(plan))
    return plan


def test_a_device_call_runs_children_only_resumes_and_exports_what_the_cpu_needs(tmp_path) -> None:
    plan = build_work_dir(tmp_path / "work")
    call = ["--work-dir", str(tmp_path / "work"), "--runs", "tools", "--out", str(tmp_path / "out"), "--budget-s", "600"]
    done = subprocess.run([sys.executable, "-c", PARENT, *call, "--export", str(tmp_path / "export")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:] + done.stdout[-3000:]
    assert "PARENT_WITHOUT_JAX" in done.stdout
    results = json.loads((tmp_path / "out" / cook.RESULTS).read_text())
    assert set(results["runs"]) == {"train tools packed seed=0", "train tools unpacked seed=0"}
    for key, run in results["runs"].items():
        assert "failed" not in run, run
        assert run["steps"] == run["steps_planned"] == 3 and run["first_step_time_s"] > 0 and run["steps_s"] > 0
        assert run["train_s"] == pytest.approx(run["first_step_time_s"] + run["steps_s"])
        assert run["eval_loss"] > 0 and run["final_loss"] > 0 and run["where"] == "device"
        assert run["command"].startswith("python3 -m apps.cli train --model tiny-gemma3")
    assert {"jax", "device", "backend"} <= set(results["machine"])
    assert sorted(os.listdir(tmp_path / "export")) == sorted([cook.FILES_TAR, "adapters-0.tar", cook.RESULTS])  # both tiny adapters
    # Again: both are recorded, nothing runs. And on a fresh machine, from the carried resume.json.
    again = subprocess.run([sys.executable, "-m", "benchmarks.bench_cookbook_device", *call], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.count("already in") == 2 and "$ python3" not in again.stdout
    shutil.copy(tmp_path / "out" / cook.RESULTS, tmp_path / "work" / "device" / cook.RESUME)
    fresh = call[:call.index("--out") + 1] + [str(tmp_path / "fresh")] + call[call.index("--out") + 2:]
    again = subprocess.run([sys.executable, "-m", "benchmarks.bench_cookbook_device", *fresh], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "2 finished runs taken" in again.stdout and again.stdout.count("already in") == 2
    # Here: the call's files merged, the adapters where the CPU's scoring finds them.
    assert cook.main(["--work-dir", str(tmp_path / "work"), "--import", str(tmp_path / "export")]) == 0
    here = json.loads((tmp_path / "work" / "here" / "out" / cook.RESULTS).read_text())
    assert here["runs"] == results["runs"]
    ctx = cook.Context(plan, str(tmp_path / "work"), str(tmp_path / "work" / "here" / "out"), None, None, cook.HERE)
    score = cook.Run("score", "tools", "unpacked", 0, where=cook.HERE)
    assert ctx.adapter_dir(score) == str(tmp_path / "work" / "here" / "adapters" / "tools-unpacked-seed0")
    assert "adapter_config.json" in os.listdir(ctx.adapter_dir(score))


def test_a_run_the_chip_refused_because_still_held_starts_again_once(tmp_path, monkeypatch) -> None:
    plan = real_plan()
    run = cook.Run("train", "tools", "packed", 0)
    ctx = cook.Context(plan, str(tmp_path / "work"), str(tmp_path / "out"), "g.gguf", "/tmp/xla", cook.DEVICE, log=lambda _: None)
    calls = []

    def child(cmd, log, timeout, env):
        calls.append(timeout)
        os.makedirs(os.path.dirname(log), exist_ok=True)
        if len(calls) == 1:  # as seen on a v5e when a process opened the chip another still held
            open(log, "w").write("RuntimeError: Internal error when accessing libtpu multi-process lockfile\n")
            return 1, 3.0, "RuntimeError: Internal error when accessing libtpu multi-process lockfile"
        metrics = cmd[cmd.index("--metrics-out") + 1]
        os.makedirs(os.path.dirname(metrics), exist_ok=True)
        steps = [{"step": 1, "loss": 2.0, "step_time_s": 30.0}, {"step": 2, "loss": 1.0, "step_time_s": 0.1}]
        open(metrics, "w").write("".join(json.dumps(r) + "\n" for r in [*steps, {"summary": {"steps": 2}}]))
        return 0, 60.0, "done"

    monkeypatch.setattr(cook, "run_child", child)
    monkeypatch.setattr(cook.time, "sleep", lambda s: calls.append(f"slept {s}"))
    result = cook.one_run(run, ctx, timeout=500.0)
    assert calls == [500.0, "slept 5.0", 492.0] and "failed" not in result
    assert result["process_s"] == 68.0 and result["train_s"] == pytest.approx(30.1)
    # Any other failure is recorded as it is, not run again in this call.
    calls.clear()

    def out_of_memory(cmd, log, timeout, env):
        calls.append(timeout)
        open(log, "w").write("prepack train: out of memory at step 1 ...\n")
        return 1, 9.0, "prepack train: out of memory at step 1 ..."

    monkeypatch.setattr(cook, "run_child", out_of_memory)
    result = cook.one_run(run, ctx, timeout=500.0)
    assert calls == [500.0] and result["failed"] == "out of memory: prepack train: out of memory at step 1 ..."
    assert cook.final(result)  # out of memory is not retried by later calls either


def test_each_call_exports_the_adapters_made_since_the_last_two_to_a_tar(tmp_path) -> None:
    out = tmp_path / "out"
    cook.save_results(str(out / cook.RESULTS), cook.empty_results())
    for name in ("tools-packed-seed0", "tools-unpacked-seed0", "tools-packed-seed1"):
        (out / "adapters" / name).mkdir(parents=True)
        (out / "adapters" / name / "adapter_model.safetensors").write_bytes(b"\0" * 7_627_048)  # a rank-8 270M adapter
    first = cook.export(str(out), str(tmp_path / "call1"))
    assert [os.path.basename(p) for p in first] == [cook.RESULTS, cook.FILES_TAR, "adapters-0.tar", "adapters-1.tar"]
    assert all(os.path.getsize(p) < 16 * 2**20 for p in first)
    with tarfile.open(first[2]) as tar:
        assert {m.name.split("/")[0] for m in tar.getmembers()} == {"tools-packed-seed0", "tools-packed-seed1"}
    (out / "adapters" / "identity-packed-seed0").mkdir()
    assert [os.path.basename(p) for p in cook.export(str(out), str(tmp_path / "call2"))][2:] == ["adapters-0.tar"]
    with tarfile.open(tmp_path / "call2" / "adapters-0.tar") as tar:
        assert {m.name.split("/")[0] for m in tar.getmembers()} == {"identity-packed-seed0"}
    assert len(cook.export(str(out), str(tmp_path / "call3"), again=True)) == 4  # all four again: two tars


def test_the_resume_kit_carries_the_adapters_unfinished_runs_read_and_retrains_a_lost_one(tmp_path) -> None:
    work = tmp_path / "work"
    (work / "device").mkdir(parents=True)
    (work / "device" / cook.PLAN).write_text(json.dumps(real_plan()))
    done = {"steps": 36}
    cook.save_results(str(work / "here" / "out" / cook.RESULTS), {"machine": {}, "commands": [], "runs": {
        "train identity packed seed=0": done, "train identity unpacked seed=0": done, "train tools packed seed=0": done,
        "score identity packed seed=0": {"prompts": 36}}})
    for name in ("identity-packed-seed0", "tools-packed-seed0"):  # brought back; identity-unpacked-seed0 was not
        (work / "here" / "adapters" / name).mkdir(parents=True)
        (work / "here" / "adapters" / name / "adapter_model.safetensors").write_bytes(b"\0" * 100)
    (work / "device" / "adapters" / "stale").mkdir(parents=True)
    cook.resume_kit(str(work))
    # identity packed seed=0 is still read by the generation runs; tools adapters are scored here, not there
    assert os.listdir(work / "device" / "adapters") == ["identity-packed-seed0"]
    resume = json.loads((work / "device" / cook.RESUME).read_text())
    assert set(resume["runs"]) == {"train identity packed seed=0", "train tools packed seed=0", "score identity packed seed=0"}


def test_a_work_folder_without_a_plan_is_one_line(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_cookbook_device", "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"bench_cookbook_device: no {tmp_path}/device/plan.json: run `python -m "
                                  "benchmarks.bench_cookbook_device --prepare")
    older = real_plan()
    del older["attention"], older["compare"]
    (tmp_path / "device").mkdir()
    (tmp_path / "device" / cook.PLAN).write_text(json.dumps(older))
    with pytest.raises(cook.CookbookError, match=r"plan\.json has no attention, compare: an older --prepare wrote it; "
                                                  r"run --prepare again$"):
        cook.read_plan(str(tmp_path))
