"""A tokenized set read by `--from-tokens` is untrusted (issue 24): its manifest must be the
one its run record names, its files must not change or vanish, its records must be ones the
job could have written; each failure is one line, and nothing is published."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

from pipelines.launch.job import run
from pipelines.options import parse_args
from pipelines.launch.errors import JobError
from prepack.format import tokenset
from prepack.format.manifest import MANIFEST_NAME
from testkit.pipeline import IN_PROCESS, alpaca_records, write_jsonl


def pack(args: list[str]):
    config, beam_args = parse_args(args + ["--no-progress"] + IN_PROCESS)
    return run(config, beam_args)


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile-tokens")
    src = write_jsonl(str(d / "in.jsonl"), alpaca_records(30, seed=3))
    out = d / "out"
    pack(["--input", src, "--format", "alpaca", "--output", str(out), "--max-length", "64"])
    return out


@pytest.fixture
def output(first, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(first, out)
    return out


def refused(output, tmp_path) -> str:
    with pytest.raises(JobError) as e:
        pack(["--from-tokens", str(output / "tokens"), "--output", str(tmp_path / "new"), "--max-length", "128"])
    assert not (tmp_path / "new" / "L128" / MANIFEST_NAME).exists()
    message = str(e.value)
    assert "\n" not in message
    return message


def test_the_run_record_names_the_tokens_manifest(first):
    record = json.loads((first / "published.json").read_text())
    assert record["tokens_manifest_sha256"] == hashlib.sha256((first / "tokens" / MANIFEST_NAME).read_bytes()).hexdigest()


def test_from_tokens_into_the_same_output_keeps_naming_the_set(output):
    pack(["--from-tokens", str(output / "tokens"), "--output", str(output), "--max-length", "128"])
    record = json.loads((output / "published.json").read_text())
    assert record["tokens_manifest_sha256"] == hashlib.sha256((output / "tokens" / MANIFEST_NAME).read_bytes()).hexdigest()
    assert list(record["lengths"]) == ["128", "64"]  # a length added keeps those published before it


def test_an_edited_tokens_manifest_is_refused(output, tmp_path):
    path = output / "tokens" / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["tokenizer"]["vocab_hash"] = "f" * 64  # an "accidental" edit of the identity
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    message = refused(output, tmp_path)
    assert message.startswith(f"{path} is not the tokenized set {output}/published.json names (its sha256 is ")
    assert message.endswith("the manifest was edited or replaced after its run; restore it, or run a full `prepack pack` again")


def test_a_tokens_file_that_changed_is_one_line(output, tmp_path):
    manifest = tokenset.TokenSetManifest.from_json((output / "tokens" / MANIFEST_NAME).read_text())
    shard = output / "tokens" / manifest.shards[0].path
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: the launcher's checks pass, the worker's sha256 does not
    shard.write_bytes(bytes(data))
    message = refused(output, tmp_path)
    assert message.startswith(f"{shard}: sha256 ") and "the file changed after it was published" in message


def test_a_tokens_file_that_vanishes_mid_run_is_one_line(output, tmp_path, monkeypatch):
    from pipelines.launch import token_set

    real = token_set.open_token_set

    def open_then_delete(folder):  # the launcher saw the file; it is gone when the worker reads it
        manifest = real(folder)
        os.remove(os.path.join(folder, manifest.shards[0].path))
        return manifest

    monkeypatch.setattr(token_set, "open_token_set", open_then_delete)
    message = refused(output, tmp_path)
    assert " vanished while the job ran (" in message and message.endswith("run a full `prepack pack` again")


def _rewrite_records(output, change) -> None:
    """Rewrites the set's first file with changed records, and its manifest and run record to
    match: what someone who can write the bucket can do. The reader must still refuse it."""
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    folder = output / "tokens"
    manifest_path = folder / MANIFEST_NAME
    data = json.loads(manifest_path.read_text())
    entry = data["shards"][0]
    path = folder / entry["path"]
    reader = ArrayRecordReader(str(path))
    records = [change(k, r) for k, r in enumerate(reader.read_all())]
    reader.close()
    writer = ArrayRecordWriter(str(path), tokenset.TOKENS_WRITER_OPTIONS)
    for r in records:
        writer.write(r)
    writer.close()
    entry["num_bytes"] = os.path.getsize(path)
    entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    manifest_path.write_text(text)
    record = json.loads((output / "published.json").read_text())
    record["tokens_manifest_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    (output / "published.json").write_text(json.dumps(record))


def _with_ids(record: bytes, ids) -> bytes:
    eid, loc, old_ids, mask, _ = tokenset.decode_example(record)
    return tokenset.encode_example(eid, loc, np.asarray(ids, dtype=np.int32), mask)


@pytest.mark.parametrize("change,words", [
    (lambda k, r: _with_ids(r, [1 << 23] * len(tokenset.decode_example(r)[2])) if k == 3 else r,
     "is damaged: token id 8388608 is outside the vocabulary (vocab_size 262,144)"),
    (lambda k, r: r[:-1] if k == 2 else r, "is damaged"),
    (lambda k, r: r[:1] + (1 << 30).to_bytes(4, "little") + r[5:] if k == 0 else r, "is damaged"),
    (lambda k, r: r[:5] + (99).to_bytes(4, "little", signed=True) + r[9:] if k == 1 else r, "names no task of the set's 1"),
])
def test_damaged_records_with_a_matching_sha256_are_refused_in_one_line(output, tmp_path, change, words):
    _rewrite_records(output, change)
    message = refused(output, tmp_path)
    assert message.startswith(f"{output}/tokens/tokens-") and words in message, message


def test_a_bit_mask_whose_count_disagrees_is_damaged():
    record = tokenset.encode_example("e", (0, 0, 1, 0), np.arange(9, dtype=np.int32), np.ones(9, np.uint8))
    at = len(record) - 2 - 8  # the mask's count field (9 values: 2 bytes of bits)
    bad = record[:at] + (1 << 62).to_bytes(8, "little") + record[at + 8:]
    with pytest.raises(tokenset.TokenSetError, match="is damaged"):
        tokenset.decode_example(bad)
    with pytest.raises(tokenset.TokenSetError, match="is damaged"):
        tokenset.decode_batch([bad, record[:3]])
