"""A third family is one module: Llama 3 (train/families/llama3.py, Tunix's `tunix.models.llama3`).

`--model tiny-llama3` trains on a Gemma3-tokenized set (it has no tokenizer of its own, so it sizes its
embedding from the set and is not refused for Gemma3's ids), saves a PEFT adapter naming Llama 3.2,
exports merged as LlamaForCausalLM and generates with the default tokenizer, all on a CPU. What
Hugging Face computes from the export is checked in tests/test_peft_export.py (its llama3 case), and
the family's hidden states, head and attention pieces in the fast tier (test_train_chunked_loss.py,
test_train_attention.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os

import pytest

from testkit.shard_sets import TEST_TOKENIZER, build_shard_set
from train import cli, families
from train.adapter_files import merge_export, peft_export

GEMMA3_IDS = 262_144


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("llama3")
    shards = str(root / "gemma3")
    gemma3 = families.by_name("gemma3")
    build_shard_set(shards, num_rows=4, max_length=32, tokenizer={**TEST_TOKENIZER, "name": "gemma3", "vocab_size": GEMMA3_IDS,
                                                                 "vocab_hash": gemma3.vocab_hash})
    metrics, adapter = str(root / "m.jsonl"), str(root / "adapter")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["--shards", shards, "--model", "tiny-llama3", "--lora-rank", "4", "--batch-size", "2", "--steps", "1",
                       "--remat", "none", "--log-every", "0", "--metrics-out", metrics, "--save-lora", adapter])
    assert rc == 0, err.getvalue()[-3000:]
    return {"root": root, "metrics": metrics, "adapter": adapter, "out": out.getvalue()}


@pytest.mark.slow  # trains tiny-llama3 once for the file (its fixture): see pytest.ini
def test_tiny_llama3_trains_on_a_gemma3_set(trained) -> None:
    summary = json.loads(trained["out"].strip().splitlines()[-1])["summary"]
    assert summary["model"] == "tiny-llama3" and summary["vocab_size"] == GEMMA3_IDS
    losses = [r["loss"] for r in map(json.loads, open(trained["metrics"])) if "step" in r and "loss" in r]
    assert len(losses) == 1 and all(math.isfinite(x) for x in losses)


@pytest.mark.slow  # trains tiny-llama3 once for the file (its fixture): see pytest.ini
def test_its_adapter_names_llama_3_2_and_llamas_modules(trained) -> None:
    config = json.load(open(os.path.join(trained["adapter"], peft_export.ADAPTER_CONFIG)))
    assert config["base_model_name_or_path"] == "meta-llama/Llama-3.2-1B"
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.mark.slow  # trains tiny-llama3 once for the file (its fixture): see pytest.ini
def test_it_exports_merged_as_llama(trained, capsys) -> None:
    merged = str(trained["root"] / "merged")
    assert merge_export.main(["--merge", "--lora", trained["adapter"], "--output", merged]) == 0, capsys.readouterr().err
    config = json.load(open(os.path.join(merged, merge_export.CONFIG)))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["vocab_size"] == GEMMA3_IDS and config["tie_word_embeddings"] is True


@pytest.mark.slow  # trains tiny-llama3 once for the file (its fixture): see pytest.ini
def test_it_generates_with_the_default_tokenizer(trained) -> None:
    from apps.generate import main

    data = trained["root"] / "held_out.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "2 + 2 = ?"}, {"role": "assistant", "content": "4"}]}) + "\n")
    output = trained["root"] / "generated.jsonl"
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["--input", str(data), "--format", "chat", "--lora", trained["adapter"], "--max-new-tokens", "3",
                   "--batch-size", "1", "--output", str(output)])
    assert rc == 0, err.getvalue()[-3000:]
    [line] = [json.loads(x) for x in output.read_text().splitlines()]
    assert 1 <= line["completion_tokens"] <= 3
