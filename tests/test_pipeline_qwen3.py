"""`prepack pack --tokenizer qwen3` end to end on every input format (Beam in-process runner).

Each shard set must hold exactly the examples that the qwen3 tokenizer and the auto chat format
(qwen3 ChatML) give for the records, packed by global BFD, with the tokenizer's identity in
the manifest; rows read back as ChatML with targets on the replies and <|im_end|> only.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from testkit.pipeline import (
    alpaca_records,
    chat_records,
    oasst1_messages,
    prompt_response_records,
    read_shard_set,
    translation_records,
    write_jsonl,
)
from testkit import reference
from prepack.text.chat import tokenize_conversations
from prepack.text.formats import get_template
from prepack.text.formats.oasst1 import oasst1_conversations
from prepack.text.tokenizer import load_tokenizer
from test_pipeline import check_shard_set, pack

IM_START, IM_END, THINK, END_THINK = 151644, 151645, 151667, 151668
# Real-looking text beyond ASCII: Chinese, emoji, digits, an NFD accent (Qwen normalizes to NFC).
EXTRA_ALPACA = [
    {"instruction": "翻译成英文：世界，你好！", "input": "", "output": "Hello, world! 🤗 2026"},
    {"instruction": "Spell cafe\u0301 with one accent.", "input": "  leading spaces", "output": "\n\ncaf\u00e9"},
]


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer("qwen3")


def qwen3_examples(tok, template_name: str, records: list, **options) -> list:
    template = get_template(template_name, **options)
    return tokenize_conversations([c for r in records for c in template.to_conversations(r)], tok, "auto")


def check_qwen3_rows(folder: str, tok, expected: list, max_length: int) -> list:
    manifest, rows = check_shard_set(folder, expected, max_length)
    assert manifest.tokenizer == tok.identity()
    assert manifest.tokenizer["vocab_size"] == 151_669 and manifest.tokenizer["special_ids"]["<|im_end|>"] == IM_END
    for row in rows:
        for seg in reference.split_segments(row):
            ids, mask = seg.input_ids.tolist(), seg.loss_mask.tolist()
            assert ids[0] == IM_START and ids.count(THINK) == 1 and ids.count(END_THINK) == 1
            # Every target run ends on <|im_end|>, and the think block is never a target.
            targets = [i for i, m in zip(ids, mask) if m]
            assert targets[-1] == IM_END and THINK not in targets and END_THINK not in targets
            assert ids[ids.index(END_THINK) + 1] == 271  # "\n\n"
    return rows


def test_alpaca(qwen3, tmp_path):
    records = alpaca_records(30) + EXTRA_ALPACA
    path = write_jsonl(str(tmp_path / "alpaca.jsonl"), records)
    pack(["--input", path, "--format", "alpaca", "--tokenizer", "qwen3", "--output", str(tmp_path / "out"),
          "--max-length", "128", "256"])
    expected = qwen3_examples(qwen3, "alpaca", records)
    for length in (128, 256):
        check_qwen3_rows(str(tmp_path / "out" / f"L{length}"), qwen3, expected, length)
    manifest, rows = read_shard_set(str(tmp_path / "out" / "L256"))
    text = "".join(qwen3.decode(r["input_ids"][r["valid_mask"] == 1]) for r in rows)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nHello, world! 🤗 2026<|im_end|>" in text
    assert "<think>\n\n</think>\n\ncafé<|im_end|>" in text  # NFC, and the reply's leading newlines dropped


def test_translation(qwen3, tmp_path):
    path = write_jsonl(str(tmp_path / "pairs.jsonl"), translation_records())
    pack(["--input", path, "--format", "translation", "--source-lang", "en", "--target-lang", "de",
          "--tokenizer", "qwen3", "--output", str(tmp_path / "out"), "--max-length", "128"])
    expected = qwen3_examples(qwen3, "translation", translation_records(), source_lang="en", target_lang="de")
    assert len(check_qwen3_rows(str(tmp_path / "out" / "L128"), qwen3, expected, 128)) >= 1


def test_oasst1(qwen3, tmp_path):
    path = write_jsonl(str(tmp_path / "oasst1.jsonl"), oasst1_messages())
    result = pack(["--input", path, "--format", "oasst1", "--tokenizer", "qwen3", "--output", str(tmp_path / "out"),
                   "--max-length", "256", "--max-bad-fraction", "0.5"])
    assert result.stats[256]["examples_written"] == 4
    convs = [c for c, _ in oasst1_conversations(oasst1_messages())]
    check_qwen3_rows(str(tmp_path / "out" / "L256"), qwen3, tokenize_conversations(convs, qwen3, "auto"), 256)


def test_chat(qwen3, tmp_path):
    path = write_jsonl(str(tmp_path / "chat.jsonl"), chat_records())
    pack(["--input", path, "--format", "chat", "--tokenizer", "qwen3", "--output", str(tmp_path / "out"),
          "--max-length", "128"])
    expected = qwen3_examples(qwen3, "chat", chat_records())
    rows = check_qwen3_rows(str(tmp_path / "out" / "L128"), qwen3, expected, 128)
    # Multi-turn records: both replies are targets, only the last one has the think block.
    multi = [s for r in rows for s in reference.split_segments(r) if np.count_nonzero(s.input_ids == IM_START) == 5]
    assert multi and all(int(np.count_nonzero(s.loss_mask[s.input_ids == IM_END])) == 2 for s in multi)


def test_prompt_response_unpacked(qwen3, tmp_path):
    records = prompt_response_records()
    path = write_jsonl(str(tmp_path / "pr.jsonl"), records)
    result = pack(["--input", path, "--format", "prompt_response", "--tokenizer", "qwen3",
                   "--output", str(tmp_path / "out"), "--max-length", "128", "--no-pack"])
    assert result.stats[128]["rows"] == result.stats[128]["examples_written"] == 15
    check_qwen3_rows(str(tmp_path / "out" / "L128"), qwen3, qwen3_examples(qwen3, "prompt_response", records), 128)
    with open(tmp_path / "out" / "L128" / "manifest.json") as f:
        assert json.load(f)["tokenizer"]["name"] == "qwen3"
