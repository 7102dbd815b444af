"""`prepack generate` as a user runs it: tiny Gemma3 (random weights) with a small tokenizer in
FunctionGemma's layout (`--chat-format hf`, tool calls), so each run takes seconds.

One held-out file with two bad records is run three times, shared by the tests below (each run
compiles the sampler once: `--batch-size 4` puts the four prompts in one batch): the base model
with --score, the same command again with --overwrite (the same bytes), and an adapter's
--lora. They check the dead letters and --max-bad-fraction, the output rule (an existing
--output refused without --overwrite, before any work), the JSONL (input order, the keys, the
same bytes on a greedy rerun), --score's summary and table with the tool-call rates, --lora, and
one line for each bad option."""
from __future__ import annotations

import contextlib
import functools
import os
import io
import json
import types

import pytest

from apps.generate import main
from train import families

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
BAD_LINES = '{"messages": [{"role": "user", "content": "no reply"}]}\nnot json\n'  # lines 4 and 5


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
            "--model", "tiny", "--max-new-tokens", "6", "--batch-size", "4", "--output", str(out), *more]


def run_main(argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one `prepack generate`."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def save_adapter(tok_dir, path) -> str:
    """A prepack LoRA file for tiny Gemma3 (seed 0 base weights) with non-zero factors."""
    with open(path, "wb") as f:
        f.write(_adapter_bytes(str(tok_dir)))
    return str(path)


@functools.cache
def _adapter_bytes(tok_dir: str) -> bytes:
    """save_adapter's file, made once per process (building the model and its LoRA is the slow part:
    the same seeds give the same bytes every time)."""
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from prepack.text.tokenizer import load_tokenizer
    from train.adapter_files import lora_file
    from train.model import models
    from train.model.fingerprint import base_fingerprint

    vocab = load_tokenizer(f"hf:{tok_dir}").vocab_size
    built = models.build_model("tiny", vocab_size=vocab, seed=0)
    model = models.apply_lora(built.model, built.spec, rank=4)
    rng = np.random.default_rng(0)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), nnx.state(model, nnx.LoRAParam)))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "lora.safetensors")
        lora_file.save_lora(model, path, {"model": "tiny", "lora_alpha": 8.0, "base_fingerprint": base_fingerprint(model),
                                          "vocab_size": vocab, "seed": 0})
        with open(path, "rb") as f:
            return f.read()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tok_dir):
    """The three runs (and the refused attempts between them) over one held-out file with two bad records."""
    tmp = tmp_path_factory.mktemp("generate")
    data = tmp / "held_out.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + BAD_LINES)
    out = tmp / "base.jsonl"
    base = args(tok_dir, data, out, "--score", "--all-turns")
    r = types.SimpleNamespace(tmp=tmp, out=out)
    r.too_many_bad = run_main(base)  # 2 bad of 5 examples, past the default --max-bad-fraction 0
    r.out_after_too_many_bad = out.exists()
    base += ["--max-bad-fraction", "0.5"]
    r.base = run_main(base + ["--overwrite"])  # the dead letters of the refused run are there
    r.base_bytes = out.read_bytes()
    r.refused = run_main(base)
    r.rerun = run_main(base + ["--overwrite"])
    r.rerun_bytes = out.read_bytes()
    r.lora = save_adapter(tok_dir, tmp / "lora.safetensors")
    tuned = args(tok_dir, data, tmp / "tuned.jsonl", "--all-turns", "--max-bad-fraction", "0.5", "--lora", r.lora)
    del tuned[tuned.index("--model"):tuned.index("--model") + 2]  # the model comes from the adapter's file
    r.tuned = run_main(tuned)
    return r


