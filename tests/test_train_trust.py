"""The trainer trusts nothing (issue 46): rows checked before the device, option values and outputs
before any weight loads, manifests and metrics files read as a stranger's.

Fast: nothing here trains. The rows a stranger rewrote (and gave a matching sha256 and size) are
refused by the loader's per-batch check, which runs the row rules `prepack verify` judges by
(prepack.format.rowformat.row_fault), naming the shard, the record and the rule; every option value
outside sense is one line before any weight loads; every output is checked before step 1; a late
export failure saves the adapter elsewhere and says where. The checkpoint cases (they need a
trained checkpoint) are in tests/test_train_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

import loaders
from apps import inspect_tokens, preflight, report
from prepack.format import rowformat, shardfile
from prepack.format.manifest import MANIFEST_NAME, Manifest, ManifestError
from prepack.hostile_input.untrusted import MAX_METADATA_FILE_BYTES
from train import cli, data
from train.adapter_files import peft_export
from train.adapter_files.lora_file import LoraFileError
from train.run_config import options, outputs
from train.run_config.config import TrainConfig, TrainError

from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)
from testkit.shard_sets import TEST_TOKENIZER, build_shard_set, synthetic_row

VOCAB = 128
MAX_LENGTH = 32
ROWS = 12
TOKENIZER = {**TEST_TOKENIZER, "name": "trust-test", "vocab_size": VOCAB}
HELP = " (see prepack train --help)"
ALPHA_RULE = "--lora-alpha must be a number above 0 and at most 1,000,000 (the adapter's scale is alpha / rank)"


def _rows(n: int = ROWS, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [synthetic_row(r, MAX_LENGTH, rng, vocab_size=VOCAB) for r in range(n)]


@pytest.fixture(scope="module")
def good_set(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("trust") / "set")
    build_shard_set(path, rows=_rows(), tokenizer=TOKENIZER, num_shards=2)
    return path


def _args(shards: str, *extra: str) -> list[str]:
    return ["--shards", shards, "--model", "tiny-qwen3", "--lora-rank", "4", "--batch-size", "2", "--steps", "1",
            "--log-every", "0", "--remat", "none", *extra]


def _refusal(argv: list[str], capsys) -> str:
    """The one line a refused command prints (exit status 2), and nothing else on stderr."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.rstrip("\n")


# ----------------------------------------------------------------------------- option values


@pytest.mark.parametrize(("flag", "value", "words"), [
    ("--seed", str(10**30), "must be a whole number from 0 to 4,294,967,295, got a number of 31 digits"),
    ("--seed", "-1", "must be a whole number from 0 to 4,294,967,295, got -1"),
    ("--read-threads", "-1", "must be a whole number from 0 to 1,024 (0: read on the training thread), got -1"),
    ("--cpu-devices", "-1", "must be a whole number from 1 to 4,096, got -1"),
    ("--eval-batches", "-1", "must be a whole number from 1 to 2,147,483,647, got -1"),
    ("--eval-every", "0", "must be a whole number from 1 to 2,147,483,647, got 0"),
    ("--eval-every", "-1", "must be a whole number from 1 to 2,147,483,647, got -1"),
    ("--log-every", "-1", "must be a whole number from 0 to 2,147,483,647 (0: fetch at the end only), got -1"),
    ("--steps", "9" * 5000, "must be a whole number from 1 to 2,147,483,647, got a number of 5,000 digits"),
    ("--steps", "2.5", "must be a whole number from 1 to 2,147,483,647, got '2.5'"),
    ("--batch-size", "0", "must be a whole number from 1 to 2,147,483,647, got 0"),
    ("--lora-rank", "-4", "must be a whole number from 1 to 2,147,483,647, got -4"),
    ("--checkpoint-every", "0", "must be a whole number from 1 to 2,147,483,647, got 0"),
])
def test_whole_number_options_out_of_range_are_one_line_never_echoed_whole(flag, value, words, capsys) -> None:
    line = _refusal(["--shards", "unused", flag, value], capsys)
    assert line == f"prepack train: error: argument {flag}: {words}{HELP}"
    assert len(line) < 300


def test_a_library_config_is_held_to_the_same_ranges() -> None:
    for kw, words in [({"seed": -1}, "--seed must be a whole number from 0 to 4,294,967,295, got -1"),
                      ({"steps": 2.0}, "--steps must be a whole number from 1 to 2,147,483,647, got 2.0"),
                      ({"eval_every": 0}, "--eval-every must be a whole number from 1 to 2,147,483,647, got 0"),
                      ({"read_threads": -1}, "--read-threads must be a whole number from 0 to 1,024 (0: read on the "
                                             "training thread), got -1")]:
        with pytest.raises(TrainError) as e:
            options.check_counts(TrainConfig(shards="x", **kw))
        assert str(e.value) == words
    options.check_counts(TrainConfig(shards="x", seed=options.MAX_SEED, read_threads=0, log_every=0))


