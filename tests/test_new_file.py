"""No existing file is written in place (prepack/storage/new_file.py): every file output is a new
file renamed over the old one, so an output that is another name of an input (a hard link) leaves
the input's bytes as they were; a resumed run's metrics are appended to only when the file has one
link and is no input; and the metrics JSONL appears only with its first record.

Each command's output is tried as `os.link(INPUT, OUTPUT)` then a run with --overwrite: the
input's sha256 is the same after, and the output is a new file (another inode)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from prepack import storage
from prepack.storage import new_file
from prepack.storage.local import LocalStorage


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _linked(tmp_path, data: bytes = b'{"keep": "these bytes"}\n', name: str = "input.json"):
    """An input file and a second name of it, the output to be written."""
    source = tmp_path / name
    source.write_bytes(data)
    return source


def _assert_new_file(source, output, digest: str) -> None:
    assert _sha(source) == digest, "the input was written through its other name"
    assert os.stat(source).st_nlink == 1 and os.stat(output).st_ino != os.stat(source).st_ino


# ----------------------------------------------------------------------------- the writer


@pytest.mark.parametrize("write", [
    lambda path: new_file.write_bytes(path, b"new"),
    lambda path: storage.write_text(path, "new"),
    lambda path: LocalStorage().replace(path, b"new"),
])
def test_a_hard_linked_output_is_replaced_not_written_through(tmp_path, write):
    source = _linked(tmp_path)
    digest = _sha(source)
    out = tmp_path / "out.json"
    os.link(source, out)
    write(str(out))
    assert out.read_bytes() == b"new"
    _assert_new_file(source, out, digest)
    assert sorted(os.listdir(tmp_path)) == ["input.json", "out.json"]  # no temporary file left


def test_the_temporary_name_is_never_an_existing_file(tmp_path, monkeypatch):
    """A name planted where the temporary file would go (a link to an input) is skipped, not opened."""
    source = _linked(tmp_path)
    digest = _sha(source)
    names = iter(["aaaaaaaa", "bbbbbbbb"])
    monkeypatch.setattr(new_file.secrets, "token_hex", lambda n: next(names))
    planted = tmp_path / f".out.json.tmp-{os.getpid()}-aaaaaaaa"
    os.link(source, planted)
    new_file.write_bytes(str(tmp_path / "out.json"), b"new")
    assert (tmp_path / "out.json").read_bytes() == b"new" and _sha(source) == digest and _sha(planted) == digest


def test_a_failed_write_leaves_the_old_file_and_nothing_beside_it(tmp_path):
    out = tmp_path / "out.json"
    out.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with new_file.new_file(str(out), "w") as f:
            f.write("half")
            raise RuntimeError("disk full")
    assert out.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.json"]


def test_a_new_file_has_a_plain_files_mode(tmp_path):
    old = os.umask(0o022)
    try:
        new_file.write_bytes(str(tmp_path / "out.json"), b"x")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "out.json").st_mode & 0o777 == 0o644


def test_append_problem(tmp_path):
    source = _linked(tmp_path)
    (tmp_path / "set").mkdir()
    inner = tmp_path / "set" / "manifest.json"
    inner.write_text("{}")
    mine = tmp_path / "m.jsonl"
    mine.write_text("{}\n")
    assert new_file.append_problem(str(mine), [str(source), str(tmp_path / "set")]) is None
    assert new_file.append_problem(str(tmp_path / "none.jsonl"), [str(source)]) is None
    os.link(source, tmp_path / "linked.jsonl")
    assert new_file.append_problem(str(tmp_path / "linked.jsonl"), []) == (
        "has 2 links (another name reaches the same file: `ln`), and appending would change that file too")
    os.symlink(inner, tmp_path / "through.jsonl")  # one link, but the input's own file
    assert new_file.append_problem(str(tmp_path / "through.jsonl"), [str(tmp_path / "set")]) == (
        f"is the same file as the input {inner}")


# ----------------------------------------------------------------------------- each command's outputs


def test_report_output_linked_to_its_metrics_input(tmp_path):
    from apps import report

    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "loss": 3.0 - 0.1 * i, "step_time_s": 0.5, "tokens": 200,
                                           "target_tokens": 100, "target_tokens_per_s": 200.0, "density": 0.5}) + "\n"
                               for i in range(1, 4)))
    digest = _sha(metrics)
    out = tmp_path / "page.md"
    os.link(metrics, out)
    assert report.main(["--metrics", str(metrics), "--output", str(out), "--overwrite"]) == 0
    _assert_new_file(metrics, out, digest)
    assert out.read_text().startswith("#")
    # a figure of the Markdown page hard-linked to the input: the input keeps its bytes too
    figure = next((tmp_path / "page_figures").iterdir())
    os.remove(figure)
    os.link(metrics, figure)
    assert report.main(["--metrics", str(metrics), "--output", str(out), "--overwrite"]) == 0
    _assert_new_file(metrics, figure, digest)


def test_preflight_outputs_linked_to_its_input_data(tmp_path, monkeypatch):
    from apps import preflight

    monkeypatch.chdir(tmp_path)
    data = tmp_path / "a.jsonl"
    data.write_text('{"instruction": "Say hi", "input": "", "output": "Hi there!"}\n')
    digest = _sha(data)
    (tmp_path / "p").mkdir()
    for name in ("preflight.json", "preflight.csv", "length_histogram.png"):
        os.link(data, tmp_path / "p" / name)
    assert preflight.main(["--input", "a.jsonl", "--format", "alpaca", "--max-length", "64", "--output", "p",
                           "--overwrite"]) == 0
    for name in ("preflight.json", "preflight.csv", "length_histogram.png"):
        _assert_new_file(data, tmp_path / "p" / name, digest)
    assert json.loads((tmp_path / "p" / "preflight.json").read_text())["rows"]


def test_a_folders_own_file_linked_to_an_input(tmp_path):
    """--save-lora, export --merge and tokenizer-folder write through own_files: the new files are
    renamed in, so an old own file that is another name of an input leaves the input as it was."""
    from prepack.storage import own_files

    weights = _linked(tmp_path, b"base weights", name="base.safetensors")
    digest = _sha(weights)
    (tmp_path / "adapter").mkdir()
    os.link(weights, tmp_path / "adapter" / "adapter_model.safetensors")
    own_files.write_own_files(str(tmp_path / "adapter"), {"adapter_model.safetensors": b"new"},
                              lambda n: n.endswith(".safetensors"))
    _assert_new_file(weights, tmp_path / "adapter" / "adapter_model.safetensors", digest)


# ----------------------------------------------------------------------------- the metrics JSONL


def _recorder(path, **kw):
    from train.measurement.metrics import MetricsRecorder

    return MetricsRecorder(str(path), log_every=0, out=open(os.devnull, "w"), **kw)


def test_the_metrics_file_appears_with_its_first_record(tmp_path):
    """A run killed before step 1 (out of memory while compiling) left a 0-byte --metrics-out that
    refused the same command's rerun; the file's folder is not made before either."""
    path = tmp_path / "new" / "m.jsonl"
    rec = _recorder(path)
    assert not (tmp_path / "new").exists()
    rec.close({"steps": 0})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"summary": {"steps": 0}}]
    assert os.listdir(path.parent) == ["m.jsonl"]


def test_an_old_metrics_file_stays_until_the_first_record_and_a_linked_one_keeps_its_bytes(tmp_path):
    """--overwrite: the old file is replaced by a new one at the first record, never truncated:
    `ln SET/manifest.json m.jsonl` turned the shard set's manifest into metrics JSONL."""
    source = _linked(tmp_path, name="manifest.json")
    digest = _sha(source)
    path = tmp_path / "m.jsonl"
    os.link(source, path)
    rec = _recorder(path)
    assert _sha(path) == digest  # nothing written yet: still the old file
    rec.eval_generate_done({"step": 0, "prompts": 1, "exact_match": 1.0, "time_s": 0.1})
    rec.close({"steps": 0})
    _assert_new_file(source, path, digest)
    assert [list(json.loads(line)) for line in path.read_text().splitlines()] == [["eval_generate"], ["summary"]]
    assert sorted(os.listdir(tmp_path)) == ["m.jsonl", "manifest.json"]


