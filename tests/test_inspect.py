"""`prepack inspect`: the manifest summary and rows decoded segment by segment, targets marked."""

from __future__ import annotations

import io

import numpy as np
import pytest
from testkit.shard_sets import build_shard_set

import prepack.text.tokenizer
from apps import cli, inspect
from prepack.format import rowformat


class FakeTokenizer:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)

    def identity(self):
        return {"vocab_hash": "0" * 64}


def seg(ids, mask):
    return rowformat.Segment(np.array(ids, np.int32), np.array(mask, np.int32))


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory) -> str:
    rows = [
        rowformat.build_row([seg([2, 6, 7, 8], [0, 0, 1, 1]), seg([9, 10, 11], [0, 1, 1])], 10),
        rowformat.build_row([seg([20, 21, 22, 23, 24, 25, 26, 27, 28, 29], [0, 0, 0, 0, 0, 1, 1, 1, 1, 1])], 10),
    ]
    path = str(tmp_path_factory.mktemp("set") / "L10")
    build_shard_set(path, rows=rows, num_shards=1, max_length=10, dead_letter=[{"id": "a"}, {"id": "b"}])
    return path


def run(argv):
    out, err = io.StringIO(), io.StringIO()
    rc = inspect.main(argv, out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


def test_summary_and_text_with_targets(shard_set, monkeypatch):
    monkeypatch.setattr(prepack.text.tokenizer, "load_tokenizer", lambda spec, **kw: FakeTokenizer())
    rc, out, err = run([shard_set, "--no-color"])
    assert rc == 0, err
    assert f"shard set   {shard_set}" in out
    assert "format      v1, max_length 10, packing bfd" in out
    assert "rows        2 in 1 shard (" in out
    assert "tokenizer   test-vocab (vocab 50,000, bos 2, eos 1, pad 0" in out
    assert "examples    read 5, written 3, dropped 2 (too_long 2), truncated 0" in out
    assert "tokens      17 (targets 9)" in out
    assert "density     packed 85.0%, unpacked 56.7%" in out
    assert "dead letter dead_letter.jsonl: 2 examples" in out
    assert "row 0: 2 segments, 7/10 tokens (70.0%), 4 targets" in out
    assert "  segment 1: tokens 0..3 (4), positions 0..3, 2 targets\n    <bos><6>[[<7><8>]]" in out  # specials by name
    # The first token of a segment is never a target (build_row zeroes it).
    assert "  segment 2: tokens 4..6 (3), positions 0..2, 2 targets\n    <9>[[<10><11>]]" in out
    assert "  padding: 3 tokens (id 0)" in out
    assert "row 1: 1 segment, 10/10 tokens (100.0%), 5 targets" in out
    assert "<20><21><22><23><24>[[<25><26><27><28><29>]]" in out


def test_falls_back_to_ids_and_selects_rows(shard_set, monkeypatch):
    def fail(spec, **kw):
        raise prepack.text.tokenizer.TokenizerError(f"tokenizer {spec!r}: not here")

    monkeypatch.setattr(prepack.text.tokenizer, "load_tokenizer", fail)
    rc, out, err = run([shard_set, "--rows", "1", "--row-index", "1", "--no-color"])
    assert rc == 0
    assert "note: tokenizer 'test-vocab' could not be loaded" in err and "showing token ids" in err
    assert "row 0:" not in out and "20 21 22 23 24 [[25 26 27 28 29]]" in out


def test_color_marks_targets(shard_set, monkeypatch):
    monkeypatch.setattr(prepack.text.tokenizer, "load_tokenizer", lambda spec, **kw: FakeTokenizer())
    rc, out, _ = run([shard_set, "--rows", "1", "--color", "always"])
    assert rc == 0 and "targets in green" in out
    assert f"<bos><6>{inspect.GREEN}<7><8>{inspect.RESET}" in out


def test_ids_flag_and_summary_only(shard_set):
    rc, out, _ = run([shard_set, "--ids", "--rows", "1", "--no-color"])
    assert rc == 0 and "2 6 [[7 8]]" in out
    rc, out, _ = run([shard_set, "--rows", "0"])
    assert rc == 0 and "stats" in out and "row 0" not in out


def test_errors(tmp_path, shard_set):
    rc, _, err = run([str(tmp_path / "none")])
    assert rc == 2 and f"no manifest.json in {tmp_path / 'none'}: not a published shard set" in err
    rc, _, err = run([shard_set, "--row-index", "5", "--ids"])
    assert rc == 2 and "--row-index 5 is outside 0..1" in err


def test_console_script_dispatch(shard_set, capsys):
    assert cli.main(["inspect", shard_set, "--rows", "0"]) == 0
    assert "max_length 10" in capsys.readouterr().out


def test_verify_runs_even_with_rows_0(shard_set, tmp_path):
    """Base commit: --verify --rows 0 skipped the check and exited 0 on a corrupt shard."""
    import json
    import os
    import shutil

    rc, out, err = run([shard_set, "--verify", "--rows", "0"])
    assert rc == 0, err
    assert out.rstrip().endswith("verified 1 shards (sha256)")
    broken = str(tmp_path / "L10")
    shutil.copytree(shard_set, broken)
    shard = os.path.join(broken, json.load(open(os.path.join(broken, "manifest.json")))["shards"][0]["path"])
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    rc, out, err = run([broken, "--verify", "--rows", "0"])
    assert rc == 1
    assert err.startswith(f"prepack inspect: {shard}: sha256 ") and "differs from the manifest's" in err
    assert "verified" not in out


def test_an_output_root_lists_its_shard_sets(tmp_path):
    # `prepack pack --max-length 32 64 --output OUT` publishes OUT/L32 and OUT/L64; OUT itself has no manifest.
    root = tmp_path / "OUT"
    build_shard_set(root / "L64", num_rows=3, max_length=64)
    build_shard_set(root / "L32", num_rows=5, max_length=32)
    (root / "L128").mkdir()  # an interrupted run: no manifest, not listed
    rc, out, err = run([str(root)])
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"{root} holds 2 shard sets, one per max length; inspect one of them:"
    assert [line.split()[2] for line in lines[1:]] == [str(root / "L32"), str(root / "L64")]
    assert "5 rows" in lines[1] and "3 rows" in lines[2]