def test_real_options_hold_in_float32_and_any_finite_budget_is_a_budget() -> None:
    """Issue 71: the float32 range of the reals the step computes with, on a library caller's TrainConfig
    too; --memory-budget-gib takes every finite positive budget (the plan then says whether it fits)."""
    from train import memory_plan
    from train.step import memory_path

    for kw, words in [({"beta": 1e300}, "--beta 1e+300 is inf in float32"), ({"max_grad_norm": 1e39}, "--max-grad-norm 1e+39 is inf"),
                      ({"lora_alpha": 10**400}, f"{ALPHA_RULE}, got <an integer of about 400 digits>"), ({"lora_alpha": True}, f"{ALPHA_RULE}, got True")]:
        with pytest.raises(TrainError) as e:
            options.check_reals(TrainConfig(shards="x", **kw))
        assert str(e.value).startswith(words)
    options.check_reals(TrainConfig(shards="x", lora_alpha=1e6, max_grad_norm=0.0, beta=0.1))
    for budget in (0.01, 1e-9, 64.0, 1e300):
        memory_path.check_options(TrainConfig(shards="x", memory_budget_gib=budget), 32)
        assert memory_plan.budget_bytes(budget)[1] == "--memory-budget-gib"
    assert memory_plan.budget_bytes(0.01)[0] == int(0.01 * memory_plan.GIB) and memory_plan.budget_bytes(1e300)[0] > 10**308


@pytest.mark.parametrize(("extra", "words"), [
    (["--lora-alpha", "nan"], f"{ALPHA_RULE}, got nan"),
    (["--lora-alpha", "inf"], f"{ALPHA_RULE}, got inf"),
    (["--lora-alpha", "-1"], f"{ALPHA_RULE}, got -1.0"),
    (["--lora-alpha", "1e300"], f"{ALPHA_RULE}, got 1e+300"),  # finite to Python, inf as the scale in float32
    (["--learning-rate", "nan"], "--learning-rate must be a positive number, got nan"),
    (["--learning-rate", "inf"], "--learning-rate must be a positive number, got inf"),
    (["--learning-rate", "-1"], "--learning-rate must be a positive number, got -1.0"),
    # Issue 71: 1e300 became inf in the optimizer, and every LoRA value with it; 1e-50 became 0.
    (["--learning-rate", "1e300"], "--learning-rate 1e+300 is inf in float32, the dtype the step computes in; give at most 3.4e+38"),
    (["--learning-rate", "1e-50"], "--learning-rate 1e-50 is 0 in float32, the dtype the step computes in; give at least 1.18e-38"),
    (["--max-grad-norm", "1e300"], "--max-grad-norm 1e+300 is inf in float32, the dtype the step computes in; give at most 3.4e+38"),
    (["--memory-budget-gib", "inf"], "--memory-budget-gib must be a finite number of GiB above 0, got inf"),
    (["--memory-budget-gib", "nan"], "--memory-budget-gib must be a finite number of GiB above 0, got nan"),
    (["--memory-budget-gib", "-1"], "--memory-budget-gib must be a finite number of GiB above 0, got -1.0"),
    (["--memory-budget-gib", "0"], "--memory-budget-gib must be a finite number of GiB above 0, got 0.0"),
    (["--mesh", "fsdp=1,fsdp=2"], "--mesh 'fsdp=1,fsdp=2': fsdp is given twice; give each axis once, e.g. fsdp=2,tp=1"),
    (["--lora-rank", "100000"], "--lora-rank 100,000 is more than tiny-qwen3's hidden width 64: a LoRA update of a "
                                "64-wide projection has rank 64 at most; use --lora-rank 64 or less"),
    (["--batch-size", "20"], "--batch-size 20 rows per step is more than the 12 rows of --shards {set}: each step would "
                             "train 8 of them twice or more; use at most 12 rows per step"),
    (["--batch-size", "4", "--grad-accum-steps", "4"], "--batch-size 4 x --grad-accum-steps 4 = 16 rows per step is more "
                                                       "than the 12 rows of --shards {set}: each step would train 4 of "
                                                       "them twice or more; use at most 12 rows per step"),
    (["--batch-size", str(10**9)], "--batch-size 1,000,000,000 rows per step is more than the 12 rows of --shards {set}: "
                                   "each step would train 12 of them twice or more; use at most 12 rows per step"),
])
def test_values_outside_sense_are_refused_before_any_weight_loads(good_set, extra, words, capsys) -> None:
    argv = _args(good_set, *extra)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "loading" not in err  # no weight was loaded or drawn
    assert err == f"prepack train: {words.format(set=good_set)}\n"


def test_a_batch_the_host_cannot_hold_is_refused(good_set, monkeypatch, capsys) -> None:
    monkeypatch.setattr(data, "host_memory_bytes", lambda: 100_000)  # a machine of 100 kB
    assert cli.main(_args(good_set, "--batch-size", "12")) == 2
    # 12 rows x 32 tokens x 5 fields x 4 bytes = 7,680 bytes a batch; the loader holds 34 of them.
    assert capsys.readouterr().err == (
        "prepack train: --batch-size 12 at max_length 32: this host's loader holds up to 34 batches of 7.5 KiB each "
        "(255.0 KiB), more than its 97.7 KiB of memory; lower --batch-size\n")
    monkeypatch.setattr(data, "host_memory_bytes", lambda: 34 * 7680)  # exactly enough
    data.check_batch(TrainConfig(shards=good_set, batch_size=12), loaders.open_shards(good_set))


