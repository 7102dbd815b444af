"""The optimizer and output options of `prepack train`, their checks, and the pinned Tunix internals (fast: no training).

Schedules (train/run_config/schedule.py) against their formulas; the refusals of bad values and outputs,
each in one line before any weight loads (train/run_config/outputs.py, train/run_setup.py); the Tunix
contract (train/tunix_contract.py) passing on the installed Tunix and naming what differs on one
whose internals changed; the recorder's fetch windows (train/measurement/metrics.py).
"""

from __future__ import annotations

import inspect
import math
import os

import numpy as np
import pytest

from train import tunix_contract
from train.measurement import metrics
from train.run_config import outputs, schedule
from train.run_config.config import TrainConfig, TrainError

PEAK = 2e-3


def values(kind: str, steps: int, **kw) -> np.ndarray:
    spec = schedule.resolve(kind, PEAK, steps, **kw)
    fn = schedule.make_schedule(spec)
    return np.array([float(fn(i)) for i in range(steps)])


def test_constant_is_the_default_and_warms_up_linearly() -> None:
    assert TrainConfig(shards="x").lr_schedule == "constant"
    np.testing.assert_allclose(values("constant", 6), PEAK)
    np.testing.assert_allclose(values("constant", 6, warmup_steps=2), [0, PEAK / 2, PEAK, PEAK, PEAK, PEAK], rtol=1e-6)


def test_cosine_linear_and_wsd_reach_the_floor_at_the_last_steps() -> None:
    steps, warm, floor = 20, 4, 0.1
    cos = values("cosine", steps, warmup_steps=warm, min_lr_ratio=floor)
    np.testing.assert_allclose(cos[:warm + 1], np.arange(warm + 1) / warm * PEAK, rtol=1e-6)
    expect = [PEAK * floor + (PEAK - PEAK * floor) * 0.5 * (1 + math.cos(math.pi * (i - warm) / (steps - warm))) for i in range(warm, steps)]
    np.testing.assert_allclose(cos[warm:], expect, rtol=1e-5)
    lin = values("linear", steps, warmup_ratio=0.2, min_lr_ratio=floor)  # 0.2 x 20 = 4 warmup steps
    np.testing.assert_allclose(lin[warm:], [PEAK + (PEAK * floor - PEAK) * (i - warm) / (steps - warm) for i in range(warm, steps)], rtol=1e-5)
    wsd = values("wsd", steps, warmup_steps=warm, min_lr_ratio=floor)
    decay = round(schedule.WSD_DECAY_FRACTION * steps)  # 2 steps
    np.testing.assert_allclose(wsd[warm:steps - decay], PEAK, rtol=1e-6)
    np.testing.assert_allclose(wsd[steps - decay:], [PEAK + (PEAK * floor - PEAK) * j / decay for j in range(decay)], rtol=1e-5)
    assert schedule.resolve("cosine", PEAK, steps).identity()["total_steps"] == steps
    assert schedule.resolve("constant", PEAK, steps).identity()["total_steps"] is None  # --steps may change on resume


@pytest.mark.parametrize(("kw", "message"), [
    ({"kind": "exp"}, "unknown --lr-schedule 'exp'; choose one of constant, cosine, linear, wsd"),
    ({"learning_rate": float("nan")}, "--learning-rate must be a positive number, got nan"),
    ({"learning_rate": -1.0}, "--learning-rate must be a positive number, got -1.0"),
    ({"warmup_steps": 2, "warmup_ratio": 0.1}, "give --warmup-steps or --warmup-ratio, not both"),
    ({"warmup_ratio": 1.0}, "--warmup-ratio must be in [0, 1), got 1.0"),
    ({"warmup_steps": 10}, "--warmup-steps must be from 0 to --steps - 1 (9), got 10"),
    ({"min_lr_ratio": 1.5}, "--min-lr-ratio must be in [0, 1], got 1.5"),
])
def test_schedule_flags_are_refused_in_one_line(kw, message) -> None:
    args = {"kind": "cosine", "learning_rate": PEAK, "steps": 10, **kw}
    with pytest.raises(TrainError) as e:
        schedule.resolve(args.pop("kind"), args.pop("learning_rate"), args.pop("steps"), **args)
    assert str(e.value) == message


