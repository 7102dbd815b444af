"""The samples the README's walkthrough packs (prepack/sample_data/): each is what generate.py writes,
byte for byte, and every record reads in the format and options the README gives it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import prepack
from prepack.text.formats import get_template

SAMPLES = Path(prepack.__file__).resolve().parent / "sample_data"
# file -> (the README's --format, its options), as the README's commands pack it
README_FORMATS = {
    "sample_held_out.jsonl": ("alpaca", {}),
    "sample_toolcall.jsonl": ("sharegpt", {}),
    "sample_functiongemma.jsonl": ("chat", {}),
    "sample_dialog.jsonl": ("chat", {"columns": "messages=dialog,role=speaker,content=text",
                                     "roles": "user=person,assistant=bot"}),
    "sample_ranking.jsonl": ("preference", {"columns": "prompt=conversations,role=from,content=value",
                                            "roles": "user=human,assistant=gpt"}),
}


def load_generator():
    spec = importlib.util.spec_from_file_location("generate_samples", SAMPLES / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records(name: str) -> list[dict]:
    return [json.loads(line) for line in (SAMPLES / name).read_text(encoding="utf-8").splitlines()]


def test_the_walkthrough_samples_are_their_generators(tmp_path, monkeypatch):
    generate = load_generator()
    for constant in ("HELD_OUT", "TOOLCALL_OUT", "FUNCTIONGEMMA_OUT", "DIALOG_OUT", "RANKING_OUT"):
        monkeypatch.setattr(generate, constant, tmp_path / getattr(generate, constant).name)
    generate.write_held_out(records("sample_sft.jsonl"))
    generate.write_formats()
    for name in README_FORMATS:
        assert (tmp_path / name).read_bytes() == (SAMPLES / name).read_bytes(), name


def test_the_held_out_sample_holds_no_training_record():
    training = {(r["instruction"], r["input"]) for r in records("sample_sft.jsonl")}
    held_out = [(r["instruction"], r["input"]) for r in records("sample_held_out.jsonl")]
    assert len(held_out) == len(set(held_out)) == 12 and not training & set(held_out)


@pytest.mark.parametrize("name", sorted(README_FORMATS))
def test_every_sample_record_reads_in_the_readmes_format(name):
    fmt, options = README_FORMATS[name]
    template = get_template(fmt, **options)
    rows = records(name)
    assert rows and all(template.to_conversations(r) for r in rows)