def test_an_eval_set_smaller_than_one_batch_is_refused_before_weights(good_set, tmp_path, capsys) -> None:
    small = str(tmp_path / "small")
    build_shard_set(small, rows=_rows(3), tokenizer=TOKENIZER, num_shards=1)
    assert cli.main(_args(good_set, "--batch-size", "4", "--eval-shards", small)) == 2
    assert capsys.readouterr().err == (f"prepack train: --eval-shards {small} holds 3 rows, fewer than one batch of "
                                       "--batch-size 4: eval would have no batch; give a larger eval set or a smaller --batch-size\n")


# ----------------------------------------------------------------------------- outputs before step 1


def _check(tmp_path, **kw) -> str | None:
    try:
        outputs.check_outputs(TrainConfig(shards="s", steps=5, **{k: v.format(tmp=tmp_path) if isinstance(v, str) else v
                                                                   for k, v in kw.items()}))
    except TrainError as e:
        return str(e).replace(str(tmp_path), "{tmp}")
    return None


def test_every_output_is_checked_before_step_1(tmp_path) -> None:
    (tmp_path / "m.jsonl").write_text("{}\n")
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    assert _check(tmp_path, metrics_out="{tmp}/m.jsonl") == (
        "--metrics-out {tmp}/m.jsonl already exists (no checkpoint in --checkpoint-dir resumes into it); pass --overwrite "
        "to replace it, or give another path")
    assert _check(tmp_path, metrics_out="{tmp}/m.jsonl", overwrite=True) is None
    assert _check(tmp_path, metrics_out="{tmp}/adir") == "--metrics-out {tmp}/adir is a folder; give a file path"
    assert _check(tmp_path, metrics_out="gs:///m.jsonl") == "--metrics-out 'gs:///m.jsonl' names no bucket: write gs://BUCKET/FOLDER"
    assert _check(tmp_path, metrics_out="s3://b/m.jsonl") == ("--metrics-out 's3://b/m.jsonl': only local paths and gs:// "
                                                              "are supported, not s3://")
    assert _check(tmp_path, checkpoint_dir="{tmp}/afile") == "--checkpoint-dir {tmp}/afile is a file; give a folder"
    assert _check(tmp_path, checkpoint_dir="gs:///x") == "--checkpoint-dir 'gs:///x' names no bucket: write gs://BUCKET/FOLDER"
    assert _check(tmp_path, save_lora="{tmp}/afile/deeper/adapter") == (
        "--save-lora {tmp}/afile/deeper/adapter: {tmp}/afile is a file, so no folder can be made there; give another path")
    assert _check(tmp_path, tensorboard="gs:///tb") == "--tensorboard 'gs:///tb' names no bucket: write gs://BUCKET/FOLDER"
    assert _check(tmp_path, metrics_out="{tmp}/same", save_lora="{tmp}/same", lora_format="prepack") == (
        "--metrics-out {tmp}/same is --save-lora {tmp}/same; one output's writer could replace the other's files: give each "
        "output its own path, neither inside the other")
    # A new path in a new folder is fine, and nothing is created by the check.
    assert _check(tmp_path, metrics_out="{tmp}/new/m.jsonl", save_lora="{tmp}/new/adapter", checkpoint_dir="{tmp}/new/ck",
                  tensorboard="{tmp}/new/tb", profile_steps="1:2") is None
    assert sorted(os.listdir(tmp_path)) == ["adir", "afile", "m.jsonl"]


def test_a_resumed_run_appends_to_its_metrics_without_overwrite(tmp_path) -> None:
    (tmp_path / "m.jsonl").write_text("{}\n")
    cfg = TrainConfig(shards="s", metrics_out=str(tmp_path / "m.jsonl"), checkpoint_dir=str(tmp_path / "ck"))
    asked = []
    outputs.check_outputs(cfg, resumes=lambda: asked.append(1) or True)
    assert asked == [1]
    with pytest.raises(TrainError, match="already exists .no checkpoint in --checkpoint-dir resumes into it."):
        outputs.check_outputs(cfg, resumes=lambda: False)


def test_an_unwritable_folder_is_refused_before_step_1(tmp_path, monkeypatch) -> None:
    """The probe is an unnamed temporary file in the folder (os.access says yes to root on a
    read-only mount); here the filesystem refuses it as a read-only one would."""
    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(outputs.tempfile, "TemporaryFile", read_only)
    assert _check(tmp_path, save_lora="{tmp}/out/adapter") == (
        "--save-lora {tmp}/out/adapter: cannot write in {tmp} (Read-only file system); give a writable path")