def test_run_outputs_lists_every_output_option() -> None:
    cfg = TrainConfig(shards="s", metrics_out="m.jsonl", checkpoint_dir="ck", save_lora="ad", tensorboard="tb",
                      profile_steps="2:3", steps=5, compile_cache="xla")
    assert [(o.flag, o.path, o.kind) for o in outputs.run_outputs(cfg)] == [
        ("--metrics-out", "m.jsonl", "file"), ("--checkpoint-dir", "ck", "folder"), ("--save-lora", "ad", "folder"),
        ("--tensorboard", "tb", "folder"), ("--profile-dir", "tb", "folder"),
        ("--compile-cache", os.path.realpath("xla"), "folder")]  # the cache's folder as JAX gets it: resolved
    assert "--compile-cache" not in [o.flag for o in outputs.run_outputs(TrainConfig(shards="s", compile_cache="off"))]
    assert outputs.run_outputs(TrainConfig(shards="s", save_lora="a.safetensors", lora_format="prepack"))[0].kind == "file"


@pytest.mark.parametrize(("kw", "message"), [
    ({"save_lora": "{tmp}/exists"}, "--save-lora {tmp}/exists already exists; pass --overwrite to replace it, or give another path"),
    ({"save_lora": "{tmp}/file", "lora_format": "peft"}, "--save-lora {tmp}/file is a file; give a folder"),
    ({"save_lora": "gs:///x"}, "--save-lora 'gs:///x' names no bucket: write gs://BUCKET/FOLDER"),
    ({"tensorboard": "gs://b/tb"}, "--tensorboard gs://b/tb: writes to a local folder only; give a local path (or a gcsfuse mount)"),
    ({"profile_steps": "2:3"}, "--profile-steps needs a folder for the trace: --profile-dir DIR, or --tensorboard DIR (the trace then "
                               "shows in TensorBoard's profile tab)"),
    ({"profile_steps": "3", "profile_dir": "p"}, "--profile-steps '3': expected A:B, the first and last optimizer step to trace (e.g. 3:5)"),
    ({"profile_steps": "4:9", "profile_dir": "p"}, "--profile-steps 4:9: need 1 <= A <= B <= --steps (5)"),
    ({"metrics_out": "{tmp}/exists"}, "--metrics-out {tmp}/exists is a folder; give a file path"),
])
def test_bad_outputs_are_refused_before_any_weight_loads(tmp_path, kw, message) -> None:
    (tmp_path / "exists").mkdir()
    (tmp_path / "file").write_text("x")
    cfg = TrainConfig(shards="s", steps=5, **{k: v.format(tmp=tmp_path) for k, v in kw.items()})
    with pytest.raises(TrainError) as e:
        outputs.check_outputs(cfg)
    assert str(e.value) == message.format(tmp=tmp_path)


def test_overwrite_lets_an_existing_adapter_folder_be_replaced(tmp_path) -> None:
    (tmp_path / "exists").mkdir()
    outputs.check_outputs(TrainConfig(shards="s", save_lora=str(tmp_path / "exists"), overwrite=True))


def test_profile_steps_become_tunix_profiler_options() -> None:
    options = outputs.profiler_options(TrainConfig(shards="s", steps=9, profile_steps="3:5", tensorboard="tb"))
    # Tunix starts at loop iteration skip_first_n_steps (0-based) and stops after profiler_steps iterations.
    assert (options.log_dir, options.skip_first_n_steps, options.profiler_steps) == ("tb", 2, 3)


