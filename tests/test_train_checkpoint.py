"""`prepack train --checkpoint-dir/--save-lora`: exact resume, LoRA-only checkpoints, the LoRA export.

One tiny Qwen3 (2 layers, d=64, vocab 128) on a 10-row shard set whose row r starts with
token r, so every batch names its rows. The expensive part is three trainings (a compile
each): straight to step 6, interrupted after step 5, resumed to step 6. Everything else
reuses their outputs or fails before any weight is loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from train import cli, packed_trainer, trainer
from train.adapter_files import lora_file
from train.adapter_files.lora_file import LoraFileError
from train.checkpointing import checkpoints, resume
from train.checkpointing.checkpoints import CheckpointError
from train.measurement import metrics
from train.model import fingerprint

from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)
from testkit.shard_sets import TEST_TOKENIZER, build_shard_set, row_ids, synthetic_row

MODEL = "tiny-qwen3"
VOCAB = 128
MAX_LENGTH = 32
ROWS = 10  # 5 batches per epoch: step 6 is the first batch of epoch 1
BATCH = 2
STEPS = 6
EVERY = 2
RANK = 4
CRASH_AFTER = 5  # the interrupted run dies after this step; its last checkpoint is step 4
TOKENIZER = {**TEST_TOKENIZER, "name": "ckpt-test", "vocab_size": VOCAB}


class Preempted(Exception):
    """Stands in for a preemption in the middle of a run."""


def _shards(path: str, seed: int) -> str:
    rng = np.random.default_rng(seed)
    build_shard_set(path, rows=[synthetic_row(r, MAX_LENGTH, rng, vocab_size=VOCAB) for r in range(ROWS)], tokenizer=TOKENIZER)
    return path


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt_shards")
    return {"main": _shards(str(root / "main"), 0), "other": _shards(str(root / "other"), 1)}


def _cfg(shards: str, **kw: Any) -> trainer.TrainConfig:
    base = dict(shards=shards, model=MODEL, lora_rank=RANK, batch_size=BATCH, steps=STEPS, learning_rate=3e-2,
                log_every=0, read_threads=1, checkpoint_every=EVERY)
    base.update(kw)
    return trainer.TrainConfig(**base)


@contextmanager
def _watch(crash_after: int | None = None) -> Iterator[list[list[int]]]:
    """Records the row ids of every train batch the trainer prepares; optionally dies after a step."""
    seen: list[list[int]] = []
    arrived, dispatched = metrics.MetricsRecorder.batch_arrived, metrics.MetricsRecorder.step_dispatched

    def batch_arrived(self: metrics.MetricsRecorder, batch: Any) -> None:
        seen.append(row_ids(batch).tolist())
        arrived(self, batch)

    def step_dispatched(self: metrics.MetricsRecorder, aux: Any) -> None:
        dispatched(self, aux)
        if crash_after is not None and self.next_step() - 1 == crash_after:
            raise Preempted(f"after step {crash_after}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(metrics.MetricsRecorder, "batch_arrived", batch_arrived)
        mp.setattr(metrics.MetricsRecorder, "step_dispatched", step_dispatched)
        yield seen


def _lora(model: Any) -> dict[str, np.ndarray]:
    return lora_file.lora_tensors(model)


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def straight(shard_sets, tmp_path_factory) -> dict[str, Any]:
    """STEPS steps in one go, checkpointing every EVERY steps, exporting the LoRA at the end."""
    root = tmp_path_factory.mktemp("straight")
    cfg = _cfg(shard_sets["main"], checkpoint_dir=str(root / "ckpt"), metrics_out=str(root / "m.jsonl"),
               save_lora=str(root / "lora.safetensors"), lora_format="prepack")
    with _watch() as seen:
        s, summary = trainer.execute(cfg)
    return {"setup": s, "summary": summary, "batches": seen, "lora": _lora(s.built.model), "cfg": cfg,
            "losses": [r["loss"] for r in _read_jsonl(cfg.metrics_out) if "loss" in r and "step" in r]}


# ----------------------------------------------------------------------------- exact resume


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_interrupted_then_resumed_equals_straight(straight, shard_sets, tmp_path) -> None:
    assert len(straight["batches"]) == STEPS and straight["summary"]["checkpoints_saved"] == [2, 4, 6]
    cfg = _cfg(shard_sets["main"], checkpoint_dir=str(tmp_path / "ckpt"), metrics_out=str(tmp_path / "m.jsonl"))

    with _watch(crash_after=CRASH_AFTER) as first, pytest.raises(Preempted):
        trainer.execute(cfg)
    assert first == straight["batches"][:CRASH_AFTER]
    import orbax.checkpoint as ocp

    assert sorted(ocp.utils.checkpoint_steps(os.path.join(cfg.checkpoint_dir, "tunix"))) == [2, 4]

    # A new run from scratch (model, trainer, dataset rebuilt), as after a restart.
    with _watch() as second:
        s, summary = trainer.execute(cfg)
    print(f"\nstraight batches {straight['batches']}\ninterrupted {first}\nresumed {second}")
    assert summary["resumed_from_step"] == 4 and summary["first_step"] == 5 and summary["steps"] == 2
    # Exactly the batches that followed step 4: batch 5 again (its update was lost), then 6 (epoch 1).
    assert second == straight["batches"][4:]
    assert summary["checkpoints_saved"] == [6]

    resumed, ref = _lora(s.built.model), straight["lora"]
    assert resumed.keys() == ref.keys()
    worst = max(float(np.max(np.abs(resumed[k] - ref[k]))) for k in ref)
    print(f"max |LoRA resumed - straight| = {worst:.3g}")
    for k in ref:
        np.testing.assert_allclose(resumed[k], ref[k], rtol=1e-6, atol=1e-7, err_msg=k)
    # Not vacuous: training moved the adapters (qwix starts B at zero).
    assert max(float(np.max(np.abs(v))) for k, v in ref.items() if k.endswith("_lora_b")) > 1e-3

    # One JSONL: steps 1..6 once each (step 5 of the interrupted run dropped), same losses as straight.
    lines = _read_jsonl(cfg.metrics_out)
    steps = [l for l in lines if "loss" in l and "step" in l]
    assert [l["step"] for l in steps] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([l["loss"] for l in steps], straight["losses"], rtol=1e-5)
    resume = [l["resume"] for l in lines if "resume" in l]
    assert resume == [{"from_step": 4, "dropped_records": 1, "checkpoint_dir": cfg.checkpoint_dir}]
    assert lines[-1]["summary"]["first_step"] == 5

    # Already at --steps: nothing is trained, and --save-lora exports the checkpoint's adapters.
    export = str(tmp_path / "from_ckpt.safetensors")
    with _watch() as third:
        _, again = trainer.execute(_cfg(shard_sets["main"], checkpoint_dir=cfg.checkpoint_dir, save_lora=export, lora_format="prepack"))
    assert third == [] and again["steps"] == 0 and again["resumed_from_step"] == STEPS
    assert again["lora_export"] == {"path": export, "format": "prepack", "step": STEPS, "rank": RANK}
    import safetensors.numpy

    exported = safetensors.numpy.load_file(export)
    for k in ref:
        np.testing.assert_allclose(exported[k], ref[k], rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_checkpoint_holds_only_lora_params_and_the_loader_state(straight) -> None:
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    s, ckpt = straight["setup"], straight["cfg"].checkpoint_dir
    step_dir = epath.Path(ckpt) / "tunix" / str(STEPS)
    params = ocp.PyTreeCheckpointHandler().metadata(step_dir / "model_params").tree
    leaves = jax.tree_util.tree_leaves_with_path(params)
    names = [".".join(str(getattr(k, "key", k)) for k in path) for path, _ in leaves]
    assert names and all("_lora_a" in n or "_lora_b" in n for n in names), names[:5]
    assert not any("embedder" in n or n.endswith(".w.value") for n in names)
    assert sum(int(np.prod(m.shape)) for _, m in leaves) == s.static["lora_params"] == 8192
    assert s.static["params"] > 10 * s.static["lora_params"]  # the base weights are the bulk, and not saved
    # Adam moments only for the LoRA params too.
    opt = ocp.PyTreeCheckpointHandler().metadata(step_dir / "optimizer_state").tree
    moments = [jax.tree_util.keystr(p) for p, m in jax.tree_util.tree_leaves_with_path(opt) if m.shape]
    assert moments and all("_lora_" in p for p in moments)

    # The loader state for each kept step: the position after exactly `step` batches.
    data = json.loads((epath.Path(ckpt) / "data" / "process_0-of-1.json").read_text())
    assert sorted(data["states"], key=int) == ["2", "4", "6"]
    assert data["states"]["6"]["grain"] == {"next_index": STEPS}
    run = json.loads((epath.Path(ckpt) / "run.json").read_text())
    assert run["identity"]["lora_rank"] == RANK and run["identity"]["model"] == MODEL
    assert run["base_weights"] == s.base_weights and len(run["base_weights"]["fingerprint"]) == 16


# ----------------------------------------------------------------------------- refusing another run


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"lora_rank": 8}, ["LoRA rank: checkpoint 4, now 8", "LoRA alpha: checkpoint 8.0, now 16.0"]),
        ({"model": "tiny"}, ["model: checkpoint 'tiny-qwen3', now 'tiny'"]),
        ({"shards": "other"}, ["shard set (content id): checkpoint", "shards: checkpoint read"]),
        ({"learning_rate": 1e-3}, ["learning rate: checkpoint 0.03, now 0.001"]),
    ],
)
@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_resume_refuses_a_checkpoint_of_another_run(straight, shard_sets, tmp_path, capsys, change, expected) -> None:
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(straight["cfg"].checkpoint_dir, ckpt)  # an undetected mismatch must not touch the fixture
    args = {"--shards": shard_sets["main"], "--model": MODEL, "--lora-rank": str(RANK), "--batch-size": str(BATCH),
            "--steps": str(STEPS + 2), "--learning-rate": "3e-2", "--checkpoint-dir": ckpt, "--log-every": "0"}
    for key, value in change.items():
        args["--" + key.replace("_", "-")] = shard_sets["other"] if value == "other" else str(value)
    rc = cli.main([x for kv in args.items() for x in kv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"--checkpoint-dir {ckpt} holds a different run (latest step {STEPS}), so it cannot be resumed" in err
    for text in expected:
        assert text in err
    assert "use a new --checkpoint-dir" in err


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_resume_refuses_other_base_weights_and_foreign_folders(straight, tmp_path) -> None:
    ckpt = checkpoints.CheckpointDir(straight["cfg"].checkpoint_dir)
    run = ckpt.read_run()
    assert ckpt.check_resumable(run["identity"], run["base_weights"]) == STEPS
    with pytest.raises(CheckpointError, match=r"base weights: checkpoint 'random' \(fingerprint \w+\), now 'gguf' \(fingerprint 0123\)"):
        ckpt.check_resumable(run["identity"], {"source": "gguf", "fingerprint": "0123"})
    # Orbax steps without our run.json: not ours to resume.
    foreign = str(tmp_path / "foreign")
    shutil.copytree(straight["cfg"].checkpoint_dir, foreign)
    os.remove(os.path.join(foreign, "run.json"))
    with pytest.raises(CheckpointError, match="holds checkpoints \\(latest step 6\\) but no run.json"):
        checkpoints.CheckpointDir(foreign).check_resumable(run["identity"])
    # An empty folder is a fresh start.
    assert checkpoints.CheckpointDir(str(tmp_path / "empty")).check_resumable(run["identity"]) is None


# ----------------------------------------------------------------------------- a checkpoint as a stranger's


def _edit_json(path: str, change) -> None:
    with open(path) as f:
        text = f.read()
    value = change(json.loads(text))
    with open(path, "w") as f:
        f.write(value if isinstance(value, str) else json.dumps(value))


def _data_file(ckpt: str) -> str:
    return os.path.join(ckpt, "data", "process_0-of-1.json")


def _set_next_index(record: dict) -> dict:
    record["states"][str(STEPS)]["grain"]["next_index"] = STEPS - 1
    return record


def _swap_optimizer(ckpt: str) -> None:
    """Step 6's optimizer state replaced by step 4's (each file whole: Orbax reads it as is)."""
    shutil.rmtree(os.path.join(ckpt, "tunix", str(STEPS), "optimizer_state"))
    shutil.copytree(os.path.join(ckpt, "tunix", "4", "optimizer_state"), os.path.join(ckpt, "tunix", str(STEPS), "optimizer_state"))


def _truncate_data(ckpt: str) -> None:
    for root, _, files in os.walk(os.path.join(ckpt, "tunix", str(STEPS), "optimizer_state")):
        for name in files:
            if os.sep + "d" in root:  # the array data files, not the metadata
                os.truncate(os.path.join(root, name), 10)


DAMAGED = checkpoints.DAMAGED
ALPHA_RANGE = "a LoRA alpha is a number above 0 and at most 1,000,000 (the adapter's update is alpha / r * B @ A)"
REMEDY = "remove {ckpt}/tunix/6 to resume from the checkpoint before it, or use a new --checkpoint-dir"


@pytest.mark.parametrize(("edit", "words", "before_weights"), [
    (lambda c: _edit_json(os.path.join(c, "run.json"), lambda r: "[]"),
     "{ckpt}/run.json: an array [] is not a run record (a JSON object); " + DAMAGED, True),
    (lambda c: _edit_json(os.path.join(c, "run.json"), lambda r: {**r, "identity": "x"}),
     "{ckpt}/run.json: `identity` is a string 'x', not a JSON object; " + DAMAGED, True),
    (lambda c: _edit_json(_data_file(c), lambda r: "[1,2]"),
     "{ckpt}/data/process_0-of-1.json: an array [1, 2] is not a record of loader states (a JSON object); " + DAMAGED, True),
    (lambda c: _edit_json(_data_file(c), lambda r: {**r, "states": {**r["states"], "6": [1, 2]}}),
     "{ckpt}/data/process_0-of-1.json: states['6'] is an array [1, 2]: not a loader state of a step; " + DAMAGED, True),
    (lambda c: _edit_json(_data_file(c), _set_next_index),
     "{ckpt}/data/process_0-of-1.json: the loader state of step 6 is after 5 batches, but step 6 read 6: resuming there "
     "would train batches twice or skip them; " + DAMAGED, True),
    (lambda c: shutil.rmtree(os.path.join(c, "tunix", str(STEPS), "optimizer_state")),
     "--checkpoint-dir {ckpt}: step 6 has no optimizer_state (the optimizer's moments and step count), so it cannot be "
     "resumed exactly; " + REMEDY, True),
    (lambda c: shutil.rmtree(os.path.join(c, "tunix", str(STEPS), "model_params")),
     "--checkpoint-dir {ckpt}: step 6 has no model_params (the LoRA parameters), so it cannot be resumed exactly; " + REMEDY,
     True),
    (_swap_optimizer, "--checkpoint-dir {ckpt}: step 6 was restored, but its optimizer state is of step 4, not 6; " + REMEDY,
     False),
    (_truncate_data, "--checkpoint-dir {ckpt}: step 6 cannot be restored (", False),
    # Issue 71: the adapter's scale in run.json, held to the rule of every adapter read back (JSON takes NaN, Infinity).
    *[(lambda c, v=value: _edit_json(os.path.join(c, "run.json"), lambda r: {**r, "identity": {**r["identity"], "lora_alpha": v}}),
       "{ckpt}/run.json: identity.lora_alpha " + words + "; " + DAMAGED, True)
      for value, words in [(float("nan"), f"is nan: {ALPHA_RANGE}"), (float("inf"), f"is inf: {ALPHA_RANGE}"),
                           (1e300, f"is 1e+300: {ALPHA_RANGE}"), ("8.0", "is a string '8.0', not a number"),
                           (True, "is a boolean True, not a number")]],
    *[(lambda c, v=value: _edit_json(os.path.join(c, "run.json"), lambda r: {**r, "identity": {**r["identity"], "lora_rank": v}}),
       "{ckpt}/run.json: identity.lora_rank " + words + "; " + DAMAGED, True)
      for value, words in [(-4, "is -4: a LoRA rank is a whole number from 1 to 2,147,483,647"),
                           (0, "is 0: a LoRA rank is a whole number from 1 to 2,147,483,647")]],
])
@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_resume_refuses_a_checkpoint_that_is_incomplete_or_disagrees(straight, shard_sets, tmp_path, capsys, edit, words,
                                                                     before_weights) -> None:
    """A checkpoint written by a stranger (or damaged): each is one line, exit 2, before any step.
    Without these checks an optimizer state deleted resumed with a fresh Adam, and a loader state
    edited to another step's position trained a batch twice (issue 46)."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(straight["cfg"].checkpoint_dir, ckpt)
    edit(ckpt)
    argv = ["--shards", shard_sets["main"], "--model", MODEL, "--lora-rank", str(RANK), "--batch-size", str(BATCH),
            "--steps", str(STEPS + 2), "--learning-rate", "3e-2", "--checkpoint-dir", ckpt, "--log-every", "0",
            "--checkpoint-every", str(EVERY), "--remat", "none", "--read-threads", "1"]
    with _watch() as seen:
        rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and seen == [], err
    line = err.splitlines()[-1]
    assert line.startswith("prepack train: " + words.format(ckpt=ckpt)), line
    if words.endswith("("):  # Orbax's own words inside, then the remedy
        assert line.endswith("): its files are damaged or incomplete; " + REMEDY.format(ckpt=ckpt)), line
    else:
        assert line == "prepack train: " + words.format(ckpt=ckpt)
    assert ("loading" not in err) == before_weights, err