@pytest.mark.slow  # starts the GCS emulator (a subprocess)
def test_gcs_outputs_are_probed_and_an_existing_adapter_is_refused(gcs_emulator, gcs_prefix) -> None:  # noqa: F811
    from prepack import storage

    adapter = f"{gcs_prefix}/adapter"
    outputs.check_outputs(TrainConfig(shards="s", save_lora=adapter, checkpoint_dir=f"{gcs_prefix}/ck"))
    assert gcs_emulator.list(gcs_prefix) == []  # the probe is gone
    storage.write_text(f"{adapter}/adapter_config.json", "{}")
    with pytest.raises(TrainError) as e:
        outputs.check_outputs(TrainConfig(shards="s", save_lora=adapter))
    assert str(e.value) == f"--save-lora {adapter} already exists; pass --overwrite to replace it, or give another path"
    outputs.check_outputs(TrainConfig(shards="s", save_lora=adapter, overwrite=True))
    with pytest.raises(TrainError) as e:
        outputs.check_outputs(TrainConfig(shards="s", checkpoint_dir="gs://no-such-bucket-46/ck"))
    assert str(e.value).startswith("--checkpoint-dir gs://no-such-bucket-46/ck: cannot write there (NotFound: ")


def test_a_late_export_failure_saves_the_adapter_beside_it_and_says_where(tmp_path, capsys) -> None:
    written: list[str] = []

    def export(path: str, overwrite: bool) -> None:
        if path == cfg.save_lora:
            raise OSError(28, "No space left on device")
        written.append(path)

    cfg = TrainConfig(shards="s", save_lora=str(tmp_path / "adapter"))
    (tmp_path / "adapter.recovered").mkdir()  # an earlier recovery is never replaced
    with pytest.raises(outputs.ExportFailed) as e:
        outputs.export_or_recover(cfg, export, say=None)
    assert written == [str(tmp_path / "adapter.recovered-2")]
    assert str(e.value) == (f"--save-lora {tmp_path}/adapter: the export failed after training (OSError: [Errno 28] No "
                            f"space left on device); the trained adapter was saved to {tmp_path}/adapter.recovered-2 instead")

    # With --checkpoint-dir it goes there, in the format asked for.
    cfg = TrainConfig(shards="s", save_lora=str(tmp_path / "a.safetensors"), lora_format="prepack",
                      checkpoint_dir=str(tmp_path / "ck"))
    written.clear()
    with pytest.raises(outputs.ExportFailed, match=f"saved to {tmp_path}/ck/recovered-lora.safetensors instead$"):
        outputs.export_or_recover(cfg, export, say=None)
    assert written == [f"{tmp_path}/ck/recovered-lora.safetensors"]

    def nowhere(path: str, overwrite: bool) -> None:
        raise OSError(5, "Input/output error")

    with pytest.raises(outputs.ExportFailed) as e:
        outputs.export_or_recover(cfg, nowhere, say=None)
    assert str(e.value).endswith(f"; the last checkpoint in --checkpoint-dir {tmp_path}/ck holds the trained adapter: "
                                 "rerun the same command to export it")


def test_save_lora_says_where_the_adapter_went(tmp_path, monkeypatch) -> None:
    import io
    from types import SimpleNamespace

    from train import trainer

    written: list[str] = []
    monkeypatch.setattr(trainer, "export_lora", lambda s, path, overwrite, *step: written.append(path))
    for fmt, reader in (("peft", "a PEFT folder: prepack generate --lora, prepack export --merge, peft"),
                        ("prepack", "a prepack LoRA file: prepack generate --lora, prepack export --merge")):
        cfg = TrainConfig(shards="s", save_lora=str(tmp_path / fmt), lora_format=fmt, lora_rank=8)
        s = SimpleNamespace(config=cfg, trainer=SimpleNamespace(train_steps=1200), recorder=SimpleNamespace(static_extra={}))
        say = io.StringIO()
        trainer.export_adapter(s, say)
        assert say.getvalue() == f"saved the adapter (step 1,200, rank 8) to {tmp_path / fmt} ({reader})\n"
    assert written == [str(tmp_path / "peft"), str(tmp_path / "prepack")]


def test_prepack_train_exits_1_with_the_recovery_line(good_set, monkeypatch, capsys) -> None:
    from train import trainer

    def late_failure(cfg, out=None):
        raise outputs.ExportFailed("--save-lora A: the export failed after training (x); the trained adapter was saved to "
                                   "A.recovered instead")

    monkeypatch.setattr(trainer, "run", late_failure)
    assert cli.main(_args(good_set)) == 1
    assert capsys.readouterr().err == ("prepack train: --save-lora A: the export failed after training (x); the trained "
                                       "adapter was saved to A.recovered instead\n")


def test_a_failed_folder_export_leaves_no_temporary_folder(tmp_path, monkeypatch) -> None:
    def fail(*args):
        raise OSError(28, "No space left on device")

    from prepack.storage import own_files

    monkeypatch.setattr(own_files.os, "replace", fail)
    with pytest.raises(OSError):
        peft_export.write_folder(str(tmp_path / "adapter"), {peft_export.ADAPTER_CONFIG: b"{}"}, overwrite=False)
    assert os.listdir(tmp_path) == []
    with pytest.raises(LoraFileError, match="a.json, which this command does not know as its own; nothing was replaced"):
        peft_export.write_folder(str(tmp_path / "adapter"), {"a.json": b"{}"}, overwrite=False)
    assert os.listdir(tmp_path) == []
    # A one-file write (--lora-format prepack, run records) through its temporary name too.
    from prepack.storage.local import LocalStorage

    monkeypatch.setattr("prepack.storage.local.os.replace", fail)
    with pytest.raises(OSError):
        LocalStorage().replace(str(tmp_path / "a.safetensors"), b"x")
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- rows, before the device