def test_the_installed_tunix_is_the_pinned_one() -> None:
    assert tunix_contract.differences() == []
    tunix_contract.check()


def test_a_tunix_whose_internals_differ_is_refused_naming_them(monkeypatch) -> None:
    from tunix.sft import peft_trainer

    # What Tunix's main already did: the train step takes the accumulator and an update flag.
    def _train_step(self, model, optimizer, grad_accumulator, inputs, is_update_step):
        raise AssertionError("never called")

    monkeypatch.setattr(peft_trainer.PeftTrainer, "_train_step", _train_step)
    with pytest.raises(TrainError) as e:
        tunix_contract.check(version="0.1.8")
    message = str(e.value)
    assert message.startswith("prepack train is built against google-tunix 0.1.7's PeftTrainer internals, and the installed "
                              "Tunix differs: google-tunix 0.1.8 is installed, not 0.1.7; PeftTrainer._train_step(self, model, "
                              "optimizer, grad_accumulator, inputs, is_update_step) (0.1.7: (self, model, optimizer, inputs); "
                              "the train step's calling convention (model, optimizer, inputs))")
    assert message.endswith("Install google-tunix==0.1.7 (pip install -e \".[train]\")") and "\n" not in message


def test_a_changed_train_loop_is_named(monkeypatch) -> None:
    from tunix.sft import peft_trainer

    original = peft_trainer.PeftTrainer.train

    def train(self, train_ds, eval_ds=None, skip_jit=False, *, cache_nnx_graph=True):  # same signature, other body
        return original(self, train_ds, eval_ds, skip_jit, cache_nnx_graph=cache_nnx_graph)

    monkeypatch.setattr(peft_trainer.PeftTrainer, "train", train)
    assert tunix_contract.differences(version="0.1.7") == [
        "PeftTrainer.train changed (its loop: the post-restore skip, the per-step save, when the aux is handed over)"]
    assert list(inspect.signature(train).parameters) == list(inspect.signature(original).parameters)


def test_window_step_times_give_step_1_its_compile_and_share_the_rest() -> None:
    assert metrics.window_step_times(0.0, [5.0, 5.1, 5.2], 8.0, first=True) == [5.0, 1.5, 1.5]
    assert metrics.window_step_times(8.0, [8.1, 8.2], 10.0, first=False) == [1.0, 1.0]
    assert metrics.window_step_times(0.0, [5.0], 7.0, first=True) == [7.0]


def test_the_recorder_writes_rows_only_when_it_fetches(tmp_path) -> None:
    path = tmp_path / "m.jsonl"
    rec = metrics.MetricsRecorder(str(path), static={"batch_size": 1}, log_every=2, last_step=3, grad_accum_steps=2)
    batch = {"segment_ids": np.array([[[1, 1, 0], [1, 2, 2]]]), "loss_mask": np.array([[[0, 1, 0], [0, 0, 1]]])}
    for step in (1, 2, 3):
        rec.batch_arrived(batch)
        rec.step_dispatched({"loss": np.float32(2.0), "grad_norm": np.float32(3.0), "learning_rate": np.float32(1e-3),
                             "clipped": np.bool_(True), "nll_sum": np.float32(4.0), "target_tokens": np.float32(2.0)})
        assert not path.exists()  # nothing until a fetch: the file appears with its first record
    rec.fetch()
    rows = [__import__("json").loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["micro_steps"] for r in rows] == [2, 4, 6]
    assert rows[0]["target_tokens"] == 2 and rows[0]["tokens"] == 5 and rows[0]["density"] == pytest.approx(5 / 6)
    assert rows[0]["learning_rate"] == pytest.approx(1e-3) and rows[0]["clipped"] is True and rows[0]["grad_norm"] == 3.0
    assert rec.fetches == 1 and rec.wants_fetch(1) and rec.wants_fetch(2) and not rec.wants_fetch(5) and rec.wants_fetch(3)
