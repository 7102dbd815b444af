"""Reasoning traces (`reasoning_content` on an assistant message of a `chat` record): the qwen3
chat format writes them as Qwen3's own chat template does, --train-reasoning decides whether the
think block is trained, formats without think tokens refuse them (never dropped silently)."""
from __future__ import annotations

import json

import pytest

from pipelines.launch.job import run
from pipelines.launch.errors import JobError
from pipelines.options import parse_args
from prepack.text.chat import ChatFormatError, get_chat_format, tokenize_conversations
from prepack.text.conversation import RecordError
from prepack.text.formats import get_template
from prepack.text.tokenizer import load_tokenizer
from testkit.pipeline import IN_PROCESS, write_jsonl

# The assistant branch of Qwen3-0.6B's chat template (tokenizer_config.json), written out here
# for the roles a `chat` record has: the think block only after the last user message, on the
# last message or one with reasoning; history keeps the content alone.
QWEN3_ASSISTANT_LOGIC = (
    "{%- set ns = namespace(last_query_index=messages|length - 1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query_index = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message.role != 'assistant' -%}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{%- set reasoning_content = '' -%}"
    "{%- if message.reasoning_content is defined and message.reasoning_content is not none -%}"
    "{%- set reasoning_content = message.reasoning_content -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + message.content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + message.content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

RECORD = {"messages": [
    {"role": "system", "content": "Think, then answer."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "Two and two make four."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "\n6.", "reasoning_content": "\nThree plus three is six.\n"},
]}


def qwen3_reference(messages) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=QWEN3_ASSISTANT_LOGIC)
    return rendered[0]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


def _targets(tok, fmt, conv) -> str:
    ex = tokenize_conversations([conv], tok, fmt)[0]
    return tok.decode([int(i) for i, m in zip(ex.input_ids, ex.loss_mask) if m])


@pytest.mark.parametrize("train_reasoning", [True, False])
def test_qwen3_writes_the_trace_as_its_template_does(tok, train_reasoning):
    conv = get_template("chat").to_conversations(RECORD)[0]
    fmt = get_chat_format("qwen3", tok, train_reasoning)
    ex = tokenize_conversations([conv], tok, fmt)[0]
    reference = qwen3_reference(RECORD["messages"])
    assert fmt.render(conv) == reference
    assert tok.decode(ex.input_ids.tolist()) == reference
    assert "Two and two" not in reference  # dropped from history, as the template drops it
    block = "<think>\nThree plus three is six.\n</think>\n\n"
    want = "4.<|im_end|>" + (block if train_reasoning else "") + "6.<|im_end|>"
    assert _targets(tok, fmt, conv) == want


def test_a_trained_block_is_tokenized_as_the_rendered_string(tok):
    conv = get_template("chat").to_conversations(RECORD)[0]
    ex = tokenize_conversations([conv], tok, get_chat_format("qwen3", tok, True))[0]
    # The rendered text split on the special tokens and encoded piece by piece, as transformers does.
    import re

    ids = []
    for j, part in enumerate(re.split(r"(<\|im_start\|>|<\|im_end\|>|<think>|</think>)", qwen3_reference(RECORD["messages"]))):
        ids += [tok.token_to_id(part)] if j % 2 else tok.encode(part) if part else []
    assert ex.input_ids.tolist() == ids


@pytest.mark.parametrize("name,tokenizer", [("gemma", "gemma3"), ("chatml", "qwen3")])
def test_formats_without_think_tokens_refuse_a_trace(name, tokenizer):
    conv = get_template("chat").to_conversations(RECORD)[0]
    fmt = get_chat_format(name, load_tokenizer(tokenizer))
    with pytest.raises(ChatFormatError) as info:
        tokenize_conversations([conv], fmt.tokenizer, fmt)
    assert info.value.reason == "reasoning_not_supported"
    assert "carries field 'reasoning_content'" in info.value.message and "--chat-format qwen3" in info.value.message


def test_a_trace_of_the_wrong_type_is_a_record_error():
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": 3}]}
    with pytest.raises(RecordError) as info:
        get_template("chat").to_conversations(bad)
    assert (info.value.reason, info.value.field) == ("wrong_type", "messages[1].reasoning_content")


def test_without_traces_nothing_changes(tok):
    plain = {"messages": [{k: v for k, v in m.items() if k != "reasoning_content"} for m in RECORD["messages"]]}
    conv = get_template("chat").to_conversations(plain)[0]
    yes = tokenize_conversations([conv], tok, get_chat_format("qwen3", tok, True))[0]
    no = tokenize_conversations([conv], tok, get_chat_format("qwen3", tok, False))[0]
    assert yes.input_ids.tolist() == no.input_ids.tolist() and yes.loss_mask.tolist() == no.loss_mask.tolist()
    assert tok.decode(yes.input_ids.tolist()) == qwen3_reference(plain["messages"])


def _pack(args):
    config, beam_args = parse_args(args + ["--no-progress"] + IN_PROCESS)
    return run(config, beam_args)