def _rewritten(tmp_path, name: str, change) -> tuple[str, int]:
    """A set whose row 5 (in its first shard) a stranger rewrote, updating that shard's sha256 and
    size in the manifest, as the tester did; nothing else of the manifest changes."""
    rows = [{k: np.array(v) for k, v in r.items()} for r in _rows()]
    path = str(tmp_path / name)
    build_shard_set(path, rows=rows, tokenizer=TOKENIZER, num_shards=2)
    change(rows[5])
    shard = shardfile.shard_name(0, 2)
    info = shardfile.write_shard(f"{path}/{shard}", [rowformat.encode_row(r, MAX_LENGTH) for r in rows[:6]])
    manifest = json.loads(open(f"{path}/{MANIFEST_NAME}").read())
    manifest["shards"][0].update(num_bytes=info.num_bytes, sha256=info.sha256)
    with open(f"{path}/{MANIFEST_NAME}", "w") as f:
        json.dump(manifest, f)
    return path, 5


def _set_loss(value):
    def change(row):
        row["loss_mask"][np.flatnonzero(row["loss_mask"])[:2]] = value
    return change


def _positions(row):
    row["positions"][row["valid_mask"] == 1] += 10**9


def _segments_over_padding(row):
    row["segment_ids"][row["valid_mask"] == 0] = row["segment_ids"].max()


def _id(value):
    def change(row):
        row["input_ids"][3] = value
    return change


@pytest.mark.parametrize(("change", "where"), [
    (_set_loss(7), "segment {st}, token {t}: loss_mask and valid_mask must be 0/1 (there: loss_mask 7, valid_mask 1)"),
    (_set_loss(-100), "segment {st}, token {t}: loss_mask and valid_mask must be 0/1 (there: loss_mask -100, valid_mask 1)"),
    (_positions, "segment 1, token 0: positions must count from 0 at every segment start, up by one (there: positions "
                 "1000000000)"),
    (_segments_over_padding, "padding, token {pad}: valid_mask must be 1 exactly where segment_ids != 0 (there: valid_mask 0, "
                             "segment_ids {seg})"),
    (_id(-5), "segment {s3}, token 3: input_ids must lie in the vocabulary (0 to vocab_size - 1) on every real token "
              "(there: input_ids -5)"),
    (_id(VOCAB), "segment {s3}, token 3: input_ids must lie in the vocabulary (0 to vocab_size - 1) on every real token "
                 f"(there: input_ids {VOCAB})"),
])
def test_a_rewritten_row_is_refused_naming_shard_record_and_rule(tmp_path, change, where) -> None:
    path, row = _rewritten(tmp_path, "bad", change)
    view = loaders.open_shards(path)
    stored = view.read([row], check=False)
    ds = loaders.make_dataset(view, batch_size=ROWS, seed=0, shard_index=0, shard_count=1, num_epochs=1, read_threads=1)
    with pytest.raises(loaders.ShardSetError) as e:
        next(iter(ds))
    segments = stored["segment_ids"][0]
    t = int(np.flatnonzero(stored["loss_mask"][0])[0])
    facts = {"t": t, "st": int(segments[t]), "s3": int(segments[3]), "seg": int(segments.max()),
             "pad": int(np.flatnonzero(stored["valid_mask"][0] == 0)[0])}
    shard = f"{path}/rows-00000-of-00002.array_record"
    assert str(e.value) == (f"{shard}: record {row} (row {row} of shard set {path}): {where.format(**facts)}; "
                            "the shard was edited or is not what its manifest describes: check the set with prepack "
                            "verify, and republish it")


def test_a_manifest_field_order_that_swaps_ids_and_mask_is_refused(tmp_path) -> None:
    path = str(tmp_path / "swapped")
    build_shard_set(path, rows=_rows(), tokenizer=TOKENIZER, num_shards=1)
    manifest = json.loads(open(f"{path}/{MANIFEST_NAME}").read())
    order = manifest["field_order"]
    i, m = order.index("input_ids"), order.index("loss_mask")
    order[i], order[m] = order[m], order[i]
    with open(f"{path}/{MANIFEST_NAME}", "w") as f:
        json.dump(manifest, f)
    with pytest.raises(loaders.ShardSetError, match=r"record \d+ .*: loss_mask and valid_mask must be 0/1 \(there: loss_mask"):
        next(iter(loaders.make_dataset(path, 4, seed=0, shard_index=0, shard_count=1)))


