"""`prepack train` end to end on tiny models: shard set -> loaders.make_dataset -> PeftTrainer -> JSONL.

Plus the cheap parts: mesh parsing, vocabulary checks, batch counts, the summary's arithmetic.
The end-to-end runs are the slow part (a compile each); they share one learnable shard set.
"""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import numpy as np
import pytest

from prepack.format import manifest as manifest_lib, rowformat
from train import cli, families, packed_trainer
from train.measurement import metrics
from train.run_config import mesh, vocab
from train.run_config.config import TrainError

from testkit.shard_sets import TEST_TOKENIZER, build_shard_set, synthetic_row

VOCAB = 64
MAX_LENGTH = 32
REQUIRED = ("step", "loss", "step_time_s", "tokens", "target_tokens", "target_tokens_per_s", "density")
TOKENIZER = {**TEST_TOKENIZER, "name": "tiny-test", "vocab_size": VOCAB}


def _examples(n: int, seed: int) -> list[rowformat.Segment]:
    """Learnable examples: a prompt of 3 tokens, then a fixed continuation pattern per prompt start."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start = int(rng.integers(3, 8))
        length = int(rng.integers(6, 15))
        ids = (start + 3 * np.arange(length)) % (VOCAB - 3) + 3
        mask = np.zeros(length, np.int32)
        mask[3:] = 1
        out.append(rowformat.Segment(ids.astype(np.int32), mask))
    return out


def _packed_rows(examples: list[rowformat.Segment]) -> list[dict[str, np.ndarray]]:
    rows, current, used = [], [], 0
    for ex in examples:  # first fit in order is enough for a fixture
        if used + len(ex) > MAX_LENGTH:
            rows.append(rowformat.build_row(current, MAX_LENGTH))
            current, used = [], 0
        current.append(ex)
        used += len(ex)
    rows.append(rowformat.build_row(current, MAX_LENGTH))
    return rows


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("train_shards")
    examples = _examples(48, seed=0)
    packed = str(root / "packed")
    unpacked = str(root / "unpacked")
    build_shard_set(packed, rows=_packed_rows(examples), tokenizer=TOKENIZER, num_shards=2)
    build_shard_set(unpacked, rows=[rowformat.build_row([ex], MAX_LENGTH) for ex in examples], tokenizer=TOKENIZER, num_shards=2)
    return {"packed": packed, "unpacked": unpacked, "root": str(root)}


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_metrics(lines: list[dict], steps: int, packing: str) -> tuple[list[dict], dict]:
    step_lines = [l for l in lines if "step" in l and "loss" in l]
    assert [l["step"] for l in step_lines] == list(range(1, steps + 1))
    for l in step_lines:
        for key in REQUIRED:
            assert key in l, key
        assert l["packing"] == packing
        # The loss saw exactly the target tokens the host counted.
        assert l["device_target_tokens"] == l["target_tokens"] > 0
        assert l["target_tokens_per_s"] == pytest.approx(l["target_tokens"] / l["step_time_s"])
        assert 0 < l["density"] <= 1 and l["tokens"] == round(l["density"] * l["batch_size"] * l["seq_len"])
    assert "summary" in lines[-1]
    summary = lines[-1]["summary"]
    assert summary["steps"] == steps and summary["timed_steps"] == steps - 1
    assert summary["target_tokens"] == sum(l["target_tokens"] for l in step_lines)
    timed = step_lines[1:]
    assert summary["target_tokens_per_s"] == pytest.approx(
        sum(l["target_tokens"] for l in timed) / sum(l["step_time_s"] for l in timed)
    )
    return step_lines, summary


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_tiny_gemma3_trains_on_packed_shards(shard_sets, tmp_path) -> None:
    metrics = str(tmp_path / "packed.jsonl")
    steps = 8
    rc = cli.main([
        "--shards", shard_sets["packed"], "--model", "tiny",
        "--lora-rank", "4", "--batch-size", "4", "--steps", str(steps), "--learning-rate", "3e-2",
        "--metrics-out", metrics, "--log-every", "0",
    ])
    assert rc == 0
    lines = _read_jsonl(metrics)
    step_lines, summary = _check_metrics(lines, steps, "packed")
    losses = [l["loss"] for l in step_lines]
    print(f"\ntiny-gemma3 packed losses {np.round(losses, 3).tolist()}")
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.1
    assert summary["lora_params"] > 0 and summary["packing"] == "packed" and summary["active_mesh"] is None
    assert summary["mean_density"] > 0.6

    # The report module reads the file as a training run.
    from apps import report

    run = report.load_run(metrics)
    assert len(run.steps) == steps and run.packing == "packed"


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_tiny_qwen3_trains_on_unpacked_shards_with_packed_eval(shard_sets, tmp_path) -> None:
    metrics = str(tmp_path / "unpacked.jsonl")
    steps = 8
    rc = cli.main([
        "--shards", shard_sets["unpacked"], "--eval-shards", shard_sets["packed"], "--model", "tiny-qwen3", "--lora-rank", "4", "--batch-size", "4",
        "--steps", str(steps), "--learning-rate", "3e-2", "--metrics-out", metrics, "--log-every", "0",
    ])
    assert rc == 0
    lines = _read_jsonl(metrics)
    step_lines, summary = _check_metrics(lines, steps, "unpacked")
    losses = [l["loss"] for l in step_lines]
    evals = [l["eval"] for l in lines if "eval" in l]
    print(f"\ntiny-qwen3 unpacked losses {np.round(losses, 3).tolist()}  evals {[round(e['loss'], 3) for e in evals]}")
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.1
    assert [e["step"] for e in evals] == [0, steps]  # before the first step and after the last
    # The same examples, packed: eval on packed rows measures what training on unpacked rows learnt.
    assert evals[1]["loss"] < evals[0]["loss"] - 0.1
    assert evals[0]["target_tokens"] == evals[1]["target_tokens"] > 0
    assert summary["eval_loss"] == evals[1]["loss"]
    assert all(l["examples"] == 4 for l in step_lines)  # one example per row
    assert summary["mean_density"] < 0.45


# `prepack train --cpu-devices 2 --mesh fsdp=2,tp=1` in a fresh interpreter (the fake device count
# must be set before JAX starts: the CLI sets it, so nothing here opens a backend before it runs):
# records how Tunix's own input sharding placed each batch, and the trained model's parameters.
_MESH_PROBE = """
import json, sys
import jax
import numpy as np
from flax import nnx
from tunix.sft import peft_trainer, sharding_utils
from apps import cli
from train import trainer
from train.model import models

