"""--expand-turns: a conversation with k target assistant turns becomes k examples, example i
holding the conversation up to and including reply i as the template renders it there, and
training reply i alone (ids `<id>#<i>`)."""
from __future__ import annotations

import json

import pytest

from pipelines.launch.job import run
from pipelines.options import parse_args
from prepack.text.chat import get_chat_format, tokenize_conversations
from prepack.text.conversation import expand_turns
from prepack.text.formats import get_template
from prepack.text.tokenizer import load_tokenizer
from test_reasoning import qwen3_reference
from testkit.pipeline import IN_PROCESS, write_jsonl

THREE_REPLIES = {"messages": [
    {"role": "system", "content": "Be exact."},
    {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4.", "reasoning_content": "Two twos."},
    {"role": "user", "content": "3 + 3?"}, {"role": "assistant", "content": "6.", "reasoning_content": "Two threes."},
    {"role": "user", "content": "4 + 4?"}, {"role": "assistant", "content": "8.", "reasoning_content": "Two fours."},
]}


@pytest.mark.parametrize("train_reasoning", [True, False])
def test_each_expanded_example_is_the_template_at_that_turn(train_reasoning):
    tok = load_tokenizer("qwen3")
    fmt = get_chat_format("qwen3", tok, train_reasoning)
    conv = get_template("chat").to_conversations(THREE_REPLIES)[0]
    parts = expand_turns(conv)
    assert len(parts) == 3
    messages = THREE_REPLIES["messages"]
    for i, (part, ex) in enumerate(zip(parts, tokenize_conversations(parts, tok, fmt))):
        upto = messages[: 3 + 2 * i]  # system, then i+1 user/assistant pairs
        assert tok.decode(ex.input_ids.tolist()) == qwen3_reference(upto)
        trained = tok.decode([int(t) for t, m in zip(ex.input_ids, ex.loss_mask) if m])
        reply = upto[-1]
        block = f"<think>\n{reply['reasoning_content']}\n</think>\n\n" if train_reasoning else ""
        assert trained == block + reply["content"] + "<|im_end|>"


def test_a_single_reply_expands_to_itself():
    conv = get_template("chat").to_conversations({"messages": THREE_REPLIES["messages"][:3]})[0]
    assert expand_turns(conv) == [conv]


def _pack(args):
    config, beam_args = parse_args(args + ["--no-progress"] + IN_PROCESS)
    return run(config, beam_args)


def test_pack_expands_and_counts_records_and_examples(tmp_path):
    single = {"messages": THREE_REPLIES["messages"][:3]}
    data = write_jsonl(str(tmp_path / "c.jsonl"), [THREE_REPLIES, single, {"messages": "bad"}])
    base = ["--input", data, "--format", "chat", "--tokenizer", "qwen3", "--max-length", "256", "--max-bad-fraction", "0.5"]
    _pack(base + ["--output", str(tmp_path / "whole")])
    _pack(base + ["--output", str(tmp_path / "exp"), "--expand-turns"])
    whole = json.loads((tmp_path / "whole" / "L256" / "manifest.json").read_text())
    exp = json.loads((tmp_path / "exp" / "L256" / "manifest.json").read_text())
    assert exp["options"]["expand_turns"] is True and "expand_turns" not in whole["options"]
    s = exp["stats"]
    assert (s["records_read"], s["examples_read"], s["examples_written"]) == (3, 5, 4)
    assert s["examples_read"] == s["examples_written"] + sum(s["examples_dropped"].values())
    # Reply by reply: the whole record trains the two earlier replies without their blocks, the
    # expanded examples each train their reply with it.
    assert s["target_tokens"] > whole["stats"]["target_tokens"]
    # --from-tokens packs the expanded examples again, and records that they are.
    _pack(["--from-tokens", str(tmp_path / "exp" / "tokens"), "--max-length", "256", "--max-bad-fraction", "0.5",
           "--output", str(tmp_path / "again")])
    again = json.loads((tmp_path / "again" / "L256" / "manifest.json").read_text())
    assert again["options"]["expand_turns"] is True and again["stats"]["target_tokens"] == s["target_tokens"]


def test_the_prepare_stage_names_each_expanded_example():
    from pipelines.preparer import Preparer
    from pipelines.wire.records import TaskMeta
    from prepack.packing.accounting import Tally

    tok = load_tokenizer("qwen3")
    preparer = Preparer([TaskMeta(0, "c.jsonl", "c.jsonl", "c.jsonl")], get_template("chat"), tok,
                        get_chat_format("qwen3", tok), expand_turns=True)
    tally = Tally()
    templated = preparer.template_records(0, [(0, 1, 1, THREE_REPLIES), (1, 2, 1, {"messages": THREE_REPLIES["messages"][:3]})],
                                          tally, [])
    assert [eid for _, eid in templated.metas] == ["0/c.jsonl/0#0", "0/c.jsonl/0#1", "0/c.jsonl/0#2", "0/c.jsonl/1#0"]
    assert (tally.records_read, tally.examples) == (2, 4)


@pytest.mark.parametrize("train_reasoning", ["yes", "no"])
def test_pack_writes_one_example_per_reply_each_training_its_reply(tmp_path, train_reasoning):
    """Done when of issue 33, through the job: a 3-reply Qwen3 conversation under --expand-turns
    is written as 3 segments, segment i the conversation up to reply i as Qwen3's template renders
    it there (reasoning only on that reply), training reply i alone (its block under
    --train-reasoning yes); packed into one row, each stays its own segment with positions from 0."""
    from testkit.pipeline import read_shard_set
    from testkit.reference import split_segments

    tok = load_tokenizer("qwen3")
    data = write_jsonl(str(tmp_path / "c.jsonl"), [THREE_REPLIES])
    _pack(["--input", data, "--format", "chat", "--tokenizer", "qwen3", "--max-length", "512", "--expand-turns",
           "--train-reasoning", train_reasoning, "--no-tokens", "--output", str(tmp_path / "o")])
    manifest, rows = read_shard_set(str(tmp_path / "o" / "L512"))
    messages = THREE_REPLIES["messages"]
    want = []
    for i in range(3):
        upto = messages[: 3 + 2 * i]
        block = f"<think>\n{upto[-1]['reasoning_content']}\n</think>\n\n" if train_reasoning == "yes" else ""
        want.append((qwen3_reference(upto), block + upto[-1]["content"] + "<|im_end|>"))
    got = [(tok.decode(s.input_ids.tolist()), tok.decode([int(t) for t, m in zip(s.input_ids, s.loss_mask) if m]))
           for row in rows for s in split_segments(row)]
    assert sorted(got) == sorted(want)
    assert len(rows) == 1 and manifest.stats["examples_written"] == 3
    (row,) = rows
    for k in (1, 2, 3):
        assert row["positions"][row["segment_ids"] == k].tolist() == list(range(int((row["segment_ids"] == k).sum())))
