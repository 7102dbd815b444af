"""`prepack train` end to end with the recipe options: accumulation, schedule, clipping, TensorBoard, profile, resume.

Tiny Qwen3 (vocab 128) on a 16-row shard set whose row r starts with token r, so every
batch names its rows. Runs (a compile each): K=2 micro-batches of 2 rows against K=1 batches
of 4 rows (the same rows per optimizer step, so the same losses and adapters); and the K=2 run
straight against interrupted after step 3 and resumed from its step-2 checkpoint.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any

import numpy as np
import pytest

from testkit.shard_sets import TEST_TOKENIZER, build_shard_set, row_ids, synthetic_row
from train import trainer
from train.adapter_files import lora_file
from train.measurement import metrics
from train.run_config import schedule

VOCAB = 128
MAX_LENGTH = 32
ROWS = 16
TOKENIZER = {**TEST_TOKENIZER, "name": "adapter-test", "vocab_size": VOCAB}
STEPS = 4


class Preempted(Exception):
    pass


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("adapter_shards") / "set")
    rng = np.random.default_rng(0)
    build_shard_set(path, rows=[synthetic_row(r, MAX_LENGTH, rng, vocab_size=VOCAB) for r in range(ROWS)], tokenizer=TOKENIZER)
    return path


def _cfg(shards: str, **kw: Any) -> trainer.TrainConfig:
    base = dict(shards=shards, model="tiny-qwen3", lora_rank=4, batch_size=2, steps=STEPS, learning_rate=2e-2,
                lr_schedule="cosine", warmup_steps=1, min_lr_ratio=0.1, max_grad_norm=0.02, grad_accum_steps=2,
                log_every=2, read_threads=1, loss_chunk_tokens=16)
    base.update(kw)
    return trainer.TrainConfig(**base)


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _steps(path: str) -> list[dict]:
    return [r for r in _rows(path) if "step" in r and "loss" in r]


def _scalars(logdir: str) -> dict[str, dict[int, float]]:
    """TensorBoard event files read back (TFRecord framing, tensorboardX's own Event proto)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
        data = open(path, "rb").read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


@pytest.fixture(scope="module")
def accumulated(shards, tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("accumulated")
    cfg = _cfg(shards, metrics_out=str(root / "m.jsonl"), tensorboard=str(root / "tb"), profile_steps="2:3",
               save_lora=str(root / "adapter"), checkpoint_dir=str(root / "ckpt"), checkpoint_every=2)
    seen: list[list[list[int]]] = []
    arrived = metrics.MetricsRecorder.batch_arrived

    def watch(self, batch):
        seen.append(row_ids(batch).tolist())
        arrived(self, batch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(metrics.MetricsRecorder, "batch_arrived", watch)
        s, summary = trainer.execute(cfg)
    return {"cfg": cfg, "summary": summary, "lora": lora_file.lora_tensors(s.built.model), "root": root, "seen": seen}


@pytest.mark.slow  # trains a tiny model three times: see pytest.ini
def test_accumulated_run_records_schedule_clipping_and_micro_steps(accumulated) -> None:
    cfg, summary = accumulated["cfg"], accumulated["summary"]
    rows = _steps(cfg.metrics_out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["micro_steps"] for r in rows] == [2, 4, 6, 8]
    lr = schedule.make_schedule(schedule.resolve("cosine", cfg.learning_rate, STEPS, 1, None, 0.1))
    assert [r["learning_rate"] for r in rows] == pytest.approx([float(lr(i)) for i in range(STEPS)], rel=1e-6)
    assert rows[0]["learning_rate"] == 0.0 and rows[1]["learning_rate"] == pytest.approx(cfg.learning_rate)
    assert all(r["clipped"] == (r["grad_norm"] > cfg.max_grad_norm) for r in rows) and summary["clipped_steps"] >= 1
    # a step's counts are its two micro-batches' (2 rows each): the rows it saw, in the loader's order
    assert [np.array(b).shape for b in accumulated["seen"]] == [(2, 2)] * STEPS
    assert all(r["tokens"] <= 2 * 2 * MAX_LENGTH and r["device_target_tokens"] == r["target_tokens"] for r in rows)
    assert summary["micro_steps"] == 8 and summary["grad_accum_steps"] == 2
    assert summary["fetches"] == 4  # the first step, 2 (--log-every, a checkpoint), 3 (the profile's end), 4 (the last)
    scalars = _scalars(cfg.tensorboard)
    assert {int(k): v for k, v in scalars["train/loss"].items()} == pytest.approx({r["step"]: r["loss"] for r in rows}, rel=1e-6)
    assert scalars["train/learning_rate"][2] == pytest.approx(rows[1]["learning_rate"], rel=1e-6)
    assert glob.glob(os.path.join(cfg.tensorboard, "plugins", "profile", "*", "*.xplane.pb"))
    assert os.path.isfile(os.path.join(cfg.save_lora, "adapter_model.safetensors"))


@pytest.mark.slow  # trains a tiny model three times: see pytest.ini
def test_k_micro_batches_train_as_one_batch_of_their_rows(accumulated, shards, tmp_path) -> None:
    """The same rows per optimizer step, stacked K=2 x 2 or one batch of 4: the same losses, norms and adapters."""
    one = _cfg(shards, batch_size=4, grad_accum_steps=1, metrics_out=str(tmp_path / "m.jsonl"))
    s, _ = trainer.execute(one)
    a, b = _steps(accumulated["cfg"].metrics_out), _steps(one.metrics_out)
    assert [r["target_tokens"] for r in a] == [r["target_tokens"] for r in b]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5)
    assert [r["grad_norm"] for r in a] == pytest.approx([r["grad_norm"] for r in b], rel=1e-4)
    mine = lora_file.lora_tensors(s.built.model)
    for name, value in accumulated["lora"].items():
        np.testing.assert_allclose(mine[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.slow  # trains a tiny model three times: see pytest.ini
def test_resume_with_accumulation_and_a_schedule_is_exact(accumulated, shards, tmp_path) -> None:
    cfg = _cfg(shards, metrics_out=str(tmp_path / "m.jsonl"), checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2)
    dispatched = metrics.MetricsRecorder.step_dispatched

    def crash(self, aux):
        dispatched(self, aux)
        if self.next_step() - 1 == 3:
            raise Preempted("after step 3")

    with pytest.MonkeyPatch.context() as mp, pytest.raises(Preempted):
        mp.setattr(metrics.MetricsRecorder, "step_dispatched", crash)
        trainer.execute(cfg)
    s, summary = trainer.execute(cfg)  # resumes from the step-2 checkpoint
    assert summary["first_step"] == 3 and summary["micro_steps"] == 4
    rows = _steps(cfg.metrics_out)
    straight = _steps(accumulated["cfg"].metrics_out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["learning_rate"] for r in rows] == pytest.approx([r["learning_rate"] for r in straight], rel=1e-6)
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in straight], rel=1e-5)
    mine = lora_file.lora_tensors(s.built.model)
    for name, value in accumulated["lora"].items():
        np.testing.assert_allclose(mine[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
