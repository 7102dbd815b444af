"""`prepack train --shards` on what is not a shard set: one line saying what is there (no JAX loaded)."""

from __future__ import annotations

import json

import pytest

from train import cli


def _write(path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


@pytest.fixture
def pack_output(tmp_path):
    out = tmp_path / "OUT"
    for L in (1024, 512):
        _write(out / f"L{L}" / "manifest.json", {"max_length": L})
    _write(out / "tokens" / "manifest.json", {"kind": "tokens"})
    return out


def test_parent_folder_lists_its_shard_sets(pack_output, capsys):
    assert cli.main(["--shards", str(pack_output)]) == 2
    assert capsys.readouterr().err == (
        f"prepack train: --shards {pack_output} holds 2 shard sets, one per max length: pass one of them: "
        f"{pack_output}/L512, {pack_output}/L1024\n")


def test_tokenized_set_says_to_pack_it_first(pack_output, capsys):
    tokens = pack_output / "tokens"
    assert cli.main(["--shards", str(tokens) + "/"]) == 2
    assert capsys.readouterr().err == (
        f"prepack train: --shards {tokens} is a tokenized set (examples, not packed rows): pack it first, e.g. "
        f"prepack pack --from-tokens {tokens} --max-length 1024 --output OUT, then --shards OUT/L1024\n")


def test_missing_path(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert cli.main(["--shards", str(missing)]) == 2
    assert capsys.readouterr().err == f"prepack train: --shards {missing}: no such file or folder\n"


def test_eval_shards_are_checked_too(pack_output, capsys):
    assert cli.main(["--shards", str(pack_output / "L512"), "--eval-shards", str(pack_output)]) == 2
    assert capsys.readouterr().err.startswith(f"prepack train: --eval-shards {pack_output} holds 2 shard sets")


def test_a_shard_set_and_gcs_pass_the_check(pack_output):
    assert cli.shards_refusal("--shards", str(pack_output / "L512")) is None
    assert cli.shards_refusal("--shards", "gs://bucket/OUT") is None
