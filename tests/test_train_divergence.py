"""A run whose loss or gradient norm goes non-finite never ends quietly (--nan-policy, train/measurement/divergence.py).

The fault is injected at a chosen row: the masked loss is wrapped (monkeypatched where the
trainer looks it up) so that a batch holding the marker token POISON gets loss * NaN, which makes
the loss and every gradient NaN inside the real jitted train step. Which step carries that row
follows from the loader's deterministic order, computed here from the same shard set.
"""

from __future__ import annotations

import itertools
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import loaders
from prepack.format import rowformat
from testkit.shard_sets import TEST_TOKENIZER, build_shard_set
from testkit.train_batches import learnable_segments
from train import cli
from train.adapter_files import lora_file
from train.checkpointing import checkpoints
from train.measurement import divergence
from train.run_config.config import TrainError
from train.step import loss as loss_lib

VOCAB = 64
MAX_LENGTH = 32
BATCH = 4
POISON = 1  # learnable_segments uses ids >= 3


def _rows(poisoned: int | None) -> list[dict[str, np.ndarray]]:
    segments = learnable_segments(12, VOCAB, seed=3)
    if poisoned is not None:
        ids = segments[poisoned].input_ids.copy()
        ids[1] = POISON
        segments[poisoned] = rowformat.Segment(ids, segments[poisoned].loss_mask)
    return [rowformat.build_row([s], MAX_LENGTH) for s in segments]


def _batches(shards: str, steps: int) -> list[np.ndarray]:
    """The input_ids of the loader's first `steps` batches (its order is deterministic)."""
    ds = loaders.make_dataset(shards, BATCH, 0, 0, 1, None)
    return [np.asarray(batch["input_ids"]) for batch in itertools.islice(iter(ds), steps)]


def _steps_holding(shards: str, row: dict[str, np.ndarray], steps: int, batches: list[np.ndarray] | None = None) -> list[int]:
    batches = _batches(shards, steps) if batches is None else batches[:steps]
    return [k for k, ids in enumerate(batches, 1) if any(np.array_equal(r, row["input_ids"]) for r in ids)]


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> dict:
    """A shard set with the marker in the row that the loader serves at step 2 (and later in epoch 2)."""
    root = tmp_path_factory.mktemp("divergence")
    tokenizer = {**TEST_TOKENIZER, "name": "tiny-test", "vocab_size": VOCAB}
    clean = str(root / "clean")
    rows = _rows(None)
    build_shard_set(clean, rows=rows, tokenizer=tokenizer, num_shards=1)
    served = _batches(clean, 3)  # read once, not once per row tried
    target = next(i for i, row in enumerate(rows) if _steps_holding(clean, row, 3, served) == [2])
    shards = str(root / "poisoned")
    rows = _rows(target)
    build_shard_set(shards, rows=rows, tokenizer=tokenizer, num_shards=1)
    # The marker changes a token, not the order: the poisoned row is still served at step 2.
    assert _steps_holding(shards, rows[target], 3) == [2]
    return {"shards": shards, "row": rows[target]}


@pytest.fixture
def poison_hook(monkeypatch) -> None:
    real = loss_lib.masked_loss_fn_with_aux

    def poisoned_loss(model, input_tokens, input_mask, positions, attention_mask):
        loss, aux = real(model, input_tokens, input_mask, positions, attention_mask)
        fault = jnp.where(jnp.any(input_tokens == POISON), jnp.nan, 1.0)
        # The train step differentiates the loss's sum (train/step/train_step.py): poison it too.
        return loss * fault, {**aux, "loss": aux["loss"] * fault, "nll_sum": aux["nll_sum"] * fault}

    monkeypatch.setattr(loss_lib, "masked_loss_fn_with_aux", poisoned_loss)