def _pair_segments() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Two preference pairs: each side the same 3-token prompt, then its own reply."""
    ids, masks = [], []
    for reply in ([8, 9], [10, 11, 12], [20, 21, 22], [23]):
        ids.append(np.array([5, 6, 7] + reply, np.int32))
        masks.append(np.array([0, 0, 0] + [1] * len(reply), np.int32))
    return ids, masks


def _write_version(folder: str, sources: bool, example_targets: bool, pairs: bool, corrupt: str | None = None) -> str:
    """A valid two-row set of the row format these fields make (1 to 6), written as the job writes it."""
    ids, masks = _pair_segments()
    seg_counts = np.array([2, 2])
    lens = np.array([len(x) for x in ids])
    src = np.array([1, 1, 2, 2]) if sources else None
    targets = np.zeros(4, np.int64) if example_targets else None
    sides = np.array([rowformat.CHOSEN, rowformat.REJECTED] * 2) if pairs else None
    encoded = list(rowformat.encode_rows_flat(seg_counts, lens, np.concatenate(ids), np.concatenate(masks), MAX_LENGTH,
                                              sources=src, example_targets=targets, pair_sides=sides))
    version = rowformat.row_format_version(sources, example_targets, pairs)
    records = [record for record, _, _ in encoded]
    if corrupt is not None:
        names = rowformat.field_names(version)
        matrix = np.frombuffer(records[1], "<i4").reshape(len(names), MAX_LENGTH).copy()
        matrix[names.index(corrupt)][1] += 1  # the second token of row 1
        records[1] = matrix.tobytes()
    os.makedirs(folder, exist_ok=True)
    info = shardfile.write_shard(os.path.join(folder, shardfile.shard_name(0, 1)), records)
    tokens = int(sum(t for _, t, _ in encoded))
    examples = 2 if pairs else 4
    mixture = None
    if sources:  # source a holds row 0's two segments (one pair), b row 1's
        per = [(examples // 2, int(lens[:2].sum())), (examples // 2, int(lens[2:].sum()))]
        mixture = {"sources": [{"name": n, "examples_written": e, "tokens": t} for n, (e, t) in zip(("a", "b"), per)]}
    manifest = Manifest(max_length=MAX_LENGTH, num_rows=2, shards=[info], tokenizer=dict(TOKENIZER),
                        stats={"examples_written": examples, "tokens": tokens}, mixture=mixture)
    manifest.use_row_format(sources, example_targets, pairs)
    with open(os.path.join(folder, MANIFEST_NAME), "w") as f:
        f.write(manifest.to_json())
    return folder


@pytest.mark.parametrize(("sources", "example_targets", "pairs"), [
    (False, False, False), (True, False, False), (False, True, False), (True, True, False), (False, False, True),
    (True, False, True)])
def test_every_row_format_version_passes_the_per_batch_check(tmp_path, sources, example_targets, pairs) -> None:
    path = _write_version(str(tmp_path / "set"), sources, example_targets, pairs)
    view = loaders.open_shards(path)
    assert view.manifest.format_version == rowformat.row_format_version(sources, example_targets, pairs)
    batch = next(iter(loaders.make_dataset(view, 2, seed=0, shard_index=0, shard_count=1)))
    assert batch["input_ids"].shape == (2, MAX_LENGTH)
    if pairs:  # and a pair row broken in its pair rules is refused by the same check
        broken = _write_version(str(tmp_path / "broken"), sources, example_targets, pairs, corrupt=rowformat.PAIR_SIDE)
        with pytest.raises(loaders.ShardSetError, match=re.escape(f"segment 1, token 1: {rowformat.RULE_PAIR_SIDE} (there: "
                                                                   "pair_side 2)")):
            loaders.open_shards(broken).read([0, 1])


# ----------------------------------------------------------------------------- manifests


@pytest.mark.parametrize(("edit", "words"), [
    (lambda m: m["tokenizer"].update(vocab_size="128"),
     "tokenizer.vocab_size is '128', not a vocabulary size (an integer from 2 to 16,777,216)"),
    (lambda m: m["tokenizer"].update(vocab_size=128.0),
     "tokenizer.vocab_size is 128.0, not a vocabulary size (an integer from 2 to 16,777,216)"),
    (lambda m: m["tokenizer"].update(vocab_size="lots"),
     "tokenizer.vocab_size is 'lots', not a vocabulary size (an integer from 2 to 16,777,216)"),
    (lambda m: m["tokenizer"].update(vocab_size=10**9),
     "tokenizer.vocab_size is 1000000000, not a vocabulary size (an integer from 2 to 16,777,216)"),
    (lambda m: m["tokenizer"].update(pad_id="0"), "tokenizer.pad_id is '0', outside the vocabulary (0 to 127)"),
    (lambda m: m["stats"].update(tokens="262144"), "stats.tokens '262144' is not an integer from 0 to 9,223,372,036,854,775,807"),
    (lambda m: m["stats"].update(examples_written=262144.0),
     "stats.examples_written 262144.0 is not an integer from 0 to 9,223,372,036,854,775,807"),
])
def test_counts_that_are_no_integers_are_refused_by_the_loader_and_train(good_set, tmp_path, edit, words, capsys) -> None:
    path = str(tmp_path / "edited")
    shutil.copytree(good_set, path)
    manifest = json.loads(open(f"{path}/{MANIFEST_NAME}").read())
    edit(manifest)
    with open(f"{path}/{MANIFEST_NAME}", "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ManifestError) as e:
        loaders.open_shards(path)
    assert str(e.value).startswith(f"{path}/{MANIFEST_NAME}: {words}")
    assert cli.main(_args(path)) == 2
    assert capsys.readouterr().err == f"prepack train: {e.value}\n"


def test_a_manifest_over_the_size_cap_is_one_line_in_train(good_set, tmp_path, capsys) -> None:
    path = str(tmp_path / "huge")
    shutil.copytree(good_set, path)
    manifest = f"{path}/{MANIFEST_NAME}"
    text = open(manifest, "rb").read()
    with open(manifest, "wb") as f:
        f.write(text + b" " * (MAX_METADATA_FILE_BYTES + 1 - len(text)))
    assert cli.main(_args(path)) == 2
    assert capsys.readouterr().err.startswith(f"prepack train: {manifest}: larger than 16,777,216 bytes")


def test_a_shard_that_links_outside_its_folder_is_refused(good_set, tmp_path) -> None:
    path = str(tmp_path / "linked")
    shutil.copytree(good_set, path)
    name = "rows-00001-of-00002.array_record"
    outside = str(tmp_path / "elsewhere.array_record")
    os.replace(f"{path}/{name}", outside)
    os.symlink(outside, f"{path}/{name}")
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(path)
    assert str(e.value) == (f"{path}/{name}: a symbolic link to {outside}, outside the set's folder {os.path.realpath(path)}: "
                            "a shard must be a file in its set's folder; copy the file there, or republish the set")
    # A link inside the folder is the folder's own file.
    os.replace(outside, f"{path}/kept.array_record")
    os.remove(f"{path}/{name}")
    os.symlink("kept.array_record", f"{path}/{name}")
    assert len(loaders.open_shards(path)) == ROWS


def test_shards_given_a_file_is_one_line(tmp_path, capsys) -> None:
    data_file = tmp_path / "a.jsonl"
    data_file.write_text("{}\n")
    assert cli.main(["--shards", str(data_file)]) == 2
    assert capsys.readouterr().err == (f"prepack train: --shards {data_file} is a file, not a folder: name the set's folder "
                                       "or the --output of `prepack pack`\n")


@pytest.mark.parametrize(("extra", "words"), [
    (["--shards", "gs:///x"], "--shards 'gs:///x' names no bucket: write gs://BUCKET/FOLDER"),
    (["--checkpoint-dir", "gs:///x"], "--checkpoint-dir 'gs:///x' names no bucket: write gs://BUCKET/FOLDER"),
    (["--checkpoint-dir", "{tmp}/afile"], "--checkpoint-dir {tmp}/afile is a file; give a folder"),
    (["--metrics-out", "{tmp}"], "--metrics-out {tmp} is a folder; give a file path"),
    (["--metrics-out", "gs:///m.jsonl"], "--metrics-out 'gs:///m.jsonl' names no bucket: write gs://BUCKET/FOLDER"),
    (["--save-lora", "gs:///x"], "--save-lora 'gs:///x' names no bucket: write gs://BUCKET/FOLDER"),
    (["--metrics-out", "{tmp}/m.jsonl"], "--metrics-out {tmp}/m.jsonl already exists (no checkpoint in --checkpoint-dir "
                                         "resumes into it); pass --overwrite to replace it, or give another path"),
])
def test_each_bad_output_of_prepack_train_is_one_line_before_anything_runs(good_set, tmp_path, extra, words, capsys) -> None:
    """The command's own refusals (issue 46: each was a traceback, a local ./gs: folder, or 56 s
    of network), before any weight loads and with nothing written."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "m.jsonl").write_text("{}\n")
    before = sorted(os.listdir(tmp_path))
    argv = _args(good_set, *[a.format(tmp=tmp_path) for a in extra])
    if extra[0] == "--shards":
        argv = argv[2:] + extra
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"prepack train: {words.format(tmp=tmp_path)}\n"
    assert sorted(os.listdir(tmp_path)) == before and not os.path.exists("gs:")


