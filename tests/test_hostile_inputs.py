"""Inputs nobody checked (issue 24): no record can kill the job, no input can make it read
without bound or hang, and an input that changes mid-run fails it in one line."""

from __future__ import annotations

import json
import os

import pytest

from pipelines import readers
from pipelines.options import OptionsError, parse_args
from pipelines.publish import JobError
from pipelines.records import TaskMeta
from testkit.pipeline import IN_PROCESS, alpaca_records, write_json, write_jsonl

LONE = b'{"instruction": "lone \\ud800 here", "input": "", "output": "ok"}'


def pack(args: list[str]):
    from pipelines.job import run

    config, beam_args = parse_args(args + ["--no-progress"] + IN_PROCESS)
    return run(config, beam_args)


def dead_letters(out, L: int = 256) -> list[dict]:
    path = os.path.join(out, f"L{L}", "dead_letter.jsonl")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- bad_text


@pytest.mark.parametrize("tokenizer", ["gemma3", "qwen3"])
def test_lone_surrogate_is_a_bad_text_dead_letter_with_its_line(tmp_path, tokenizer):
    src = write_jsonl(str(tmp_path / "in.jsonl"), alpaca_records(50), extra_lines=[LONE])
    out = str(tmp_path / "out")
    result = pack(["--input", src, "--format", "alpaca", "--output", out, "--max-length", "256", "--tokenizer", tokenizer,
                   "--max-bad-fraction", "0.1", "--no-tokens"])
    assert result.stats[256]["examples_written"] == 50
    (entry,) = dead_letters(out)
    assert entry["reason"] == "bad_text" and entry["source"]["line"] == 51
    assert "field 'instruction'" in entry["message"] and "lone surrogate" in entry["message"]


def test_lone_surrogate_in_a_json_array_is_a_bad_text_dead_letter(tmp_path):
    src = str(tmp_path / "in.json")
    with open(src, "w") as f:
        f.write(json.dumps(alpaca_records(5))[:-1] + ', {"instruction": "x \\udfff", "output": "y"}]')
    out = str(tmp_path / "out")
    result = pack(["--input", src, "--format", "alpaca", "--output", out, "--max-length", "256",
                   "--max-bad-fraction", "0.5", "--no-tokens"])
    assert result.stats[256]["examples_written"] == 5
    (entry,) = dead_letters(out)
    assert entry["reason"] == "bad_text" and entry["source"]["record"] == 5


@pytest.mark.parametrize("fmt,record", [
    ("alpaca", {"instruction": "lone \ud800 here", "output": "ok"}),  # the single-turn pair path
    ("chat", {"messages": [{"role": "user", "content": "lone \ud800"}, {"role": "assistant", "content": "ok"}]}),
])
def test_a_text_the_tokenizer_refuses_is_dead_lettered_not_a_crash(fmt, record):
    # A record that reached the tokenizer with unencodable text (whatever reader let it by):
    # sentencepiece raises TypeError for the batch; the batch is retried and only it is dropped.
    from pipelines.prepare import Preparer
    from prepack.accounting import Tally

    good = {"alpaca": {"instruction": "say hi", "output": "hi"},
            "chat": {"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}]}}[fmt]
    preparer = Preparer.from_names((TaskMeta(0, "in", "f.jsonl", "f.jsonl"),), fmt, (), "gemma3", "auto")
    items = [(i, i + 1, readers.RAW_OBJECT, record if i == 2 else good) for i in range(5)]
    tally, bad = Tally(), []
    batches = preparer.tokenize(preparer.template_records(0, items, tally, bad), tally, bad)
    assert sum(len(b) for b in batches) == 4
    assert [(entry["reason"], entry["source"]["line"]) for _, entry in bad] == [("bad_text", 3)]
    assert tally.bad_examples["bad_text"] == 1
