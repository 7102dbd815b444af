"""The stop-token check (prepack/text/stop_check.py): every target assistant turn trains its
end-of-turn token, on every built-in chat format and real tokenizers; a jinja template written
to leave it out is found, and the pack job refuses it unless --allow-untrained-eot."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pipelines.launch.job import run
from pipelines.launch.errors import JobError
from pipelines.options import parse_args
from prepack.packing.accounting import Tally
from prepack.text.chat import (HFTemplateFormat, get_chat_format, tokenize_conversations_flat,
                                       tokenize_prompt_responses_flat)
from prepack.text.stop_check import StopTokenCheck
from prepack.text.conversation import Conversation, Turn
from prepack.text.tokenizer import load_tokenizer
from test_templates import GEMMA_LIKE_TEMPLATE
from testkit.hf_tokenizers import build_hf_dir
from testkit.pipeline import IN_PROCESS, write_jsonl

# Gemma-style, but a model turn is closed by the *next* user turn: the reply's own rendering ends
# at its text, so the target never holds <end_of_turn> (the generation-marker bug of TRL #5988).
DROPS_EOT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}"
    "{{ ('' if loop.first else '<end_of_turn>\\n') + '<start_of_turn>user\\n' + (m['content'] | trim) + '<end_of_turn>\\n' }}"
    "{%- else -%}{{ '<start_of_turn>model\\n' + (m['content'] | trim) }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_KW = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
            "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]}

THREE_TURNS = Conversation((
    Turn("system", "You answer in one sentence."),
    Turn("user", "What is the capital of France?"), Turn("assistant", "Paris is the capital of France."),
    Turn("user", "And of Italy?"), Turn("assistant", "Rome."),
    Turn("user", "Thanks!"), Turn("assistant", "You are welcome, glad to help."),
))
NO_SYSTEM = Conversation(THREE_TURNS.turns[1:])


def _findings(fmt, convs):
    ids, mask, ends = tokenize_conversations_flat(convs, fmt.tokenizer, fmt)
    lens = np.diff(np.asarray(ends), prepend=0)
    return StopTokenCheck.for_format(fmt).findings(lens, ids, mask), ids, mask


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("stop_hf")
    return {"good": build_hf_dir(root / "good", GEMMA_SPECIALS, GEMMA_LIKE_TEMPLATE, **GEMMA_KW),
            "drops_eot": build_hf_dir(root / "drops", GEMMA_SPECIALS, DROPS_EOT_TEMPLATE, **GEMMA_KW)}


@pytest.mark.parametrize("tokenizer,chat_format", [("gemma3", "gemma"), ("qwen3", "chatml"), ("qwen3", "qwen3")])
def test_every_builtin_format_trains_each_end_of_turn(tokenizer, chat_format):
    fmt = get_chat_format(chat_format, load_tokenizer(tokenizer))
    found, ids, mask = _findings(fmt, [THREE_TURNS, NO_SYSTEM])
    assert found.turns_without_trained_eot.tolist() == [0, 0]
    assert found.trained_empty_think.tolist() == [0, 0]
    # Three target runs per example, each closed by the format's end-of-turn id.
    starts = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8)])) == 1)
    assert len(starts) == 6
    # The single-turn fast path too.
    p_ids, p_mask, p_ends = tokenize_prompt_responses_flat(["Hi there"], ["Hello, how can I help?"], fmt.tokenizer, fmt)
    pair = StopTokenCheck.for_format(fmt).findings(np.diff(np.asarray(p_ends), prepend=0), p_ids, p_mask)
    assert pair.turns_without_trained_eot.tolist() == [0]


def test_the_hf_format_with_a_sound_template_passes(hf_dirs):
    fmt = HFTemplateFormat(load_tokenizer(f"hf:{hf_dirs['good']}"))
    found, _, _ = _findings(fmt, [NO_SYSTEM])
    assert found.turns_without_trained_eot.tolist() == [0]


def test_a_template_that_drops_the_end_of_turn_is_found(hf_dirs):
    fmt = HFTemplateFormat(load_tokenizer(f"hf:{hf_dirs['drops_eot']}"))
    one_turn = Conversation(NO_SYSTEM.turns[:2])
    found, _, _ = _findings(fmt, [NO_SYSTEM, one_turn])
    assert found.turns_without_trained_eot.tolist() == [3, 1]


def test_a_trained_empty_think_block_is_counted():
    tok = load_tokenizer("qwen3")
    fmt = get_chat_format("qwen3", tok)
    think, end_think, ime = (tok.token_to_id(t) for t in ("<think>", "</think>", "<|im_end|>"))
    reply = tok.encode("Paris.")
    empty = [think, *tok.encode("\n\n"), end_think, *tok.encode("\n\n"), *reply, ime]
    full = [think, *tok.encode("Let me recall."), end_think, *tok.encode("\n\n"), *reply, ime]
    prompt = tok.encode("user question")
    ids = np.array(prompt + empty + prompt + full, dtype=np.int32)
    mask = np.array([0] * len(prompt) + [1] * len(empty) + [0] * len(prompt) + [1] * len(full), dtype=np.uint8)
    found = StopTokenCheck.for_format(fmt).findings(np.array([len(prompt) + len(empty), len(prompt) + len(full)]), ids, mask)
    assert found.trained_empty_think.tolist() == [1, 0]
    assert found.turns_without_trained_eot.tolist() == [0, 0]


def test_the_tally_counts_findings_and_keeps_the_smallest_example_id():
    a, b = Tally(), Tally()
    a.add_stop_findings(np.array([0, 2]), np.array([0, 0]), ["x/1", "x/9"])
    b.add_stop_findings(np.array([1, 0]), np.array([0, 1]), ["x/3", "x/4"])
    merged = Tally().merge(b).merge(a)
    assert (merged.turns_without_trained_eot, merged.untrained_eot_example) == (3, "x/3")
    assert (merged.trained_empty_think, merged.empty_think_example) == (1, "x/4")
    assert Tally.from_json(merged.to_json()).to_json() == merged.to_json()
    assert "turns_without_trained_eot" not in Tally().to_json()  # a clean run's record is unchanged


def _chat_input(tmp_path):
    records = [{"messages": [{"role": m.role, "content": m.content} for m in NO_SYSTEM.turns]},
               {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]}]
    return write_jsonl(str(tmp_path / "chat.jsonl"), records)


def _pack(args):
    config, beam_args = parse_args(args + ["--no-progress"] + IN_PROCESS)
    return run(config, beam_args)


def test_pack_refuses_a_template_that_drops_the_end_of_turn(tmp_path, hf_dirs):
    args = ["--input", _chat_input(tmp_path), "--format", "chat", "--tokenizer", f"hf:{hf_dirs['drops_eot']}",
            "--chat-format", "hf", "--max-length", "256"]
    with pytest.raises(JobError) as info:
        _pack(args + ["--output", str(tmp_path / "refused")])
    message = str(info.value)
    assert "4 target assistant turn(s) do not train their end-of-turn token (e.g. example 0/chat.jsonl/0)" in message
    assert "--allow-untrained-eot" in message and "\n" not in message
    assert not (tmp_path / "refused" / "L256" / "manifest.json").exists()

    _pack(args + ["--output", str(tmp_path / "allowed"), "--allow-untrained-eot"])
    manifest = json.loads((tmp_path / "allowed" / "L256" / "manifest.json").read_text())
    assert manifest["stats"]["turns_without_trained_eot"] == 4


def test_pack_with_a_sound_template_records_no_finding(tmp_path, hf_dirs):
    _pack(["--input", _chat_input(tmp_path), "--format", "chat", "--tokenizer", f"hf:{hf_dirs['good']}",
           "--chat-format", "hf", "--max-length", "256", "--output", str(tmp_path / "o")])
    stats = json.loads((tmp_path / "o" / "L256" / "manifest.json").read_text())["stats"]
    assert "turns_without_trained_eot" not in stats and stats["examples_written"] == 2


@pytest.mark.parametrize("tokenizer,chat_format,eot", [("gemma3", "gemma", "<end_of_turn>"), ("qwen3", "chatml", "<|im_end|>"),
                                                       ("qwen3", "qwen3", "<|im_end|>")])
def test_pack_passes_the_check_on_every_builtin_format(tmp_path, tokenizer, chat_format, eot):
    """Done when of issue 33, through the job: the shipped chat sample (200 conversations, 131 of
    them multi-turn) packs under every built-in chat format without --allow-untrained-eot, no
    finding is recorded, and the rows train exactly one end-of-turn token per assistant reply (404)."""
    import os

    import prepack
    from testkit.pipeline import read_shard_set

    path = os.path.join(os.path.dirname(prepack.__file__), "sample_data", "sample_chat.jsonl")
    replies = sum(m["role"] == "assistant" for line in open(path, encoding="utf-8") for m in json.loads(line)["messages"])
    _pack(["--input", path, "--format", "chat", "--tokenizer", tokenizer, "--chat-format", chat_format,
           "--max-length", "512", "--no-tokens", "--output", str(tmp_path / "o")])
    manifest, rows = read_shard_set(str(tmp_path / "o" / "L512"))
    assert manifest.stats["examples_written"] == 200
    assert "turns_without_trained_eot" not in manifest.stats and "trained_empty_think" not in manifest.stats
    eot_id = load_tokenizer(tokenizer).token_to_id(eot)
    assert sum(int(((row["input_ids"] == eot_id) & (row["loss_mask"] == 1)).sum()) for row in rows) == replies == 404


# A ChatML template that writes an empty think block into every reply (inside the generation,
# so it is a target): what fw-ai/cookbook #386 trained on.
EMPTY_THINK_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def test_pack_counts_a_template_that_trains_an_empty_think_block(tmp_path, caplog):
    """A jinja template whose replies train `<think>\\n\\n</think>`: the job publishes (it trains
    the end of turn) and records stats.trained_empty_think, one per reply, with a warning naming
    an example."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    tok_dir = build_hf_dir(tmp_path / "tok", specials, EMPTY_THINK_TEMPLATE, eos_token="<|im_end|>",
                           pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<think>", "</think>"])
    import logging

    with caplog.at_level(logging.WARNING):
        _pack(["--input", _chat_input(tmp_path), "--format", "chat", "--tokenizer", f"hf:{tok_dir}", "--chat-format", "hf",
               "--max-length", "256", "--no-tokens", "--output", str(tmp_path / "o")])
    stats = json.loads((tmp_path / "o" / "L256" / "manifest.json").read_text())["stats"]
    assert stats["trained_empty_think"] == 4 and "turns_without_trained_eot" not in stats
    assert "4 trained empty think block(s) (e.g. example 0/chat.jsonl/0)" in caplog.text
