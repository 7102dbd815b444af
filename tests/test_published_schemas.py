"""Every published schema of the "real datasets" issue packs with no conversion script, and the
trained tokens are exactly what the model writes: the assistant's text, its tool calls and the
end-of-turn token closing each trained turn (never system, user, tools or tool results).

The inputs are testkit/published_schemas.py; the expected targets are written out here, decoded
from the published rows with Qwen3's real tokenizer (offline), and `prepack verify` passes on each
set. `--format auto` picks each schema's format from its keys.
"""
from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest

from pipelines.options import parse_args
from prepack.text.formats.detect import FormatGuessError, detect, mismatch
from prepack.text.qwen3_bpe import SPECIAL_TOKENS
from prepack.text.tokenizer import load_tokenizer
from testkit.pipeline import IN_PROCESS, read_shard_set, write_jsonl
from testkit.published_schemas import SCHEMAS
from testkit.reference import split_segments

L = 512
CALL = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'

# What each schema trains, as the decoded runs of targets, over all its examples.
EXPECTED = {
    "sharegpt_tools": [
        CALL.format("generate_invoice", '{"customer": "Ada Lovelace", "total": 42.5}') + "<|im_end|>",
        "Invoice INV-7 for Ada Lovelace (42.5) is created.<|im_end|>",
        CALL.format("generate_password", '{"length": 8}') + "\n" + CALL.format("generate_password", '{"length": 12}')
        + "<|im_end|>",
        "Here they are: k3J9xq2L and pQ7zR1tV0wYb.<|im_end|>",
        "I would, but I can only make invoices and passwords.<|im_end|>",
    ],
    "functiongemma": [
        CALL.format("get_weather", '{"city": "Lisbon"}') + "<|im_end|>",
        CALL.format("get_time", '{"city": "Tokyo"}') + "\n" + CALL.format("get_time", '{"city": "Oslo"}') + "<|im_end|>",
    ],
    "parts_loss_weight": ["Rome<|im_end|>", "C-A-T<|im_end|>"],
    "reasoning_tools": [
        "<think>\nRain depends on the weather; ask the tool.\n</think>\n\n" + CALL.format("get_weather", '{"city": "Bergen"}')
        + "<|im_end|>",
        "<think>\nIt rains there.\n</think>\n\nYes, it is raining in Bergen.<|im_end|>",
    ],
    "prompt_completion": ["blue.<|im_end|>", "Bonjour !<|im_end|>"],
    "own_columns": ["7<|im_end|>"],
}


def pack(args: list[str]):
    from pipelines.launch.job import run

    config, beam_args = parse_args(args + ["--no-progress", *IN_PROCESS])
    return run(config, beam_args)


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer("qwen3")


def decoded(tok, ids) -> str:
    specials = {tok.token_to_id(t): t for t in SPECIAL_TOKENS}
    out, plain = [], []
    for tid in ids:
        if tid in specials:
            out.append(tok.decode(plain) + specials[tid])
            plain = []
        else:
            plain.append(tid)
    return "".join(out) + tok.decode(plain)


