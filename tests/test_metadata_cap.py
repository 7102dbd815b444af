"""Every manifest, tokenized set's manifest and run record is read under one size cap
(prepack.hostile_input.untrusted.MAX_METADATA_FILE_BYTES, read by prepack.storage.read_metadata):
one over it is refused in one line, on every command and in the loader API, and no more than
the cap + 1 of its bytes is ever read. A 10 GB manifest used to take 10-12 GB of memory in
`prepack inspect` and `prepack verify`, and a 200 MB one was accepted. The files here are
valid JSON padded with spaces to one byte over the cap: accepted before the cap, refused now.
Also: a file where a command takes a set's folder is one line, not a NotADirectoryError.
"""

from __future__ import annotations

import io
import os
import shutil

import pytest

import loaders
from apps import inspect_tokens, report, verify
from pipelines.launch.errors import JobError
from pipelines.launch.job import run
from pipelines.options import parse_args
from prepack import storage
from prepack.format.manifest import MANIFEST_NAME, ManifestError
from prepack.hostile_input.untrusted import MAX_METADATA_FILE_BYTES
from testkit.pipeline import IN_PROCESS, alpaca_records, write_jsonl

TOO_LARGE = (f"larger than {MAX_METADATA_FILE_BYTES:,} bytes, the most a manifest or run record may hold (a real one is far "
             "smaller); it was not read. The file was edited or is damaged: republish the set")


def pack(args: list[str]):
    config, beam_args = parse_args(args + ["--no-progress"] + IN_PROCESS)
    return run(config, beam_args)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    d = tmp_path_factory.mktemp("cap")
    src = write_jsonl(str(d / "in.jsonl"), alpaca_records(12, seed=5))
    pack(["--input", src, "--format", "alpaca", "--output", str(d / "out"), "--max-length", "64"])
    return d / "out"


@pytest.fixture
def out(published, tmp_path):
    copy = tmp_path / "out"
    shutil.copytree(published, copy)
    return copy


def pad_over_the_cap(path) -> None:
    """The file's own JSON, still valid, one byte over the cap (spaces after it)."""
    text = path.read_bytes()
    path.write_bytes(text + b" " * (MAX_METADATA_FILE_BYTES + 1 - len(text)))


def run_cli(main, argv):
    out, err = io.StringIO(), io.StringIO()
    code = main(argv, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_the_cap_reads_no_more_than_cap_plus_one_bytes(tmp_path, monkeypatch):
    """A 10 GB file (sparse) is refused after at most cap + 1 bytes: never read whole."""
    huge = tmp_path / MANIFEST_NAME
    with open(huge, "wb") as f:
        f.truncate(10 << 30)
    asked = []
    real = storage.LocalStorage.read_head
    monkeypatch.setattr(storage.LocalStorage, "read_head", lambda self, path, limit: asked.append(limit) or real(self, path, limit))
    with pytest.raises(ManifestError) as e:
        storage.read_text(str(huge))
    assert str(e.value) == f"{huge}: {TOO_LARGE}"
    assert asked == [MAX_METADATA_FILE_BYTES + 1]
    at_cap = tmp_path / "at_cap.json"
    at_cap.write_bytes(b"{}" + b" " * (MAX_METADATA_FILE_BYTES - 2))
    assert storage.read_text(str(at_cap)).startswith("{}")  # the cap itself is allowed


def test_a_shard_manifest_over_the_cap_is_one_line_everywhere(out, capsys):
    manifest = out / "L64" / MANIFEST_NAME
    pad_over_the_cap(manifest)
    expected = f"{manifest}: {TOO_LARGE}"
    with pytest.raises(ManifestError) as e:  # the loader API
        loaders.open_shards(str(out / "L64"))
    assert str(e.value) == expected
    with pytest.raises(ManifestError) as e:  # through the run record: its manifest is read capped too
        loaders.published_lengths(str(out))
    assert str(e.value) == expected
    assert run_cli(inspect_tokens.main, [str(out / "L64")]) == (2, "", f"prepack inspect: {expected}\n")
    assert run_cli(verify.main, [str(out / "L64")]) == (2, "", f"prepack verify: {expected}\n")
    code, text, _ = run_cli(verify.main, [str(out)])  # an output: that length fails, naming it
    assert code == 1 and f"  first failure: {expected}\n" in text
    assert report.main(["--shards", str(out / "L64"), "--output", str(out / "r.html")]) == 2
    assert capsys.readouterr().err == f"prepack report: error: {expected}\n"


def test_a_run_record_over_the_cap_is_one_line(out):
    record = out / "published.json"
    pad_over_the_cap(record)
    expected = f"{record}: {TOO_LARGE}"
    with pytest.raises(ManifestError) as e:
        loaders.published_lengths(str(out))
    assert str(e.value) == expected
    os.remove(out / "L64" / MANIFEST_NAME)  # verify OUT then reads the record
    assert run_cli(verify.main, [str(out)]) == (2, "", f"prepack verify: {expected}\n")


def test_a_tokens_manifest_over_the_cap_is_refused_before_any_work(out, tmp_path):
    manifest = out / "tokens" / MANIFEST_NAME
    pad_over_the_cap(manifest)
    expected = f"{manifest}: {TOO_LARGE}"
    assert run_cli(inspect_tokens.main, [str(out / "tokens")]) == (2, "", f"prepack inspect: {expected}\n")
    with pytest.raises(JobError) as e:
        pack(["--from-tokens", str(out / "tokens"), "--output", str(tmp_path / "new"), "--max-length", "128"])
    assert str(e.value).startswith(expected)
    assert not (tmp_path / "new").exists()


def test_pack_refuses_an_output_whose_manifest_is_over_the_cap(out):
    """--overwrite reads the set it replaces (to delete its files later): a manifest over the cap
    there is refused unread, and nothing is published."""
    manifest = out / "L64" / MANIFEST_NAME
    pad_over_the_cap(manifest)
    src = write_jsonl(str(out.parent / "in2.jsonl"), alpaca_records(6, seed=8))
    with pytest.raises(JobError) as e:
        pack(["--input", src, "--format", "alpaca", "--output", str(out), "--max-length", "64", "--overwrite"])
    assert str(e.value) == (f"{expected_line(manifest)}; nothing was published. Remove it (it is no set this tool wrote) "
                            "or choose another --output")
    assert manifest.stat().st_size == MAX_METADATA_FILE_BYTES + 1


def expected_line(path) -> str:
    return f"{path}: {TOO_LARGE}"


@pytest.mark.parametrize("name", ["L64/manifest.json", "published.json", "L64/rows-00000-of-00001.array_record"])
def test_inspect_and_verify_on_a_file_are_one_line(published, name):
    """A file where a set's folder is taken was a NotADirectoryError traceback."""
    path = published / name
    if not path.exists():  # the shard's name carries its hash
        path = next((published / "L64").glob("rows-*.array_record"))
    hint = f" ({path.parent})" if path.name == MANIFEST_NAME else ""
    expected = f"{path} is a file, not a folder: name the set's folder{hint} or the --output of `prepack pack`"
    assert run_cli(inspect_tokens.main, [str(path)]) == (2, "", f"prepack inspect: {expected}\n")
    assert run_cli(verify.main, [str(path)]) == (2, "", f"prepack verify: {expected}\n")