def test_pack_records_train_reasoning_and_from_tokens_keeps_it(tmp_path):
    data = write_jsonl(str(tmp_path / "r.jsonl"), [RECORD, RECORD | {"messages": RECORD["messages"][:3]}])
    base = ["--input", data, "--format", "chat", "--tokenizer", "qwen3", "--max-length", "256"]
    _pack(base + ["--output", str(tmp_path / "yes")])
    _pack(base + ["--output", str(tmp_path / "no"), "--train-reasoning", "no"])
    yes = json.loads((tmp_path / "yes" / "L256" / "manifest.json").read_text())
    no = json.loads((tmp_path / "no" / "L256" / "manifest.json").read_text())
    assert "train_reasoning" not in yes["options"] and no["options"]["train_reasoning"] == "no"
    assert yes["stats"]["target_tokens"] > no["stats"]["target_tokens"]
    with pytest.raises(JobError, match="--train-reasoning yes differs from the tokenized set's no"):
        _pack(["--from-tokens", str(tmp_path / "no" / "tokens"), "--train-reasoning", "yes", "--max-length", "256",
               "--output", str(tmp_path / "again")])
    _pack(["--from-tokens", str(tmp_path / "no" / "tokens"), "--max-length", "256", "--output", str(tmp_path / "again")])
    again = json.loads((tmp_path / "again" / "L256" / "manifest.json").read_text())
    assert again["options"]["train_reasoning"] == "no" and again["stats"]["target_tokens"] == no["stats"]["target_tokens"]


def test_pack_with_gemma_dead_letters_a_trace(tmp_path):
    data = write_jsonl(str(tmp_path / "r.jsonl"), [RECORD, {"messages": RECORD["messages"][:2] + [{"role": "assistant", "content": "4."}]}])
    _pack(["--input", data, "--format", "chat", "--max-length", "256", "--max-bad-fraction", "0.6", "--output", str(tmp_path / "o")])
    stats = json.loads((tmp_path / "o" / "L256" / "manifest.json").read_text())["stats"]
    assert stats["examples_dropped"] == {"reasoning_not_supported": 1} and stats["examples_written"] == 1


def test_preflight_forecasts_the_trained_block(tmp_path):
    from apps import preflight

    data = write_jsonl(str(tmp_path / "r.jsonl"), [RECORD])
    targets = {}
    for choice in ("yes", "no"):
        out = tmp_path / choice
        assert preflight.main(["--input", data, "--format", "chat", "--tokenizer", "qwen3", "--max-length", "256",
                               "--output", str(out), "--no-plots", "--train-reasoning", choice]) == 0
        targets[choice] = json.loads((out / "preflight.json").read_text())["rows"][0]["target_tokens"]
    tok = load_tokenizer("qwen3")
    block = 2 + len(tok.encode("\nThree plus three is six.\n")) + len(tok.encode("\n\n6.")) - len(tok.encode("6."))
    assert targets["yes"] - targets["no"] == block


def test_the_hf_format_refuses_a_trace_that_spells_a_special_token():
    from prepack.text.chat import HFTemplateFormat
    from test_templates import CHATML_SPECIALS, CHATML_TEMPLATE, ByteTokenizer

    tok = ByteTokenizer(CHATML_SPECIALS, bos_id=None, eos_id=201, chat_template=CHATML_TEMPLATE)
    forged = {"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "yo", "reasoning_content": "x<|im_end|>y"}]}
    with pytest.raises(ChatFormatError) as info:
        HFTemplateFormat(tok).segments(get_template("chat").to_conversations(forged)[0])
    assert info.value.reason == "special_token_in_text"


def test_pack_trains_the_think_block_on_the_final_reply_only(tmp_path, tok):
    """Done when of issue 33, through the job: a Qwen3 record whose two replies both carry
    reasoning_content is written as Qwen3's template renders it (the first trace dropped from
    history), and the row's targets are the first reply, then the final reply with its think
    block: one <think> in the row, after the last user turn, trained under --train-reasoning yes
    and loss 0 under no."""
    from testkit.pipeline import read_shard_set
    from testkit.reference import split_segments

    data = write_jsonl(str(tmp_path / "r.jsonl"), [RECORD])
    think = tok.token_to_id("<think>")
    block = "<think>\nThree plus three is six.\n</think>\n\n"
    for choice in ("yes", "no"):
        _pack(["--input", data, "--format", "chat", "--tokenizer", "qwen3", "--max-length", "256", "--no-tokens",
               "--train-reasoning", choice, "--output", str(tmp_path / choice)])
        manifest, rows = read_shard_set(str(tmp_path / choice / "L256"))
        (seg,) = [s for row in rows for s in split_segments(row)]
        ids, mask = seg.input_ids.tolist(), seg.loss_mask.tolist()
        assert tok.decode(ids) == qwen3_reference(RECORD["messages"])
        assert tok.decode([i for i, m in zip(ids, mask) if m]) == "4.<|im_end|>" + (block if choice == "yes" else "") + "6.<|im_end|>"
        assert ids.count(think) == 1 and "And 3 + 3?" in tok.decode(ids[:ids.index(think)])
        assert mask[ids.index(think)] == (choice == "yes")
        assert "trained_empty_think" not in manifest.stats and "turns_without_trained_eot" not in manifest.stats
