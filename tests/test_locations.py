"""Every path a command takes names a place before anything is read or written there
(prepack.storage.location_problem, one rule): `--output gs://` (no bucket) exited 0 after
writing a local folder ./gs:/L512, `--output gs:///x` was a ValueError traceback, and another
scheme (s3://, gs:/ with one slash) would be taken for a local folder named after it."""

from __future__ import annotations

import io

import pytest

from apps import inspect_tokens, preflight, report, verify
from pipelines.launch import cli as pack_cli
from pipelines.options import OptionsError, parse_args
from pipelines.inputs.sources import InputError, resolve_inputs
from prepack.storage import location_problem

BAD = {
    "gs://": "'gs://' names no bucket: write gs://BUCKET/FOLDER",
    "gs:///x": "'gs:///x' names no bucket: write gs://BUCKET/FOLDER",
    "gs:/bucket/x": "'gs:/bucket/x' is not a gs:// URL: write gs://BUCKET/FOLDER",
    "GS://bucket/x": "'GS://bucket/x' is not a gs:// URL: write gs://BUCKET/FOLDER",
    "s3://bucket/x": "'s3://bucket/x': only local paths and gs:// are supported, not s3://",
}


@pytest.mark.parametrize("path", ["gs://bucket", "gs://bucket/x/L512", "/tmp/out", "out", "./gs", "hf:org/set", "c:/x"])
def test_places_are_accepted(path):
    assert location_problem(path) is None


@pytest.mark.parametrize("path, words", sorted(BAD.items()))
def test_pack_refuses_an_output_that_names_no_place_and_writes_nothing(path, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert pack_cli.main(["--sample", "--output", path, "--max-length", "512"]) == 2
    assert capsys.readouterr().err == f"prepack pack: --output {words}\n"
    assert list(tmp_path.iterdir()) == []  # no ./gs:/L512, no ./s3:
    with pytest.raises(OptionsError, match=f"^--from-tokens {words}$".replace("(", r"\(").replace(")", r"\)")):
        parse_args(["--from-tokens", path, "--output", "out", "--max-length", "512"])


@pytest.mark.parametrize("path", ["gs:///x/*.jsonl", "gs://"])
def test_an_input_that_names_no_bucket_is_one_line(path):
    with pytest.raises(InputError) as e:
        resolve_inputs([path])
    assert str(e.value) == f"input {path!r} names no bucket: write gs://BUCKET/FOLDER"


@pytest.mark.parametrize("path, words", sorted(BAD.items()))
def test_inspect_and_verify_refuse_a_set_that_names_no_place(path, words):
    out, err = io.StringIO(), io.StringIO()
    assert inspect_tokens.main([path], out=out, err=err) == 2
    assert (out.getvalue(), err.getvalue()) == ("", f"prepack inspect: {words}\n")
    out, err = io.StringIO(), io.StringIO()
    assert verify.main([path], out=out, err=err) == 2
    assert (out.getvalue(), err.getvalue()) == ("", f"prepack verify: {words}\n")


@pytest.mark.parametrize("path, words", sorted(BAD.items()) + [("gs://bucket/pre", "'gs://bucket/pre'")])
def test_preflight_and_report_write_local_files_only(path, words, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "a.jsonl"
    data.write_text('{"instruction": "Say hi", "input": "", "output": "Hi there!"}\n')
    assert preflight.main(["--input", str(data), "--format", "alpaca", "--no-plots", "--output", path]) == 2
    assert capsys.readouterr().err == (f"prepack preflight: error: --output {words}: preflight writes its tables and plots "
                                       "to a local folder; name one\n")
    assert report.main(["--shards", str(tmp_path), "--output", path]) == 2
    assert capsys.readouterr().err == (f"prepack report: error: --output {words}: the report is written to a local file; "
                                       "name one\n")
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]


def test_preflight_pack_output_and_report_shards_are_checked(tmp_path, capsys):
    data = tmp_path / "a.jsonl"
    data.write_text('{"instruction": "Say hi", "input": "", "output": "Hi there!"}\n')
    assert preflight.main(["--input", str(data), "--format", "alpaca", "--no-plots", "--output", str(tmp_path / "p"),
                           "--pack-output", "gs:///sets"]) == 2
    assert capsys.readouterr().err == f"prepack preflight: error: --pack-output {BAD['gs:///x'].replace('/x', '/sets')}\n"
    assert report.main(["--shards", "gs://", "--output", str(tmp_path / "r.html")]) == 2
    assert capsys.readouterr().err == f"prepack report: error: --shards {BAD['gs://']}\n"


@pytest.mark.parametrize("flag", ["--shards", "--eval-shards", "--metrics-out", "--checkpoint-dir", "--save-lora"])
def test_train_refuses_a_path_that_names_no_place_before_jax(flag, capsys):
    from train import cli as train_cli

    argv = ["--shards", "gs://bucket/L512"] + ([flag, "gs:///x"] if flag != "--shards" else [])
    if flag == "--shards":
        argv = ["--shards", "gs:///x"]
    assert train_cli.main(argv) == 2
    assert capsys.readouterr().err == f"prepack train: {flag} {BAD['gs:///x']}\n"