# ----------------------------------------------------------------------------- LoRA export


_FORWARD: dict[str, Any] = {}


def _logits(model: Any, batch: dict[str, np.ndarray], cfg: Any = None) -> np.ndarray:
    """Logits of a [B, L] batch with the trainer's inputs (stored positions, and the mask or segment ids
    the attention installed by `cfg`'s run reads: a freshly built model keeps Tunix's dense attention)."""
    from flax import nnx

    from train.step import memory_path, model_inputs

    kind = "dense" if cfg is None else memory_path.attention_kind(cfg)
    if kind not in _FORWARD:
        gen = model_inputs.make_gen_model_input_fn(attention=kind)

        @nnx.jit  # compiled once per attention kind, not an eager dispatch per op
        def forward(m: Any, fields: dict[str, Any]) -> Any:
            x = gen(fields)
            return m(x["input_tokens"], x["positions"], None, x["attention_mask"])[0]

        _FORWARD[kind] = forward
    return np.asarray(_FORWARD[kind](model, model_inputs.device_fields(batch)))


def _rewrite(src: str, dst: str, *, rank: int | None = None, **meta: str) -> str:
    """A copy of a LoRA file with its metadata changed, and its A/B factors cut to `rank`."""
    import safetensors.numpy
    from safetensors import safe_open

    with safe_open(src, "np") as f:
        metadata = {**f.metadata(), **meta}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if rank is not None:
        metadata["lora_rank"] = str(rank)
        tensors = {k: v[..., :rank] if k.endswith("_lora_a") else v[:rank] for k, v in tensors.items()}
    safetensors.numpy.save_file(tensors, dst, metadata=metadata)
    return dst


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_save_lora_round_trip_and_refusals(straight, shard_sets, tmp_path) -> None:
    import loaders
    from train.model import models

    path = straight["cfg"].save_lora
    meta = lora_file.read_lora_metadata(path)
    assert meta["model"] == MODEL and meta["lora_rank"] == str(RANK) and json.loads(meta["lora_alpha"]) == 2.0 * RANK
    assert meta["step"] == str(STEPS) and meta["base_fingerprint"] == straight["setup"].base_weights["fingerprint"]
    assert meta["base_weights"] == "random" and meta["dtype"] == "float32"

    # A freshly built model with the same LoRA, as a user would build it from the metadata.
    built = models.build_model(meta["model"], vocab_size=int(meta["vocab_size"]), seed=int(meta["seed"]))
    model = models.apply_lora(built.model, built.spec, rank=int(meta["lora_rank"]), alpha=float(meta["lora_alpha"]))

    # Refusals first (they change nothing): another rank, other base weights, another model, not ours.
    with pytest.raises(LoraFileError, match="LoRA rank 2 in the file, but the model's LoRA has rank 4"):
        lora_file.load_lora(model, _rewrite(path, str(tmp_path / "r2.safetensors"), rank=2))
    with pytest.raises(LoraFileError, match=r"trained on other base weights \('random', fingerprint 0123\) than this model's"):
        lora_file.load_lora(model, _rewrite(path, str(tmp_path / "fp.safetensors"), base_fingerprint="0123"))
    with pytest.raises(LoraFileError, match="model is 'tiny-qwen3' in the file, expected 'tiny'"):
        lora_file.load_lora(model, path, expected={"model": "tiny"})
    with pytest.raises(LoraFileError, match="not a prepack LoRA export"):
        lora_file.load_lora(model, _rewrite(path, str(tmp_path / "x.safetensors"), format="other"))
    with pytest.raises(LoraFileError, match="no LoRA file at"):
        lora_file.load_lora(model, str(tmp_path / "missing.safetensors"))
    # The fingerprint does tell base weights apart (another seed draws other weights).
    other_seed = models.build_model(MODEL, vocab_size=VOCAB, seed=1).model
    assert fingerprint.base_fingerprint(other_seed) != meta["base_fingerprint"] == fingerprint.base_fingerprint(model)

    batch = next(iter(loaders.make_dataset(shard_sets["main"], 4, seed=3, shard_index=0, shard_count=1)))
    trained = _logits(straight["setup"].built.model, batch, straight["cfg"])
    before = _logits(model, batch)
    assert float(np.max(np.abs(before - trained))) > 1e-2  # the adapters change the outputs
    assert lora_file.load_lora(model, path, expected={"model": MODEL, "lora_alpha": 2.0 * RANK})["step"] == str(STEPS)
    after = _logits(model, batch)
    print(f"\nmax |logits loaded - trained| = {float(np.max(np.abs(after - trained))):.3g} "
          f"(before loading {float(np.max(np.abs(before - trained))):.3g})")
    np.testing.assert_allclose(after, trained, rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_a_late_export_failure_keeps_the_trained_adapter(straight, tmp_path, capsys) -> None:
    """The trained run's own export (no training here): --save-lora fails after training (a folder
    appeared at its path since the check before step 1), the adapter goes beside it, whole, and
    the line says where (issue 46)."""
    import dataclasses

    from train.run_config import outputs

    target = str(tmp_path / "lora.safetensors")
    os.makedirs(os.path.join(target, "someone-elses"))
    s = dataclasses.replace(straight["setup"], config=dataclasses.replace(straight["cfg"], save_lora=target, checkpoint_dir=None))
    extra = dict(s.recorder.static_extra)
    try:
        with pytest.raises(outputs.ExportFailed) as e:
            trainer.export_adapter(s, sys.stderr)
        assert s.recorder.static_extra["lora_export"]["failed"] == str(e.value)
    finally:
        s.recorder.static_extra.clear()
        s.recorder.static_extra.update(extra)
    recovered = f"{target}.recovered"
    assert str(e.value).startswith(f"--save-lora {target}: the export failed after training (")
    assert str(e.value).endswith(f"; the trained adapter was saved to {recovered} instead")
    assert f"the trained adapter was saved to {recovered}" in capsys.readouterr().err
    assert lora_file.read_lora_metadata(recovered)["step"] == str(STEPS)
    from safetensors.numpy import load_file

    saved, exported = load_file(recovered), load_file(straight["cfg"].save_lora)
    assert sorted(saved) == sorted(exported) and saved  # the same adapter the run exported
    for name, value in exported.items():
        np.testing.assert_array_equal(saved[name], value)


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_lora_file_and_loader_states_on_gcs(straight, gcs_prefix) -> None:
    """Our own gs:// writes (the LoRA file, run.json, loader states) against the GCS emulator.

    Orbax's half of a gs:// --checkpoint-dir goes through etils.epath, which needs gcsfs (a
    declared dependency); without it the run stops at once (test_gs_checkpoint_dir_without_gcsfs...).
    """
    model = straight["setup"].built.model
    url = f"{gcs_prefix}/run/lora.safetensors"
    meta = lora_file.save_lora(model, url, {"model": MODEL, "base_fingerprint": straight["setup"].base_weights["fingerprint"]})
    assert lora_file.read_lora_metadata(url)["lora_rank"] == meta["lora_rank"] == str(RANK)
    assert lora_file.load_lora(model, url)["model"] == MODEL
    for k, v in _lora(model).items():
        np.testing.assert_array_equal(v, straight["lora"][k])

    ckpt = checkpoints.CheckpointDir(f"{gcs_prefix}/run/ckpt")
    ckpt.write_run({"model": MODEL}, {"source": "random", "fingerprint": "f"}, {"shards": "s"})
    assert ckpt.read_run()["identity"] == {"model": MODEL}
    for step in (2, 4, 6):
        ckpt.save_data_state(step, {"grain": {"next_index": step}}, keep=2)
    assert ckpt.load_data_state(2) is None and ckpt.load_data_state(6) == {"grain": {"next_index": 6}}
    ckpt.require_backend()  # gcsfs is a declared dependency of the train extra: Orbax can reach gs://


# ----------------------------------------------------------------------------- pieces


def test_gs_checkpoint_dir_without_gcsfs_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as on a machine without gcsfs
    with pytest.raises(CheckpointError) as err:
        checkpoints.CheckpointDir("gs://bucket/run/ckpt").require_backend()
    assert str(err.value) == ("--checkpoint-dir gs://bucket/run/ckpt: Orbax needs the gcsfs package for gs:// folders "
                              "(pip install gcsfs), or mount the bucket read-write with gcsfuse and pass the local path")
    monkeypatch.delitem(sys.modules, "gcsfs")
    checkpoints.CheckpointDir("gs://bucket/run/ckpt").require_backend()  # with it: no error


def test_resumable_stream_and_policy(shard_sets) -> None:
    """Placeholders first, then the positioned loader; a fresh stream re-read to step k has the same state."""
    import loaders

    make = lambda: iter(loaders.make_dataset(shard_sets["main"], BATCH, 0, 0, 1, None, read_threads=1))  # noqa: E731
    reread = resume.ResumableStream(make())
    first = [row_ids(next(reread)).tolist() for _ in range(3)]
    state = reread.state_after(3)
    assert reread.consumed == 3 and reread.state_after(2) != state

    it = make()
    it.set_state(state)
    seek = resume.ResumableStream(it, consumed=3, placeholders=3)
    stream = iter(seek)
    items = [next(stream) for _ in range(4)]
    assert items[:3] == [resume.PLACEHOLDER] * 3
    assert row_ids(items[3]).tolist() == row_ids(next(reread)).tolist()
    assert seek.state_after(4) == reread.state_after(4) and first[0] != row_ids(items[3]).tolist()
    with pytest.raises(RuntimeError, match="iterated once"):
        iter(seek)
    with pytest.raises(CheckpointError, match="no loader state recorded after batch 9"):
        seek.state_after(9)

    policy = checkpoints.EveryNStepsAndLast(every=2, last=5)
    assert [s for s in range(1, 8) if policy.wants(s)] == [2, 4, 5, 6]
    assert [s for s in range(1, 6) if checkpoints.EveryNStepsAndLast(None, 5).wants(s)] == [5]


def test_placeholder_reaching_the_step_is_refused() -> None:
    cls = packed_trainer.make_trainer_class()
    with pytest.raises(trainer.TrainError, match="skipped-batch placeholder"):
        cls._prepare_inputs(object.__new__(cls), resume.PLACEHOLDER)


def test_drop_records_after(tmp_path) -> None:
    path = str(tmp_path / "m.jsonl")
    records = [{"eval": {"step": 0}}, {"step": 1, "loss": 1.0}, {"step": 2, "loss": 1.0}, {"eval": {"step": 2}},
               {"step": 3, "loss": 1.0}, {"summary": {"steps": 3}}]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    assert metrics.drop_records_after(path, 2) == 1
    assert _read_jsonl(path) == records[:4] + records[5:]
    assert metrics.drop_records_after(path, 2) == 0
    assert metrics.drop_records_after(str(tmp_path / "none.jsonl"), 2) == 0


def test_relative_checkpoint_dir_is_made_absolute(tmp_path, monkeypatch) -> None:
    """Orbax refuses relative paths; `prepack train --checkpoint-dir ckpt` must still work."""
    monkeypatch.chdir(tmp_path)
    ckpt = checkpoints.CheckpointDir("ckpt/")
    assert ckpt.path == str(tmp_path / "ckpt")
    assert ckpt.tunix_root == str(tmp_path / "ckpt" / "tunix")
    assert checkpoints.CheckpointDir("gs://bucket/run/").path == "gs://bucket/run"


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_resume_refuses_a_checkpoint_with_non_finite_lora_values(straight, shard_sets, tmp_path, capsys, monkeypatch) -> None:
    """A checkpoint is read as any adapter is: a NaN in its LoRA values (written by another tool, or a disk's
    corruption that Orbax reads back) stops the run in one line naming the tensor, before step 1."""
    import jax.numpy as jnp
    from flax import nnx
    from tunix.sft import checkpoint_manager

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(straight["cfg"].checkpoint_dir, ckpt)
    real = checkpoint_manager.CheckpointManager.maybe_restore

    def restore_then_poison(self, model, *args, **kwargs):
        restored = real(self, model, *args, **kwargs)
        name, var = sorted(((".".join(map(str, p)), v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))),
                           key=lambda kv: kv[0])[0]
        var.set_value(jnp.full_like(var.get_value(), jnp.nan))
        return restored

    monkeypatch.setattr(checkpoint_manager.CheckpointManager, "maybe_restore", restore_then_poison)
    rc = cli.main(["--shards", shard_sets["main"], "--model", MODEL, "--lora-rank", str(RANK), "--batch-size", str(BATCH),
                   "--steps", str(STEPS + 2), "--learning-rate", "3e-2", "--checkpoint-dir", ckpt, "--log-every", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert f"--checkpoint-dir {ckpt}: step {STEPS}: tensor " in err and " is non-finite (NaN/Inf in " in err
    assert "use a new --checkpoint-dir" in err


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_resume_refuses_restored_lora_values_whose_scaled_update_overflows(straight, shard_sets, tmp_path, capsys,
                                                                           monkeypatch) -> None:
    """Issue 71: a lora_b of 3e38 is finite, alpha / r = 2 times it is not: refused as an adapter file's
    would be, before step 1 and before --eval-generate evaluates the restored model."""
    import jax.numpy as jnp
    from flax import nnx
    from tunix.sft import checkpoint_manager

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(straight["cfg"].checkpoint_dir, ckpt)
    real = checkpoint_manager.CheckpointManager.maybe_restore
    poisoned = []

    def restore_then_scale_up(self, model, *args, **kwargs):
        restored = real(self, model, *args, **kwargs)
        name, var = sorted(((".".join(map(str, p)), v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
                            if str(p[-1]).endswith("_lora_b")), key=lambda kv: kv[0])[0]
        var.set_value(jnp.full_like(var.get_value(), 3e38))
        poisoned.append(name)
        return restored

    monkeypatch.setattr(checkpoint_manager.CheckpointManager, "maybe_restore", restore_then_scale_up)
    with _watch() as seen:
        rc = cli.main(["--shards", shard_sets["main"], "--model", MODEL, "--lora-rank", str(RANK), "--batch-size", str(BATCH),
                       "--steps", str(STEPS + 2), "--learning-rate", "3e-2", "--checkpoint-dir", ckpt, "--log-every", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and seen == [] and "Traceback" not in err, err
    assert err.splitlines()[-1] == (f"prepack train: --checkpoint-dir {ckpt}: step {STEPS}: tensor {poisoned[0]} times alpha / r = 2 "
                                    f"overflows float32 (|value| up to 3e+38); " + REMEDY.format(ckpt=ckpt))
