"""Training on real Qwen3 shards: `prepack pack --tokenizer qwen3` then `prepack train --model tiny-qwen3`,
and the vocabulary checks between the two families (Gemma models refuse Qwen3 shards, Qwen3
models refuse Gemma3 shards) on real manifests, before any weights load.
"""
from __future__ import annotations

import json
import math

import pytest

from testkit.pipeline import alpaca_records, write_jsonl
from test_pipeline import pack
from train import cli
from train import families

from testkit.shard_sets import TEST_TOKENIZER, build_shard_set

QWEN3_IDS = 151_669


@pytest.fixture(scope="module")
def qwen3_shards(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("qwen3_shards")
    path = write_jsonl(str(root / "alpaca.jsonl"), alpaca_records(24))
    pack(["--input", path, "--format", "alpaca", "--tokenizer", "qwen3", "--output", str(root / "out"), "--max-length", "64",
          "--overlong", "truncate"])
    return str(root / "out" / "L64")


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_tiny_qwen3_trains_on_qwen3_shards(qwen3_shards, tmp_path, capsys) -> None:
    metrics = str(tmp_path / "m.jsonl")
    rc = cli.main(["--shards", qwen3_shards, "--model", "tiny-qwen3", "--batch-size", "2", "--steps", "2",
                   "--log-every", "0", "--metrics-out", metrics])
    assert rc == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert summary["vocab_size"] == QWEN3_IDS and summary["model"] == "tiny-qwen3"
    losses = [r["loss"] for r in map(json.loads, open(metrics)) if "step" in r and "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    # A random model over 151,669 ids starts near ln(151,669) = 11.93.
    assert abs(losses[0] - math.log(QWEN3_IDS)) < 1.0


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_tiny_qwen3_trains_on_qwen3_shards_in_bfloat16(qwen3_shards, tmp_path, capsys) -> None:
    # bf16 base and compute with float32 LoRA/optimizer state (issue 11's fix): before it, step 2 was NaN.
    metrics = str(tmp_path / "m.jsonl")
    rc = cli.main(["--shards", qwen3_shards, "--model", "tiny-qwen3", "--dtype", "bfloat16", "--batch-size", "2",
                   "--steps", "3", "--log-every", "0", "--metrics-out", metrics])
    assert rc == 0, capsys.readouterr().err
    losses = [r["loss"] for r in map(json.loads, open(metrics)) if "step" in r and "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(QWEN3_IDS)) < 1.0


@pytest.mark.parametrize("model", ["gemma3-270m", "tiny-gemma3"])
def test_gemma_models_refuse_qwen3_shards(qwen3_shards, model, capsys) -> None:
    rc = cli.main(["--shards", qwen3_shards, "--model", model, "--steps", "1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "tokenized with 'qwen3', whose vocabulary (vocab_hash" in err and "is the qwen3 tokenizer's" in err
    assert f"{model} is a gemma3 model" in err


@pytest.mark.parametrize("model", ["qwen3-0.6b", "tiny-qwen3"])
def test_qwen3_models_refuse_gemma3_shards(tmp_path, model, capsys) -> None:
    path = str(tmp_path / "gemma3")
    # Gemma3's identity (its vocab_hash); tiny-qwen3 takes its embedding size from it, so only the family rule can refuse.
    build_shard_set(path, num_rows=4, max_length=32, tokenizer={**TEST_TOKENIZER, "name": "gemma3", "vocab_size": 262_144,
                                                                  "vocab_hash": families.by_name("gemma3").vocab_hash})
    rc = cli.main(["--shards", path, "--model", model, "--weights", "random", "--steps", "1", "--batch-size", "4"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "'gemma3'" in err and ("is the gemma3 tokenizer's" in err or "151,936 embedding rows" in err)
    if model == "tiny-qwen3":
        assert "is the gemma3 tokenizer's" in err and "tiny-qwen3 is a qwen3 model" in err