def target_runs(tok, rows) -> list[str]:
    runs = []
    for row in rows:
        for seg in split_segments(row):
            mask = np.asarray(seg.loss_mask)
            ids = np.asarray(seg.input_ids)
            edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
            runs += [decoded(tok, ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]
    return runs


def verify(path: str) -> int:
    from apps.verify import main

    return main([path])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_schema_packs_and_trains_exactly_the_replies_and_calls(tmp_path, qwen3, name):
    schema = SCHEMAS[name]
    data = write_jsonl(str(tmp_path / f"{name}.jsonl"), schema.records)
    out = str(tmp_path / "out")
    result = pack(["--input", data, *schema.args(), "--tokenizer", "qwen3", "--max-length", str(L), "--output", out])
    assert result.stats[L]["examples_read"] == result.stats[L]["examples_written"] == len(schema.records)
    _, rows = read_shard_set(os.path.join(out, f"L{L}"))
    assert Counter(target_runs(qwen3, rows)) == Counter(EXPECTED[name])
    assert verify(os.path.join(out, f"L{L}")) == 0


@pytest.mark.parametrize("tokenizer,bos", [("qwen3", False), ("gemma3", True)])
def test_text_documents_train_every_token_but_the_first_and_end_with_eos(tmp_path, tokenizer, bos):
    tok = load_tokenizer(tokenizer)
    schema = SCHEMAS["text"]
    data = write_jsonl(str(tmp_path / "text.jsonl"), schema.records)
    out = str(tmp_path / "out")
    pack(["--input", data, "--format", "text", "--tokenizer", tokenizer, "--max-length", "64", "--output", out])
    _, rows = read_shard_set(os.path.join(out, "L64"))
    segments = [seg for row in rows for seg in split_segments(row)]
    assert len(segments) == len(schema.records)
    texts = {r["text"] for r in schema.records}
    for seg in segments:
        ids = np.asarray(seg.input_ids).tolist()
        assert ids[-1] == tok.eos_id
        assert (ids[0] == tok.bos_id) is bos
        body = ids[1:-1] if bos else ids[:-1]
        assert tok.decode(body) in texts
        assert np.asarray(seg.loss_mask).tolist() == [0] + [1] * (len(ids) - 1)


def test_a_mixture_of_every_schema_packs_and_preflights(tmp_path, qwen3):
    sources = []
    sft = {name: schema for name, schema in SCHEMAS.items() if schema.format != "preference"}  # pairs pack apart
    for name, schema in sorted(sft.items()):
        data = write_jsonl(str(tmp_path / f"{name}.jsonl"), schema.records)
        maps = "".join(f", {k}: {{{', '.join(f'{c}: {v}' for c, v in (p.split('=') for p in schema.options[k].split(',')))}}}"
                       for k in ("columns", "roles") if k in schema.options)
        sources.append(f"  - {{name: {name.replace('_', '-')}, input: {data}, format: {schema.format}, "
                       f"weight: {len(schema.records)}{maps}}}")
    mix = tmp_path / "mix.yaml"
    mix.write_text("weight_of: examples\nsources:\n" + "\n".join(sources) + "\n")
    out = str(tmp_path / "out")
    result = pack(["--mixture", str(mix), "--tokenizer", "qwen3", "--max-length", str(L), "--output", out])
    total = sum(len(s.records) for s in sft.values())
    assert result.stats[L]["examples_written"] == total
    _, rows = read_shard_set(os.path.join(out, f"L{L}"))
    runs = Counter(target_runs(qwen3, rows))
    assert sum(runs[r] for e in EXPECTED.values() for r in e) == sum(len(e) for e in EXPECTED.values())
    assert verify(os.path.join(out, f"L{L}")) == 0

    from apps.preflight import main as preflight

    assert preflight(["--mixture", str(mix), "--tokenizer", "qwen3", "--max-length", str(L), "--batch-size", "4",
                      "--output", str(tmp_path / "pf"), "--no-plots"]) == 0
    report = json.loads((tmp_path / "pf" / "preflight.json").read_text())
    assert report["rows"]


def test_auto_picks_each_schemas_format_and_refuses_two():
    for name, schema in SCHEMAS.items():
        assert detect(schema.records, schema.options) == schema.format, name
    with pytest.raises(FormatGuessError, match=r"^--format auto: the records \(keys prompt, response, completion\) fit "
                                               r"prompt_completion and prompt_response; name one with --format$"):
        detect([{"prompt": "p", "response": "r", "completion": "c"}])
    # oasst1's columns include text's: the more specific wins.
    assert detect([{"message_id": "m", "message_tree_id": "t", "role": "prompter", "text": "hi"}]) == "oasst1"


def test_records_in_another_format_fail_at_once_naming_keys_and_what_to_try():
    sharegpt = SCHEMAS["sharegpt_tools"].records
    assert mismatch("chat", sharegpt) == ("records have keys conversations, tools, system, not the messages of format 'chat': "
                                          "try --format sharegpt")
    own = SCHEMAS["own_columns"].records
    assert mismatch("chat", own) == ("records have keys dialog, functions, sys, not the messages of format 'chat'; "
                                     "try --format chat --columns messages=dialog,role=speaker,content=text")
    assert mismatch("alpaca", [{"body": "a document"}]) == ("records have keys body, not the instruction, output of format "
                                                            "'alpaca'; try --format text --columns text=body")
    assert mismatch("chat", own, {"columns": SCHEMAS["own_columns"].options["columns"]}) is None


def test_pack_refuses_a_file_in_another_format_before_any_work(tmp_path, capsys):
    from pipelines.launch import cli

    data = write_jsonl(str(tmp_path / "glaive.jsonl"), SCHEMAS["sharegpt_tools"].records)
    assert cli.main(["--input", data, "--format", "chat", "--max-length", "64", "--output", str(tmp_path / "o"),
                     "--no-progress", *IN_PROCESS]) == 2  # refused before any work
    assert capsys.readouterr().err == (f"prepack pack: {data}: records have keys conversations, tools, system, not the "
                                       "messages of format 'chat': try --format sharegpt\n")
    assert not os.path.exists(tmp_path / "o")


def test_pack_auto_says_what_it_chose(tmp_path, capsys):
    from pipelines.launch import cli

    data = write_jsonl(str(tmp_path / "fg.jsonl"), SCHEMAS["functiongemma"].records)
    out = tmp_path / "o"
    assert cli.main(["--input", data, "--format", "auto", "--tokenizer", "qwen3", "--max-length", "512", "--output",
                     str(out), "--no-progress", *IN_PROCESS]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"prepack pack: --format auto: chat for {data} (keys tools, messages)\n")
    manifest = json.loads((out / "L512" / "manifest.json").read_text())
    assert manifest["options"]["format"] == "chat"


@pytest.mark.parametrize("args,message", [
    (["--format", "chat", "--columns", "foo=bar"], "--columns: unknown name 'foo'; expected one of chosen, completion, content,"),
    (["--format", "alpaca", "--columns", "messages=dialog"],
     "--columns of format 'alpaca': unknown name 'messages'; expected one of instruction, input, output"),
    (["--format", "alpaca", "--roles", "assistant=bot"], "source format 'alpaca' does not take option(s) roles; accepted: columns"),
    (["--format", "chat", "--columns", "messages"], "--columns: expected NAME=VALUE pairs separated by commas"),
    (["--format", "chat", "--columns", "content=a,role=a"], "--columns of format 'chat': content and role both read 'a'"),
    (["--format", "chat", "--roles", "user=x,assistant=x"], "--roles: the value 'x' is mapped to two roles"),
    (["--format", "chat", "--roles", "bot=assistant"], "--roles: unknown name 'bot'; expected one of system, user, assistant, "
                                                       "tool_call, tool"),
])
def test_bad_column_and_role_options_are_one_line(tmp_path, args, message):
    from pipelines.options import OptionsError

    with pytest.raises(OptionsError) as info:
        parse_args(["--input", str(tmp_path / "x.jsonl"), *args, "--output", str(tmp_path / "o")])
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("entry,message", [
    ("columns: [dialog]", "columns must be a mapping of 1 to 64 names (e.g. columns: {messages: dialog}), got an array"),
    ("columns: {messages: 5}", "columns names must be strings of 1 to 200 characters without ',' or '=', got"),
    ("columns: {messages: 'a,b'}", "columns names must be strings of 1 to 200 characters without ',' or '='"),
    ("columns: {bogus: x}", "--columns of format 'chat': unknown name 'bogus'; expected one of messages, role, content"),
    ("roles: {assistant: bot, user: bot}", "--roles: the value 'bot' is mapped to two roles"),
])
def test_bad_mappings_in_a_mixture_file_name_file_source_and_field(tmp_path, entry, message):
    from prepack.mixture_file import load_mixture
    from prepack.packing.mixture import MixtureError

    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources:\n  - {{name: talk, input: x.jsonl, format: chat, weight: 1, {entry}}}\n")
    with pytest.raises(MixtureError) as info:
        load_mixture(str(mix))
    assert str(info.value).startswith(f"mixture file {mix}: source 'talk': {message}"), str(info.value)


def test_gemma_refuses_tool_records_and_pack_names_the_way_out(tmp_path, capsys):
    from pipelines.launch import cli

    data = write_jsonl(str(tmp_path / "fg.jsonl"), SCHEMAS["functiongemma"].records)
    assert cli.main(["--input", data, "--format", "chat", "--max-length", "512", "--output", str(tmp_path / "o"),
                     "--no-progress", *IN_PROCESS]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("prepack pack: all 2 examples read are bad records (tools_not_supported 2) (Gemma 3 has no tool "
                           "tokens: pack tool calls with --chat-format hf and the model's own tokenizer and template (e.g. "
                           "FunctionGemma's")


@pytest.mark.slow  # trains: see pytest.ini
def test_tiny_qwen3_trains_on_a_tool_calling_set(tmp_path, capsys):
    import math

    from train import cli as train_cli

    records = SCHEMAS["sharegpt_tools"].records * 4
    data = write_jsonl(str(tmp_path / "tools.jsonl"), records)
    out = str(tmp_path / "out")
    pack(["--input", data, "--format", "sharegpt", "--tokenizer", "qwen3", "--max-length", "256", "--output", out])
    metrics = str(tmp_path / "m.jsonl")
    assert train_cli.main(["--shards", os.path.join(out, "L256"), "--model", "tiny-qwen3", "--batch-size", "1", "--steps", "2",
                           "--log-every", "0", "--metrics-out", metrics]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in open(metrics) if '"loss"' in line]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)


def test_readmes_functiongemma_record_is_read_as_published():
    from pathlib import Path

    from prepack.text.formats import get_template

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("### Your data as published", 1)[1]
    record = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    (conv,) = get_template("chat").to_conversations(record)
    assert conv.turns[0].role == "system" and conv.turns[-1].tool_calls[0].name == "get_weather"
    assert conv.loss_turns == (2,) and conv.tools == tuple(record["tools"])


def test_expand_turns_and_window_replay_the_calls_before_a_reply(tmp_path, qwen3):
    """--expand-turns trains each reply in its own example, the conversation before it (tools block,
    earlier calls and their results) loss 0; --overlong window then cuts the long ones into pieces
    that replay the last N tokens of that prompt: here the earlier call and its result."""
    data = write_jsonl(str(tmp_path / "tools.jsonl"), SCHEMAS["sharegpt_tools"].records)
    common = ["--input", data, "--format", "sharegpt", "--tokenizer", "qwen3", "--expand-turns"]
    whole = pack([*common, "--max-length", "512", "--output", str(tmp_path / "whole")])
    windowed = pack([*common, "--max-length", "256", "--overlong", "window", "--window-context-tokens", "100",
                     "--output", str(tmp_path / "win")])
    assert whole.stats[512]["examples_written"] == 5  # one example per trained reply
    assert windowed.stats[256]["target_tokens"] == whole.stats[512]["target_tokens"]  # each target trained once
    _, rows = read_shard_set(str(tmp_path / "win" / "L256"))
    call, response, ims = (qwen3.token_to_id(t) for t in ("<tool_call>", "<tool_response>", "<|im_start|>"))
    replayed = [seg for row in rows for seg in split_segments(row) if int(seg.input_ids[0]) != ims]
    assert replayed  # pieces that start inside a conversation: the replayed context
    for seg in replayed:
        ids, mask = np.asarray(seg.input_ids), np.asarray(seg.loss_mask)
        first_target = int(np.flatnonzero(mask)[0])
        assert call in ids[:first_target] and response in ids[:first_target]
    assert verify(str(tmp_path / "win" / "L256")) == 0


def test_inspect_shows_calls_results_and_what_is_trained(tmp_path):
    import io

    from apps.inspect import main as inspect

    data = write_jsonl(str(tmp_path / "tools.jsonl"), SCHEMAS["sharegpt_tools"].records[:1])
    out = str(tmp_path / "out")
    pack(["--input", data, "--format", "sharegpt", "--tokenizer", "qwen3", "--max-length", str(L), "--output", out])
    text = io.StringIO()
    assert inspect([os.path.join(out, f"L{L}"), "--rows", "1", "--no-color"], out=text) == 0
    shown = text.getvalue()
    assert '"name": "sharegpt"' in shown  # the template the set was made with
    assert ('[[<tool_call>\n    {"name": "generate_invoice", "arguments": {"customer": "Ada Lovelace", "total": 42.5}}\n'
            '    </tool_call><|im_end|>]]') in shown
    assert '<|im_start|>user\n    <tool_response>\n    {"invoice_id": "INV-7", "status": "created"}\n    </tool_response><|im_end|>' in shown