def test_a_resumed_run_appends_to_its_own_metrics(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n")
    inode = os.stat(path).st_ino
    rec = _recorder(path, resume_from=2)
    rec.close({"steps": 0})
    assert os.stat(path).st_ino == inode  # appended, not rewritten
    assert [list(json.loads(line)) for line in path.read_text().splitlines()] == [["step"], ["step"], ["resume"], ["summary"]]


def test_a_resumed_runs_metrics_with_another_name_is_refused_before_any_work(tmp_path):
    from train.run_config import outputs
    from train.run_config.config import TrainConfig, TrainError

    shards = tmp_path / "set"
    shards.mkdir()
    (shards / "manifest.json").write_text('{"a": 1}\n')
    digest = _sha(shards / "manifest.json")
    metrics = tmp_path / "m.jsonl"
    os.link(shards / "manifest.json", metrics)
    for overwrite in (False, True):
        cfg = TrainConfig(shards=str(shards), metrics_out=str(metrics), checkpoint_dir=str(tmp_path / "ck"),
                          overwrite=overwrite)
        with pytest.raises(TrainError) as e:
            outputs.check_outputs(cfg, resumes=lambda: True)
        assert str(e.value) == (
            f"--metrics-out {metrics} has 2 links (another name reaches the same file: `ln`), and appending would change "
            f"that file too; a resumed run appends to its metrics: give it a file of its own (a copy: cp {metrics} NEW, "
            "then --metrics-out NEW)")
        outputs.check_outputs(cfg, resumes=lambda: False) if overwrite else None  # a fresh run writes a new file
    assert _sha(shards / "manifest.json") == digest


def test_train_metrics_out_hard_linked_to_the_shard_sets_manifest(tmp_path):
    """The issue's case end to end (it trains one step of a tiny model): `ln SET/manifest.json
    m.jsonl; prepack train ... --metrics-out m.jsonl --overwrite` exited 0 with the shard set lost."""
    import numpy as np

    from testkit.shard_sets import TEST_TOKENIZER, build_shard_set, synthetic_row
    from train import cli

    rng = np.random.default_rng(0)
    shards = str(tmp_path / "set")
    build_shard_set(shards, rows=[synthetic_row(r, 32, rng, vocab_size=128) for r in range(4)],
                    tokenizer={**TEST_TOKENIZER, "name": "links", "vocab_size": 128}, num_shards=1)
    manifest = os.path.join(shards, "manifest.json")
    digest = _sha(manifest)
    metrics = tmp_path / "m.jsonl"
    os.link(manifest, metrics)
    assert cli.main(["--shards", shards, "--model", "tiny-qwen3", "--lora-rank", "4", "--batch-size", "2", "--steps", "1",
                     "--log-every", "0", "--remat", "none", "--compile-cache", "off", "--metrics-out", str(metrics),
                     "--tensorboard", str(tmp_path / "tb"), "--overwrite"]) == 0
    _assert_new_file(manifest, metrics, digest)
    assert [list(json.loads(line))[0] for line in metrics.read_text().splitlines()][-1] == "summary"
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tmp_path / "tb"))  # made at the first scalar
