"""`prepack generate` as a user runs it: tiny Gemma3 (random weights) with a small tokenizer in
FunctionGemma's layout (`--chat-format hf`, tool calls), so each run takes seconds.

The output rules (an existing --output refused without --overwrite, before any work), the
JSONL (input order, the keys, the same bytes on a greedy rerun), --score's summary and table with
the tool-call rates, dead letters as in pack, --lora, and one line for each bad option."""
from __future__ import annotations

import json

import pytest

from apps.generate import main

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
RECORDS = [
    {"tools": [WEATHER], "messages": [{"role": "user", "content": "Weather in Paris?"},
                                      {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                                          "name": "get_weather", "arguments": {"city": "Paris"}}}]}]},
    {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello there."},
                  {"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "Fine."}]},
    {"messages": [{"role": "user", "content": "2 + 2 = ?"}, {"role": "assistant", "content": "4"}]},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from testkit.hf_tokenizers import functiongemma_layout_dir

    return functiongemma_layout_dir(tmp_path_factory.mktemp("fg"))


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def args(tok_dir, data, out, *more):
    return ["--input", str(data), "--format", "chat", "--tokenizer", f"hf:{tok_dir}", "--chat-format", "hf",
            "--model", "tiny", "--max-new-tokens", "6", "--batch-size", "2", "--output", str(out), *more]


def test_generate_writes_lines_in_input_order_scores_them_and_reruns_byte_for_byte(tmp_path, tok_dir, data, capsys):
    out = tmp_path / "base.jsonl"
    assert main(args(tok_dir, data, out, "--score", "--all-turns")) == 0
    captured = capsys.readouterr()
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"].rpartition("/")[2] for x in lines] == ["0#0", "1#0", "1#1", "2#0"]
    assert [list(x)[:6] for x in lines] == [["id", "prompt_tokens", "completion", "completion_tokens", "reference",
                                            "stop_reason"]] * 4
    assert [x["reference"] for x in lines] == [
        "<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>", "Hello there.", "Fine.", "4"]
    assert all(x["completion_tokens"] <= 6 and x["stop_reason"] in ("stop", "length") for x in lines)
    assert lines[1]["prompt_tokens"] < lines[2]["prompt_tokens"]
    summary = json.loads((tmp_path / "base.score.json").read_text())
    assert summary["tool_call_parser"] == "functiongemma" and (summary["call_prompts"], summary["no_call_prompts"]) == (1, 3)
    assert summary["prompts"] == 4 and summary["reference_nll"] > 0 and summary["lora"] is None
    assert summary["sampling"]["mode"] == "greedy" and summary["chat_format"] == "hf"
    table = captured.out.splitlines()
    assert table[0].split()[:4] == ["run", "prompts", "exact_match", "reference_nll"] and table[1].split()[:2] == ["base", "4"]
    assert "tokens/s" in captured.err
    # the output rule: refused before any work, then replaced with --overwrite, the same bytes (greedy)
    before = out.read_bytes()
    assert main(args(tok_dir, data, out, "--score", "--all-turns")) == 2
    assert f"{out}, {tmp_path / 'base.score.json'} already exist: refusing to write generations over them. Pass " \
           "--overwrite" in capsys.readouterr().err
    assert main(args(tok_dir, data, out, "--score", "--all-turns", "--overwrite")) == 0
    assert out.read_bytes() == before


def test_generate_with_the_adapter(tmp_path, tok_dir, data, capsys):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from prepack.text.tokenizer import load_tokenizer
    from train import lora_file, models
    from train.fingerprint import base_fingerprint

    vocab = load_tokenizer(f"hf:{tok_dir}").vocab_size
    built = models.build_model("tiny", vocab_size=vocab, seed=0)
    model = models.apply_lora(built.model, built.spec, rank=4)
    rng = np.random.default_rng(0)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), nnx.state(model, nnx.LoRAParam)))
    lora = str(tmp_path / "lora.safetensors")
    lora_file.save_lora(model, lora, {"model": "tiny", "lora_alpha": 8.0, "base_fingerprint": base_fingerprint(model),
                                      "vocab_size": vocab, "seed": 0})
    assert main(args(tok_dir, data, tmp_path / "base.jsonl")) == 0
    common = args(tok_dir, data, tmp_path / "tuned.jsonl", "--lora", lora)
    common.remove("--model")
    common.remove("tiny")  # the model comes from the adapter's file
    assert main(common) == 0
    base = [json.loads(x)["completion"] for x in (tmp_path / "base.jsonl").read_text().splitlines()]
    tuned = [json.loads(x)["completion"] for x in (tmp_path / "tuned.jsonl").read_text().splitlines()]
    assert base != tuned
    assert "LoRA rank 4 from" in capsys.readouterr().err
    assert main(args(tok_dir, data, tmp_path / "other.jsonl", "--lora", lora, "--model", "tiny-qwen3")) == 2
    assert f"--lora {lora} was trained on --model tiny, not tiny-qwen3" in capsys.readouterr().err