def _read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _args(shards: str, tmp_path, steps: int, *extra: str) -> list[str]:
    # tiny-qwen3 (2 layers, not tiny-gemma3's 6): what --nan-policy does is the model's no more than the
    # loader's, and the poisoned step is compiled for these tests alone, so the smaller one compiles.
    return ["--shards", shards, "--model", "tiny-qwen3", "--lora-rank", "4", "--batch-size", str(BATCH), "--steps", str(steps),
            "--learning-rate", "1e-2", "--metrics-out", str(tmp_path / "m.jsonl"), "--save-lora", str(tmp_path / "lora.safetensors"),
            "--lora-format", "prepack",
            "--read-threads", "1", "--loss-chunk-tokens", "0", *extra]  # the poison wraps the full-logits loss


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_stop_is_the_default_exits_3_naming_the_step_and_saves_the_last_finite_adapter(poisoned, poison_hook, tmp_path,
                                                                                         capsys) -> None:
    ckpt = str(tmp_path / "ckpt")
    rc = cli.main(_args(poisoned["shards"], tmp_path, 4, "--log-every", "0", "--checkpoint-dir", ckpt, "--checkpoint-every", "1"))
    err = capsys.readouterr().err
    assert rc == divergence.EXIT_DIVERGED == 3
    message = [line for line in err.splitlines() if line.startswith("prepack train:")]
    assert message == [
        "prepack train: step 2: loss is nan, gradient norm is nan; training stopped (--nan-policy stop) without saving "
        f"this step's checkpoint; the adapter of step 1, the last step fetched finite, was saved to {tmp_path / 'lora.safetensors'}. "
        "Try a lower --learning-rate or --dtype float32, or --nan-policy skip-step to skip such steps"
    ]
    assert "Traceback" not in err
    # The saved adapter is step 1's: finite, trained (lora_b moved off its zero init), and says so.
    meta, tensors = lora_file.read_lora(str(tmp_path / "lora.safetensors"))
    assert meta["step"] == "1" and any(np.any(v != 0) for k, v in tensors.items() if k.endswith("_lora_b"))
    assert checkpoints.CheckpointDir(ckpt).latest_step() == 1  # step 1 was saved; step 2 never was
    records = _read(str(tmp_path / "m.jsonl"))
    steps = [r for r in records if "step" in r and "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[1]["loss"] is None and steps[1]["grad_norm"] is None and steps[1]["nonfinite"] == "loss is nan, gradient norm is nan"
    summary = records[-1]["summary"]
    assert summary["stopped"] == {"step": 2, "reason": "loss is nan, gradient norm is nan", "nan_policy": "stop"}
    assert summary["final_loss"] is None


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_stop_saves_no_adapter_when_no_step_was_fetched_finite(poisoned, poison_hook, tmp_path, capsys) -> None:
    """--log-every 0 and no checkpoints: the only fetch is at the end, which finds step 2 non-finite;
    no finite LoRA values were ever copied, so none is saved."""
    rc = cli.main(_args(poisoned["shards"], tmp_path, 4, "--log-every", "0"))
    err = capsys.readouterr().err
    assert rc == 3 and "without saving this step's checkpoint or a LoRA file." in err
    assert not os.path.exists(tmp_path / "lora.safetensors")


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_skip_step_skips_and_counts_the_bad_steps_and_progress_lines_say_what_happens(poisoned, poison_hook, tmp_path, capsys) -> None:
    steps = 4
    expected = _steps_holding(poisoned["shards"], poisoned["row"], steps)
    assert expected[0] == 2
    rc = cli.main(_args(poisoned["shards"], tmp_path, steps, "--nan-policy", "skip-step", "--log-every", "10"))
    err = capsys.readouterr().err
    assert rc == 0, err
    records = _read(str(tmp_path / "m.jsonl"))
    step_records = [r for r in records if "step" in r and "loss" in r]
    assert [r["step"] for r in step_records if r.get("skipped")] == expected
    assert all(np.isfinite(r["loss"]) for r in step_records if not r.get("skipped"))
    summary = records[-1]["summary"]
    assert summary["skipped_steps"] == len(expected) and summary["stopped"] is None and np.isfinite(summary["final_loss"])
    # The skipped updates were not applied: the exported adapters are finite.
    import safetensors.numpy

    assert all(np.isfinite(v).all() for v in safetensors.numpy.load_file(str(tmp_path / "lora.safetensors")).values())
    # Progress: what it loads (and how big), that it compiles (--remat auto, the default: in the plan), then step 1, the skipped steps, and the last step.
    lines = err.splitlines()
    order = ["loading tiny-qwen3 weights (random) as float32 ...", "loaded ", "--remat auto: the step plans ", "the train step is compiled (--remat auto's plan); step 1 runs it", "step 1: "]
    at = [next(i for i, line in enumerate(lines) if line.startswith(p)) for p in order]
    assert at == sorted(at)
    assert any(line.startswith("step 2: loss non-finite (loss is nan, gradient norm is nan)") and "update skipped" in line for line in lines)
    assert any(line.startswith(f"step {steps}: ") for line in lines)  # the last step, although 4 % 10 != 0
    assert not any(line.startswith("step 3: ") for line in lines) or 3 in expected


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_stop_catches_an_update_that_overflows_finite_values(poisoned, tmp_path, capsys, monkeypatch) -> None:
    """Issue 71: finite loss and gradients, but an update that makes the LoRA values inf (as --learning-rate
    1e300 did, which is now refused as a flag): the default stop ends the run at that step, exit 3, instead
    of training on and losing the adapter at the save."""
    import optax

    from train.step import optimizer as optimizer_lib

    real = optimizer_lib.adamw
    monkeypatch.setattr(optimizer_lib, "adamw", lambda *a, **k: optax.chain(real(*a, **k), optax.scale(np.inf)))
    rc = cli.main(_args(poisoned["shards"], tmp_path, 1, "--log-every", "0"))
    err = capsys.readouterr().err
    assert rc == divergence.EXIT_DIVERGED and "Traceback" not in err, err
    message = [line for line in err.splitlines() if line.startswith("prepack train:")]
    assert message == ["prepack train: step 1: the LoRA values after the update are non-finite; training stopped "
                       "(--nan-policy stop) without saving this step's checkpoint or a LoRA file. Try a lower "
                       "--learning-rate or --dtype float32, or --nan-policy skip-step to skip such steps"]
    step = [r for r in _read(str(tmp_path / "m.jsonl")) if "step" in r and "loss" in r][0]
    assert np.isfinite(step["loss"]) and np.isfinite(step["grad_norm"]) and "skipped" in step and not step["skipped"]
    assert divergence.nonfinite_reason({"loss": 1.0, "grad_norm": 2.0}, True) is None


def test_nan_policy_is_checked() -> None:
    divergence.check_policy("skip-step")
    with pytest.raises(TrainError, match=r"--nan-policy 'skip': choose stop or skip-step"):
        divergence.check_policy("skip")


def test_a_lora_file_with_non_finite_values_is_not_written(tmp_path) -> None:
    from flax import nnx

    from train.model import models

    built = models.build_model("tiny-qwen3", vocab_size=VOCAB)
    model = models.apply_lora(built.model, built.spec, rank=2)
    state = nnx.state(model, nnx.LoRAParam)
    first = next(iter(nnx.to_flat_state(state)))[1]
    first.set_value(first.get_value().at[(0,) * first.get_value().ndim].set(jnp.inf))
    nnx.update(model, state)
    path = str(tmp_path / "bad.safetensors")
    with pytest.raises(lora_file.LoraFileError, match=r"bad.safetensors: not written: tensor \S+ is non-finite \(NaN/Inf in 1 of \d+ values\); the run diverged"):
        lora_file.save_lora(model, path, {"model": "tiny-qwen3"})
    assert not os.path.exists(path)
    assert not checkpoints.lora_is_finite(model)