seen = []
real_shard_input = sharding_utils.shard_input
def recording_shard_input(data, axis):
    out = real_shard_input(data, axis)
    x = next(leaf for leaf in jax.tree.leaves(out) if getattr(leaf, "ndim", 0) == 2)  # a [B, L] field
    seen.append({"devices": len(x.sharding.device_set), "spec": str(getattr(x.sharding, "spec", None)),
                 "rows_per_device": sorted({s.data.shape[0] for s in x.addressable_shards})})
    return out
peft_trainer.sharding_utils.shard_input = recording_shard_input

def specs(state):
    return sorted({str(leaf.sharding.spec) for leaf in jax.tree.leaves(state) if hasattr(leaf, "sharding") and leaf.ndim == 2})
trained = {}
real_execute = trainer.execute
def recording_execute(cfg, out=None):
    s, summary = real_execute(cfg, out)
    trained.update(params=specs(nnx.state(s.built.model, nnx.Param)), lora=specs(nnx.state(s.built.model, nnx.LoRAParam)))
    return s, summary
trainer.execute = recording_execute

placed = {}
real_shard_model = models.shard_model
def counting_shard_model(model, mesh):
    # What the run's own models.shard_model call placed: parameters split in half over fsdp, whole
    # on both devices, or on one device only; and the split ones whose halves are not equal.
    real_shard_model(model, mesh)
    counts = {"halved": 0, "whole": 0, "single": 0, "uneven": []}
    for leaf in jax.tree.leaves(nnx.state(model)):
        if not hasattr(leaf, "sharding"):
            continue
        if len(leaf.sharding.device_set) < 2:
            counts["single"] += 1
        elif any(s.data.shape != leaf.shape for s in leaf.addressable_shards):
            counts["halved"] += 1
            if sorted(int(np.prod(s.data.shape)) for s in leaf.addressable_shards) != [leaf.size // 2] * 2:
                counts["uneven"].append(list(leaf.shape))
        else:
            counts["whole"] += 1
    placed.update(counts)
models.shard_model = counting_shard_model

rc = cli.main(["train", "--shards", sys.argv[1], "--model", "tiny-qwen3", "--lora-rank", "2", "--batch-size", "4",
               "--steps", "2", "--metrics-out", sys.argv[2], "--log-every", "0", "--cpu-devices", "2", "--mesh", "fsdp=2,tp=1"])
print(json.dumps({"rc": rc, "batches": seen, "placed": placed, **trained}))
"""


@pytest.fixture(scope="module")
def mesh_run(shard_sets, tmp_path_factory) -> dict:
    """One --mesh run on two fake CPU devices (a fresh process: a compile and JAX's start), read by both mesh tests."""
    metrics = str(tmp_path_factory.mktemp("mesh") / "mesh.jsonl")
    done = subprocess.run([sys.executable, "-c", _MESH_PROBE, shard_sets["packed"], metrics],
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          cwd=os.path.dirname(os.path.dirname(__file__)), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert probe["rc"] == 0, done.stderr[-3000:]
    return {"probe": probe, "summary": _read_jsonl(metrics)[-1]["summary"]}


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_mesh_fsdp2_on_two_fake_cpu_devices(mesh_run) -> None:
    """--mesh through `prepack train` (--cpu-devices fakes the devices before JAX starts)."""
    summary = mesh_run["summary"]
    # The mesh was active where Tunix looks for it (legacy `with mesh:`), so batches were sharded over fsdp.
    assert summary["devices"] == 2 and summary["active_mesh"] == {"fsdp": 2, "tp": 1}
    assert np.isfinite(summary["final_loss"])


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_mesh_fsdp2_shards_batches_and_parameters_over_two_devices(mesh_run) -> None:
    """--mesh fsdp=2 on two fake CPU devices: each batch Tunix feeds the step is split over both
    devices by rows, and the base weights are split over fsdp (not only what the summary says)."""
    probe = mesh_run["probe"]
    assert len(probe["batches"]) >= 2
    assert all(b["devices"] == 2 and b["rows_per_device"] == [2] and "fsdp" in b["spec"] for b in probe["batches"])
    assert any("fsdp" in spec for spec in probe["params"])
    assert np.isfinite(mesh_run["summary"]["final_loss"])


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_shard_model_splits_parameters_over_the_fsdp_axis(mesh_run) -> None:
    """On two (fake CPU) devices, shard_model (as the --mesh run calls it) really places parameters:
    some are split in half along the fsdp axis (each device holds half), none is left on one device only."""
    placed = mesh_run["probe"]["placed"]
    assert placed["halved"] > 0 and placed["single"] == 0 and placed["uneven"] == [], placed


# ----------------------------------------------------------------------------- errors


def test_token_ids_beyond_the_manifest_vocab_stop_the_run_naming_shard_row_and_rule(tmp_path, capsys) -> None:
    path = str(tmp_path / "bad_ids")
    # The manifest claims 64 ids, but the rows hold ids up to 50,000: the loader's row check
    # (the rules `prepack verify` judges by) refuses the first batch, before it reaches the device.
    rng = np.random.default_rng(0)
    rows = [synthetic_row(r, MAX_LENGTH, rng, vocab_size=50_000) for r in range(8)]
    build_shard_set(path, rows=rows, tokenizer=TOKENIZER)
    rc = cli.main(["--shards", path, "--model", "tiny-qwen3", "--batch-size", "4", "--steps", "1", "--log-every", "0",
                   "--remat", "none"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "step 1:" not in err  # refused before the batch reached the device
    line = err.splitlines()[-1]
    assert re.fullmatch(rf"prepack train: {re.escape(path)}/rows-0000[01]-of-00002\.array_record: record \d+ \(row \d+ of shard "
                        rf"set {re.escape(path)}\): segment \d+, token \d+: input_ids must lie in the vocabulary \(0 to "
                        r"vocab_size - 1\) on every real token \(there: input_ids \d+\); the shard was edited or is not what "
                        r"its manifest describes: check the set with prepack verify, and republish it", line), line


@pytest.mark.parametrize("bad", [-5, 64, 2**31 - 1])
def test_an_id_outside_the_model_embedding_is_named_as_it_is(bad) -> None:
    """The trainer's own check (batches from anywhere, against the model's embedding) names the
    offending id itself: -5 was reported as 236812."""
    ids = np.full((2, 8), 3, np.int32)
    ids[1, 5] = bad
    with pytest.raises(TrainError) as e:
        packed_trainer.check_token_ids({"input_ids": ids}, 64)
    assert str(e.value) == (f"a batch holds token id {bad}, outside the model's 64-row embedding (ids 0 to 63); "
                            "the shards do not match the model's tokenizer")
    packed_trainer.check_token_ids({"input_ids": np.clip(ids, 0, 63)}, 64)


def test_gemma_vocab_shards_refused_by_qwen3_before_loading_weights(tmp_path, capsys) -> None:
    path = str(tmp_path / "gemma_vocab")
    tok = {**TEST_TOKENIZER, "name": "gemma3", "vocab_size": 262_144}
    build_shard_set(path, num_rows=4, max_length=MAX_LENGTH, tokenizer=tok)
    # --weights names a folder that does not exist: the vocabulary check must come first.
    rc = cli.main(["--shards", path, "--model", "qwen3-0.6b", "--weights", str(tmp_path / "nope"), "--steps", "1",
                   "--batch-size", "4"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "vocab_size 262,144" in err and "151,936 embedding rows" in err


GEMMA3, QWEN3, LLAMA3 = (families.by_name(name) for name in ("gemma3", "qwen3", "llama3"))


def test_check_vocab_rules() -> None:
    gemma, qwen = GEMMA3.vocab_hash, QWEN3.vocab_hash
    vocab.check_vocab({"name": "gemma3", "vocab_size": 262_144, "vocab_hash": gemma}, "gemma3-270m", GEMMA3, 262_144, "s")
    vocab.check_vocab({"name": "hf:Qwen/Qwen3-0.6B", "vocab_size": 151_669, "vocab_hash": qwen}, "qwen3-0.6b", QWEN3, 151_936, "s")
    with pytest.raises(TrainError, match=r"'hf:Qwen/Qwen3-0.6B', whose vocabulary \(vocab_hash 2b126ad4a174...\) is the qwen3 tokenizer's"):
        vocab.check_vocab({"name": "hf:Qwen/Qwen3-0.6B", "vocab_size": 151_669, "vocab_hash": qwen}, "gemma3-270m", GEMMA3, 262_144, "s")
    with pytest.raises(TrainError, match="index past it"):
        vocab.check_vocab({"name": "x", "vocab_size": 300_000}, "gemma3-1b", GEMMA3, 262_144, "s")


def test_a_family_without_a_tokenizer_takes_any_set_that_fits() -> None:
    """Llama3 has no tokenizer here (vocab_hash None): Gemma3's or Qwen3's ids are not refused as another
    family's, only ids past its embedding are."""
    assert LLAMA3.vocab_hash is None
    for hash_ in (GEMMA3.vocab_hash, QWEN3.vocab_hash):
        vocab.check_vocab({"name": "t", "vocab_size": 262_144, "vocab_hash": hash_}, "tiny-llama3", LLAMA3, 262_144, "s")
    with pytest.raises(TrainError, match="index past it"):
        vocab.check_vocab({"name": "t", "vocab_size": 262_144, "vocab_hash": GEMMA3.vocab_hash}, "tiny-llama3", LLAMA3, 1000, "s")


def test_vocab_compatibility_is_judged_by_hash_not_name() -> None:
    qwen = QWEN3.vocab_hash
    # A name that says qwen over another vocabulary is not refused ...
    vocab.check_vocab({"name": "my-qwen-remix", "vocab_size": 1000, "vocab_hash": "0" * 64}, "gemma3-270m", GEMMA3, 262_144, "s")
    # ... and Qwen's vocabulary under any name is.
    with pytest.raises(TrainError, match="'custom', whose vocabulary .* is the qwen3 tokenizer's.*gemma3-270m is a gemma3 model"):
        vocab.check_vocab({"name": "custom", "vocab_size": 151_669, "vocab_hash": qwen}, "gemma3-270m", GEMMA3, 262_144, "s")


def test_family_vocab_hashes_are_the_tokenizers_own() -> None:
    from prepack.text.tokenizer import load_tokenizer

    assert QWEN3.vocab_hash == load_tokenizer("qwen3").identity()["vocab_hash"]
    # Gemma's needs its downloaded vocabulary: tests/test_tokenizer.py pins the same hash.
    assert GEMMA3.vocab_hash == "956ce6ae17ebe03ad27594308e5310f6363616b8b786f47156d524e8f3e0e2f3"


def test_model_without_offline_weights_asks_for_them(shard_sets, capsys) -> None:
    rc = cli.main(["--shards", shard_sets["packed"], "--model", "gemma3-1b", "--steps", "1"])
    # The tiny test vocabulary fits gemma3-1b, so the next complaint is the missing weights.
    assert rc == 2 and "--weights" in capsys.readouterr().err


@pytest.mark.parametrize(
    "spec, sizes",
    [("fsdp=4,tp=2", {"fsdp": 4, "tp": 2}), ("tp=2", {"fsdp": 1, "tp": 2}), (None, None), ("", None)],
)
def test_parse_mesh(spec, sizes) -> None:
    assert mesh.parse_mesh(spec) == sizes


@pytest.mark.parametrize("spec", ["fsdp", "dp=2", "fsdp=0", "fsdp=x"])
def test_parse_mesh_rejects(spec) -> None:
    with pytest.raises(TrainError):
        mesh.parse_mesh(spec)


def test_mesh_size_and_batch_divisibility_are_checked() -> None:
    with pytest.raises(TrainError, match="divisible by fsdp=3"):
        mesh.make_mesh({"fsdp": 3, "tp": 1}, 8)
    with pytest.raises(TrainError, match="needs 8 devices"):
        mesh.make_mesh({"fsdp": 8, "tp": 1}, 8)


def test_batch_counts() -> None:
    segs = [rowformat.Segment(np.arange(3, 8, dtype=np.int32), np.array([0, 0, 1, 1, 1], np.int32)),
            rowformat.Segment(np.arange(3, 6, dtype=np.int32), np.array([0, 1, 1], np.int32))]
    rows = [rowformat.build_row(segs, 10), rowformat.build_row(segs[:1], 10)]
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    counts = metrics.batch_counts(batch)
    assert counts == {"rows": 2, "seq_len": 10, "tokens": 13, "target_tokens": 3 + 2 + 3, "examples": 3}


def test_packing_kind_from_manifest(shard_sets) -> None:
    import loaders

    assert manifest_lib.packing_kind(loaders.open_shards(shard_sets["packed"]).manifest) == "packed"
    assert manifest_lib.packing_kind(loaders.open_shards(shard_sets["unpacked"]).manifest) == "unpacked"