def test_bad_records_are_dead_letters(tmp_path, tok_dir, data, capsys):
    with data.open("a") as f:
        f.write('{"messages": [{"role": "user", "content": "no reply"}]}\nnot json\n')
    out = tmp_path / "gen.jsonl"
    assert main(args(tok_dir, data, out)) == 2
    err = capsys.readouterr().err
    assert "2 of 5 examples read are bad records (40.00%, more than --max-bad-fraction 0)" in err
    letters = [json.loads(x) for x in (tmp_path / "gen.dead_letters.jsonl").read_text().splitlines()]
    assert [x["reason"] for x in letters] == ["no_assistant_turn", "malformed_json"]
    assert letters[0]["source"]["line"] == 4 and not out.exists()
    assert main(args(tok_dir, data, out, "--max-bad-fraction", "0.5", "--overwrite")) == 0
    assert len(out.read_text().splitlines()) == 3


@pytest.mark.parametrize("extra, message", [
    (["--top-p", "0.9"], "--top-p and --top-k narrow sampling, but greedy decoding (--temperature 0, the default) does not "
                         "sample: give --temperature too"),
    (["--format", "text"], "--format text is plain text with no replies to prompt for"),
    (["--format", "alpaca"], "records have keys tools, messages, not the instruction, output of format 'alpaca': try --format chat"),
    (["--tool-call-parser", "xml"], "unknown --tool-call-parser 'xml'"),
    (["--max-prompts", "0"], "--max-prompts must be at least 1, got 0"),
    (["--model", "huge"], "unknown model 'huge'"),
])
def test_bad_options_are_one_line(tmp_path, tok_dir, data, capsys, extra, message):
    assert main(args(tok_dir, data, tmp_path / "gen.jsonl", *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) <= 2 and "Traceback" not in err


@pytest.mark.parametrize("output, message", [
    ("gs://", "--output 'gs://' names no bucket: write gs://BUCKET/FOLDER"),
    ("gs://bucket", "--output gs://bucket is a folder; name a file, e.g. gs://bucket/generations.jsonl"),
    ("gs://bucket/out/", "--output gs://bucket/out/ is a folder; name a file, e.g. gs://bucket/out/generations.jsonl"),
    ("s3://bucket/gen.jsonl", "only local paths and gs:// are supported, not s3://"),
])
def test_output_must_name_a_file(tok_dir, data, capsys, output, message):
    assert main(args(tok_dir, data, output)) == 2
    assert message in capsys.readouterr().err


def test_output_that_is_a_local_folder(tmp_path, tok_dir, data, capsys):
    assert main(args(tok_dir, data, tmp_path)) == 2
    assert f"--output {tmp_path} is a folder; name a file" in capsys.readouterr().err


def test_no_model_no_adapter(tmp_path, tok_dir, data, capsys):
    argv = args(tok_dir, data, tmp_path / "gen.jsonl")
    del argv[argv.index("--model"):argv.index("--model") + 2]
    assert main(argv) == 2
    assert "--model is required (or --lora, whose file names the model it was trained on)" in capsys.readouterr().err