# ----------------------------------------------------------------------------- report, preflight, inspect


def _metrics(tmp_path, *lines: str) -> str:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize(("line", "words"), [
    ('{"step": "one", "loss": 1, "step_time_s": 1, "target_tokens": 1}',
     "step is a string 'one', not a step number (a whole number from 0 to 2,147,483,647)"),
    ('{"step": 1e30, "loss": 1, "step_time_s": 1, "target_tokens": 1}',
     "step is a number 1e+30, not a step number (a whole number from 0 to 2,147,483,647)"),
    ('{"step": 1, "loss": [1], "step_time_s": 1, "target_tokens": 1}', "loss is an array [1], not a number"),
    ('{"step": 1, "loss": 1, "step_time_s": "fast", "target_tokens": 1}', "step_time_s is a string 'fast', not a number"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON (RecursionError: maximum recursion depth exceeded while decoding a JSON "
                                    "array from a unicode string)"),
])
def test_report_refuses_a_hostile_metrics_line_naming_it(tmp_path, line, words) -> None:
    path = _metrics(tmp_path, line)
    with pytest.raises(report.ReportError) as e:
        report.load_run(path)
    assert str(e.value) == f"{path}:1: {words}"


def test_report_reads_metrics_lines_with_a_bound(tmp_path, monkeypatch) -> None:
    """A 1 GB file of one line (sparse) is refused after reading the bound, not read whole."""
    path = tmp_path / "sparse.jsonl"
    with open(path, "wb") as f:
        f.truncate(1 << 30)
    asked = []
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def readline(self, limit=-1):
            asked.append(limit)
            return self.f.readline(limit)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr("builtins.open", lambda p, mode="r", *a, **k: Counting(real_open(p, mode, *a, **k))
                        if str(p) == str(path) else real_open(p, mode, *a, **k))
    with pytest.raises(report.ReportError) as e:
        report.load_run(str(path))
    assert str(e.value) == (f"{path}:1: longer than 1,048,576 bytes, not a metrics record of prepack train (it was not "
                            "read further)")
    assert asked == [report.MAX_METRICS_LINE_BYTES + 1]


def test_preflight_shares_packs_bound_on_max_length(tmp_path, capsys) -> None:
    data_file = tmp_path / "in.jsonl"
    data_file.write_text('{"instruction": "a", "output": "b"}\n')
    rc = preflight.main(["--input", str(data_file), "--format", "alpaca", "--max-length", "1000000000", "--no-plots",
                         "--output", str(tmp_path / "pf")])
    assert rc == 2
    assert capsys.readouterr().err == ("prepack preflight: error: --max-length must be at most 1,048,576 (a row is then 20 "
                                       "MiB), got 1,000,000,000\n")


@pytest.fixture(scope="module")
def token_set(tmp_path_factory) -> str:
    from pipelines.launch.job import run
    from pipelines.options import parse_args
    from testkit.pipeline import IN_PROCESS, alpaca_records, write_jsonl

    d = tmp_path_factory.mktemp("tokens")
    src = write_jsonl(str(d / "in.jsonl"), alpaca_records(12, seed=5))
    config, beam_args = parse_args(["--input", src, "--format", "alpaca", "--output", str(d / "out"), "--max-length", "64",
                                    "--no-progress"] + IN_PROCESS)
    run(config, beam_args)
    return str(d / "out" / "tokens")


def test_inspect_on_a_tokenized_set_with_a_truncated_shard_is_one_line(token_set, tmp_path, capsys) -> None:
    path = str(tmp_path / "tokens")
    shutil.copytree(token_set, path)
    shard = next(f for f in sorted(os.listdir(path)) if f.endswith(".array_record"))
    size = os.path.getsize(f"{path}/{shard}")
    os.truncate(f"{path}/{shard}", size // 2)
    assert inspect_tokens.main([path, "--rows", "2", "--ids"]) == 1
    out = capsys.readouterr()
    assert out.err == (f"prepack inspect: {path}/{shard}: {size // 2:,} bytes, but the manifest says {size:,}; the file is "
                       "truncated or was replaced: republish the set\n")


# ----------------------------------------------------------------------------- checkpoint parts, without training


def _fake_checkpoint(root, step: int, next_index, parts=("model_params", "optimizer_state"), worker_count: int = 0) -> str:
    """The layout a checkpoint of `step` has (Tunix's item folders, our loader state), nothing restorable in it."""
    for part in parts:
        os.makedirs(os.path.join(root, "tunix", str(step), part))
    os.makedirs(os.path.join(root, "data"))
    state = {"loader": {"worker_count": worker_count}, "grain": {"next_index": next_index}}
    with open(os.path.join(root, "data", "process_0-of-1.json"), "w") as f:
        json.dump({"format": 1, "states": {str(step): state}}, f)
    return str(root)


def test_a_loader_state_is_held_to_step_times_micro_batches(tmp_path) -> None:
    """With --grad-accum-steps K a step reads K batches: step 4 of K 2 is after 8 of them."""
    from train.checkpointing.checkpoints import CheckpointDir, CheckpointError

    ckpt = CheckpointDir(_fake_checkpoint(tmp_path / "a", 4, next_index=8))
    ckpt.check_complete(4, micro_batches=2)
    with pytest.raises(CheckpointError) as e:
        ckpt.check_complete(4, micro_batches=1)
    assert str(e.value) == (f"{tmp_path}/a/data/process_0-of-1.json: the loader state of step 4 is after 8 batches, but "
                            "step 4 read 4: resuming there would train batches twice or skip them; the checkpoint folder "
                            "was edited or is damaged: use a new --checkpoint-dir")
    with pytest.raises(CheckpointError, match=r"is after 8 batches, but step 4 read 12 \(3 micro-batches a step\)"):
        ckpt.check_complete(4, micro_batches=3)
    # Worker processes keep one state each: no position to hold the step to.
    CheckpointDir(_fake_checkpoint(tmp_path / "w", 4, next_index=99, worker_count=2)).check_complete(4)
    with pytest.raises(CheckpointError, match=r"its position \(grain next_index\) is '8', not a count of batches"):
        CheckpointDir(_fake_checkpoint(tmp_path / "s", 4, next_index="8")).check_complete(4)
    with pytest.raises(CheckpointError, match="step 4 has no optimizer_state"):
        CheckpointDir(_fake_checkpoint(tmp_path / "o", 4, 4, parts=("model_params",))).check_complete(4)