def lines_of(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_bad_records_are_dead_letters(runs):
    code, _, err = runs.too_many_bad
    assert code == 2 and "2 of 5 examples read are bad records (40.00%, more than --max-bad-fraction 0)" in err
    assert not runs.out_after_too_many_bad
    letters = lines_of(runs.tmp / "base.dead_letters.jsonl")  # rewritten by the run that passed
    assert [x["reason"] for x in letters] == ["no_assistant_turn", "malformed_json"]
    assert letters[0]["source"]["line"] == 4
    assert runs.base[0] == 0 and "2 bad record(s) of 5: dead letters in" in runs.base[2]


def test_generate_writes_lines_in_input_order_and_scores_them(runs):
    code, out, err = runs.base
    assert code == 0
    lines = lines_of(runs.out)
    assert [x["id"].rpartition("/")[2] for x in lines] == ["0#0", "1#0", "1#1", "2#0"]
    assert [list(x)[:6] for x in lines] == [["id", "prompt_tokens", "completion", "completion_tokens", "reference",
                                            "stop_reason"]] * 4
    assert [x["reference"] for x in lines] == [
        "<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>", "Hello there.", "Fine.", "4"]
    assert all(x["completion_tokens"] <= 6 and x["stop_reason"] in ("stop", "length") for x in lines)
    assert lines[1]["prompt_tokens"] < lines[2]["prompt_tokens"]
    summary = json.loads((runs.tmp / "base.score.json").read_text())
    assert summary["tool_call_parser"] == "functiongemma" and (summary["call_prompts"], summary["no_call_prompts"]) == (1, 3)
    assert summary["prompts"] == 4 and summary["reference_nll"] > 0 and summary["lora"] is None
    assert summary["sampling"]["mode"] == "greedy" and summary["chat_format"] == "hf"
    generation = summary["generation"]  # the tokens/s a benchmark reads (one batch of 4: it compiled, no steady rate)
    assert generation["batch_size"] == 4 and generation["tokens"] == sum(x["completion_tokens"] for x in lines)
    assert generation["seconds"] > 0 and generation["tokens_per_s"] == pytest.approx(generation["tokens"] / generation["seconds"])
    assert (generation["steady_tokens"], generation["steady_seconds"], generation["steady_tokens_per_s"]) == (0, 0.0, None)
    table = out.splitlines()
    assert table[0].split()[:4] == ["run", "prompts", "exact_match", "reference_nll"] and table[1].split()[:2] == ["base", "4"]
    assert "tokens/s" in err


def test_the_output_rule_and_a_greedy_rerun_writes_the_same_bytes(runs):
    code, _, err = runs.refused
    assert code == 2 and "Traceback" not in err
    assert f"{runs.out}, {runs.tmp / 'base.score.json'}, {runs.tmp / 'base.dead_letters.jsonl'} already exist: refusing " \
           "to write generations over them. Pass --overwrite" in err
    assert runs.rerun[0] == 0 and runs.rerun_bytes == runs.base_bytes


def test_generate_with_the_adapter(runs, tok_dir, data, tmp_path):
    code, _, err = runs.tuned
    assert code == 0 and "LoRA rank 4 from" in err
    base = [x["completion"] for x in lines_of(runs.out)]
    tuned = [x["completion"] for x in lines_of(runs.tmp / "tuned.jsonl")]
    assert len(tuned) == 4 and base != tuned
    code, _, err = run_main(args(tok_dir, data, tmp_path / "other.jsonl", "--lora", runs.lora, "--model", "tiny-qwen3"))
    assert code == 2 and f"--lora {runs.lora} was trained on --model tiny, not tiny-qwen3" in err


@pytest.mark.parametrize("extra, message", [
    (["--top-p", "0.9"], "--top-p and --top-k narrow sampling, but greedy decoding (--temperature 0, the default) does not "
                         "sample: give --temperature too"),
    (["--format", "text"], "--format text is plain text with no replies to prompt for"),
    (["--format", "preference"], "--format preference holds two replies (chosen, rejected) per prompt, not one reference"),
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


def test_a_preference_set_is_refused_when_auto_finds_it(tmp_path, tok_dir, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "2 + 2 = ?", "chosen": "4", "rejected": "5"}) + "\n")
    argv = args(tok_dir, data, tmp_path / "gen.jsonl")
    argv[argv.index("--format") + 1] = "auto"
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--format preference holds two replies (chosen, rejected) per prompt" in err and "Traceback" not in err


# ------------------------------------------------------------------ bounds and adapters, before anything loads


def nan_adapter(tok_dir, path) -> str:
    """save_adapter's file with one lora_b all NaN, written as a stranger would (save_lora refuses it)."""
    import numpy as np
    import safetensors.numpy

    good = save_adapter(tok_dir, path)
    with open(good, "rb") as f:
        data = f.read()
    from train.adapter_files import lora_file

    meta = lora_file.read_lora_metadata(good)
    tensors = safetensors.numpy.load(data)
    name = sorted(n for n in tensors if n.endswith("_lora_b"))[0]
    tensors[name] = np.full_like(tensors[name], np.nan)
    safetensors.numpy.save_file(tensors, good, metadata=meta)
    return name


@pytest.mark.parametrize("extra, message", [
    (["--max-new-tokens", "1000000000"], "--max-new-tokens 1,000,000,000: that many new tokens exceed tiny's context "
                                         "length of 4,096 tokens; give at most 4,096"),
    # The first look counts the rows --max-prompts allows (the batch is cut to the prompts): the KV
    # cache and, per row, the logits of tiny's 256 tokens and the prefill's activations.
    (["--batch-size", "1000000", "--max-prompts", "1000000", "--max-new-tokens", "256"],
     "--batch-size 1,000,000: the KV cache (183.11 GiB), the logits and activations (7.63 GiB) and the weights (0.87 MiB) "
     "need more than the "),
    (["--seed", str(2**70)], "--seed must be a whole number from 0 to 4,294,967,295, got 1180591620717411303424"),
    (["--seed", "-1"], "--seed must be a whole number from 0 to 4,294,967,295, got -1"),
    (["--weights-seed", str(2**70)], "--weights-seed must be a whole number from 0 to 4,294,967,295"),
])
def test_bounds_are_one_line_before_the_tokenizer_or_model(tmp_path, data, capsys, extra, message):
    # A tokenizer that cannot load: the bound is judged first, so its line is the one said.
    argv = args(tmp_path / "no-tokenizer", data, tmp_path / "gen.jsonl", *extra)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "loading" not in err, err
    assert not (tmp_path / "gen.jsonl").exists()


def test_the_memory_plan_counts_the_longest_prompt(tmp_path, tok_dir, data, capsys):
    """The second look, once the prompts are read: a batch that fits the first guess (no prompt) but
    not with the prompt's bucket is refused before the weights load."""
    from train import generate_bounds
    from train.model import models

    config = models.resolve_config("tiny")
    weights = generate_bounds.weight_bytes(families.by_name("gemma3"), config)
    # 64 rows of 6 new tokens fit; with the prompts' bucket (at least 16 tokens) they do not.
    per_token = 6 * 2 * 1 * 16 * 4
    no_prompt = generate_bounds.activation_bytes(config, prompt_bucket=0, cache_tokens=6, compute_dtype="float32")
    budget = weights + 64 * (6 * per_token + no_prompt) + 1
    generation = generate_bounds.plan(families.by_name("gemma3"), config, batch_size=64, max_new_tokens=6, prompt_tokens=0,
                                      compute_dtype="float32", budget=(budget, "a test budget"))
    generate_bounds.check_memory(generation, 64)
    generation = generate_bounds.plan(families.by_name("gemma3"), config, batch_size=64, max_new_tokens=6, prompt_tokens=20,
                                      compute_dtype="float32", budget=(budget, "a test budget"))
    assert generation.kv_cache_bytes == 64 * (32 + 6) * per_token
    with pytest.raises(generate_bounds.GenerateError, match=r"--batch-size 64: the KV cache .*, the logits and activations "
                                                            r".* more than the .* of a test budget; give --batch-size 4 or less"):
        generate_bounds.check_memory(generation, 64)


def test_the_memory_plan_counts_the_logits_and_activations():
    """Issue 71: the logits ([bucket, V] for the prefill, [V] twice a step, float32), one layer's attention
    scores and MLP activations, per row: with gemma3-270m's 262,144-token vocabulary the logits, not the
    KV cache, are most of a row."""
    from train import generate_bounds
    from train.model import models

    config = models.resolve_config("gemma3-270m")
    vocab, bucket, cache = 262144, 32, 32 + 8
    per_row = generate_bounds.activation_bytes(config, prompt_bucket=bucket, cache_tokens=cache, compute_dtype="bfloat16")
    assert per_row == bucket * vocab * 4 + 2 * vocab * 4 + 4 * bucket * cache * 4 + bucket * 2 * 2048 * 2
    generation = generate_bounds.plan(families.by_name("gemma3"), config, batch_size=3, max_new_tokens=8, prompt_tokens=20,
                                      compute_dtype="bfloat16", budget=(10**12, "a test budget"))
    assert generation.activation_bytes == 3 * per_row > generation.kv_cache_bytes
    assert generation.total_bytes == generation.weight_bytes + generation.kv_cache_bytes + generation.activation_bytes


def test_a_batch_larger_than_the_prompts_is_cut_to_them(tmp_path, tok_dir, data):
    """Issue 71: --batch-size 100000 for 3 prompts padded the batch to 100,000 rows (an out-of-memory
    traceback; 1,000,000 grew past 6 GB): the batch is the prompts', said once, and the run the same."""
    out = tmp_path / "gen.jsonl"
    code, _, err = run_main(args(tok_dir, data, out, "--batch-size", "100000", "--max-new-tokens", "2", "--compile-cache", "off"))
    assert code == 0, err
    assert "--batch-size 100,000 is more than the 3 prompts: one batch of 3" in err and ", 3 per batch" in err
    cut = out.read_bytes()
    code, _, err = run_main(args(tok_dir, data, out, "--batch-size", "3", "--max-new-tokens", "2", "--compile-cache", "off",
                                 "--overwrite"))
    assert code == 0 and "is more than the" not in err and out.read_bytes() == cut


def test_a_non_finite_adapter_is_refused_before_the_model(tmp_path, tok_dir, data, capsys):
    path = tmp_path / "nan.safetensors"
    name = nan_adapter(tok_dir, path)
    assert main(args(tok_dir, data, tmp_path / "gen.jsonl", "--lora", str(path))) == 2
    err = capsys.readouterr().err
    assert f"prepack generate: {path}: tensor {name} is non-finite (NaN/Inf in" in err and "loading" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_truncated_adapter_is_one_line(tmp_path, tok_dir, data, capsys):
    path = save_adapter(tok_dir, tmp_path / "cut.safetensors")
    size = os.path.getsize(path)
    os.truncate(path, size - 100)
    assert main(args(tok_dir, data, tmp_path / "gen.jsonl", "--lora", path)) == 2
    err = capsys.readouterr().err
    assert f"prepack generate: {path}: cannot be read, truncated or corrupt (" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_the_report_recomputes_generates_own_scores_and_agrees(runs, capsys):
    """What generate --score wrote (tool calls read by functiongemma) passes report --generations, which
    reads every exact match and call again from the texts."""
    from apps.report import main as report

    lines = lines_of(runs.out)
    assert lines[0]["score"]["calls"]["parser"] == "functiongemma" and lines[0]["score"]["calls"]["expected"] == 1
    assert report(["--generations", str(runs.out), str(runs.tmp / "tuned.jsonl")]) == 0
    assert "valid call rate" in capsys.readouterr().out
