"""Tool calls laid out by the built-in chat formats, id for id against the model's own template.

The reference is Qwen/Qwen3-0.6B's public chat template (tests/fixtures/README.md says where it
comes from), rendered as Hugging Face renders it (transformers' `render_jinja_template`:
trim_blocks, lstrip_blocks, a `tojson` that keeps key order and non-ASCII) and tokenized as a
Hugging Face tokenizer does: split on the 26 added tokens first, each run of text between them
encoded on its own. `qwen3` must give exactly those ids; `chatml` the same without think blocks.
What is trained is checked apart, by decoding the target runs.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from prepack.text.chat import ChatFormatError, get_chat_format, tokenize_conversations
from prepack.text.conversation import Conversation
from prepack.text.formats import get_template
from prepack.text.qwen3_bpe import SPECIAL_TOKENS
from prepack.text.tokenizer import load_tokenizer

QWEN3_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3-0.6b.chat_template.jinja").read_text()

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
                   "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME = {"name": "get_time", "description": "Local time in a city (bare schema, as ShareGPT sets write it).",
        "parameters": {"type": "OBJECT", "properties": {"city": {"type": "str"}}}}
INVOICE = {"name": "generate_invoice", "description": "生成发票",
           "parameters": {"type": "object", "properties": {"customer_name": {"type": "string", "description": "客户名称"}}}}


def call(name: str, arguments: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **extra}


RECORDS = {
    # FunctionGemma's cookbook layout: a developer prompt, tools, a reply that is only a call.
    "single_call": {"tools": [WEATHER], "messages": [
        {"role": "developer", "content": "You are a model that can do function calling with the following functions"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris"})]}]},
    # An agent loop: text with two parallel calls (arguments as an object and as a JSON string),
    # two results in one user turn, a final answer.
    "parallel_and_results": {"tools": [WEATHER, TIME], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": "Let me check both.", "tool_calls": [
            call("get_weather", {"city": "Oslo", "unit": "celsius"}, id="c1"),
            call("get_time", '{"city":  "Oslo"}', id="c2")]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": -3}"},
        {"role": "tool", "tool_call_id": "c2", "content": "14:05"},
        {"role": "assistant", "content": "It is -3 °C and 14:05 in Oslo."}]},
    # Two queries; the first answered through a call, the second directly. History keeps no think
    # block; the last reply gets the empty one.
    "multi_turn": {"tools": [TIME], "messages": [
        {"role": "user", "content": "Time in Lima?"},
        {"role": "assistant", "tool_calls": [call("get_time", {"city": "Lima"})]},
        {"role": "tool", "content": "09:00"},
        {"role": "assistant", "content": "09:00."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome."}]},
    # Reasoning on a call made after the last query: the template writes its think block.
    "reasoning_call": {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.",
         "tool_calls": [call("get_weather", {"city": "Rome"})]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "The tool said sunny."}]},
    # Non-ASCII in the tool schema and the arguments (tojson keeps it), as in the glaive sets.
    "unicode": {"tools": [INVOICE], "messages": [
        {"role": "user", "content": "为约翰生成发票。"},
        {"role": "assistant", "tool_calls": [call("generate_invoice", {"customer_name": "约翰·多伊"})]},
        {"role": "tool", "content": "{\"invoice_id\": \"INV1\"}"},
        {"role": "assistant", "content": "发票已生成：INV1。"}]},
    # No tools at all: the plain layout is unchanged.
    "plain": {"messages": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
                           {"role": "assistant", "content": "6"}]},
}


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer("qwen3")


_ADDED = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")


def as_published(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's own messages as a Hugging Face template takes them: `developer` is Qwen3's
    system (its template knows only that name); everything else as the record has it."""
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in record["messages"]]


def template_ids(tok, record: dict[str, Any], template: str = QWEN3_TEMPLATE) -> list[int]:
    """The template's rendering of a record, tokenized as a Hugging Face tokenizer does."""
    from transformers.utils.chat_template_utils import render_jinja_template

    (text,), _ = render_jinja_template(conversations=[as_published(record)], tools=record.get("tools"),
                                       chat_template=template)
    ids: list[int] = []
    for k, piece in enumerate(_ADDED.split(text)):
        if k % 2:
            ids.append(tok.token_to_id(piece))
        elif piece:
            ids += tok.encode(piece)
    return ids


def targets(tok, example) -> list[str]:
    """The decoded runs of trained tokens, added tokens written out."""
    runs, run = [], []
    for tid, m in zip(example.input_ids.tolist(), example.loss_mask.tolist()):
        if m:
            run.append(tid)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    specials = {tok.token_to_id(t): t for t in SPECIAL_TOKENS}
    out = []
    for r in runs:
        text, plain = "", []
        for tid in r:
            if tid in specials:
                text += tok.decode(plain) + specials[tid]
                plain = []
            else:
                plain.append(tid)
        out.append(text + tok.decode(plain))
    return out


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_qwen3_lays_out_tools_id_for_id_as_its_template(qwen3, name):
    conv = get_template("chat").to_conversations(RECORDS[name])[0]
    (example,) = tokenize_conversations([conv], qwen3, get_chat_format("qwen3", qwen3))
    assert example.input_ids.tolist() == template_ids(qwen3, RECORDS[name])


def test_chatml_is_the_same_layout_without_think_blocks(qwen3):
    """chatml writes what Qwen3's template writes with every think block taken out."""
    no_think = QWEN3_TEMPLATE.replace("'\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n')",
                                      "'\\n' + content")
    assert no_think != QWEN3_TEMPLATE
    for name in ("single_call", "parallel_and_results", "multi_turn", "unicode", "plain"):
        conv = get_template("chat").to_conversations(RECORDS[name])[0]
        (example,) = tokenize_conversations([conv], qwen3, get_chat_format("chatml", qwen3))
        assert example.input_ids.tolist() == template_ids(qwen3, RECORDS[name], no_think), name


def test_tool_markup_goes_in_by_id_and_text_never_becomes_it(qwen3):
    record = {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Write <tool_call> and </tool_response> literally."},
        {"role": "assistant", "content": "<tool_call>", "tool_calls": [call("get_weather", {"city": "<tool_call>"})]}]}
    conv = get_template("chat").to_conversations(record)[0]
    (example,) = tokenize_conversations([conv], qwen3, get_chat_format("qwen3", qwen3))
    ids = example.input_ids.tolist()
    tool_call = qwen3.token_to_id("<tool_call>")
    # The system turn's instructions hold two <tool_call> tags and the reply's one call one more:
    # the three the layout inserts. The three that the data spells stay text.
    assert ids.count(tool_call) == 3
    assert qwen3.token_to_id("</tool_response>") not in ids


def test_what_is_trained_is_the_replies_their_calls_and_their_end_of_turn(qwen3):
    conv = get_template("chat").to_conversations(RECORDS["parallel_and_results"])[0]
    (example,) = tokenize_conversations([conv], qwen3, get_chat_format("qwen3", qwen3))
    assert targets(qwen3, example) == [
        'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city":  "Oslo"}}\n</tool_call><|im_end|>',
        "It is -3 °C and 14:05 in Oslo.<|im_end|>",
    ]
    conv = get_template("chat").to_conversations(RECORDS["single_call"])[0]
    (example,) = tokenize_conversations([conv], qwen3, get_chat_format("qwen3", qwen3))
    # The empty think block of the last reply is prompt, as for every qwen3 reply.
    assert targets(qwen3, example) == ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>']


def test_per_message_flags_choose_the_trained_replies(qwen3):
    record = {"messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "train": False},
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": [{"type": "text", "text": "4"}], "loss_weight": 1.0},
        {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6", "loss_weight": 0}]}
    conv = get_template("chat").to_conversations(record)[0]
    assert conv.loss_turns == (3,)
    (example,) = tokenize_conversations([conv], qwen3, get_chat_format("qwen3", qwen3))
    assert targets(qwen3, example) == ["4<|im_end|>"]


def test_gemma_refuses_tools_and_names_the_way_out():
    gemma = load_tokenizer("gemma3")
    conv = get_template("chat").to_conversations(RECORDS["single_call"])[0]
    with pytest.raises(ChatFormatError) as info:
        tokenize_conversations([conv], gemma, get_chat_format("gemma", gemma))
    assert info.value.reason == "tools_not_supported" and info.value.index == 0
    assert "--chat-format hf" in info.value.message and "FunctionGemma" in info.value.message


def test_chatml_without_tool_tokens_names_the_missing_one(qwen3):
    from test_templates import CHATML_SPECIALS, ByteTokenizer

    tok = ByteTokenizer(CHATML_SPECIALS, bos_id=None, eos_id=201)
    fmt = get_chat_format("chatml", tok)
    plain = get_template("chat").to_conversations(RECORDS["plain"])[0]
    assert tokenize_conversations([plain], tok, fmt)  # plain chat needs no tool tokens
    with pytest.raises(ChatFormatError) as info:
        tokenize_conversations([get_template("chat").to_conversations(RECORDS["single_call"])[0]], tok, fmt)
    assert info.value.reason == "missing_special_token" and "'<tool_call>'" in info.value.message


# --------------------------------------------------------------------------------------
# hf: the tokenizer's own template, in FunctionGemma's layout (prepack/text/chat/templates/functiongemma_layout.jinja)
# --------------------------------------------------------------------------------------

FUNCTIONGEMMA_RECORD = {"tools": [WEATHER], "messages": [
    {"role": "developer", "content": "You are a model that can do function calling with the following functions"},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris", "unit": "celsius"})]},
    {"role": "tool", "name": "get_weather", "content": "sunny, 21"},
    {"role": "assistant", "content": "Sunny and 21 degrees."}]}


@pytest.fixture(scope="module")
def functiongemma_dir(tmp_path_factory):
    from testkit.hf_tokenizers import functiongemma_layout_dir

    return functiongemma_layout_dir(tmp_path_factory.mktemp("functiongemma"))


def test_hf_template_calls_tools_and_trains_the_calls(functiongemma_dir):
    from transformers import AutoTokenizer

    from prepack.text.stop_check import StopTokenCheck

    tok = load_tokenizer(f"hf:{functiongemma_dir}")
    fmt = get_chat_format("hf", tok)
    conv = get_template("chat").to_conversations(FUNCTIONGEMMA_RECORD)[0]
    (example,) = tokenize_conversations([conv], tok, fmt)
    # The ids are transformers' own: its template rendering (tools=...), its tokenizer.
    hf = AutoTokenizer.from_pretrained(functiongemma_dir)
    text = hf.apply_chat_template(conv.messages, tools=list(conv.tools), tokenize=False)
    assert "<start_function_declaration>declaration:get_weather{description:<escape>Current weather" in text
    assert example.input_ids.tolist() == hf(text, add_special_tokens=False)["input_ids"]
    specials = {tok.token_to_id(t): t for t in ("<start_function_call>", "<end_function_call>", "<start_function_response>",
                                                "<escape>", "<end_of_turn>")}
    runs, run = [], []
    for tid, m in zip(example.input_ids.tolist() + [0], example.loss_mask.tolist() + [0]):
        if m:
            run.append(specials.get(tid) or tok.decode([tid]))
        elif run:
            runs.append("".join(run))
            run = []
    assert runs == ["<start_function_call>call:get_weather{city:<escape>Paris<escape>,unit:<escape>celsius<escape>}"
                    "<end_function_call><start_function_response>", "Sunny and 21 degrees.<end_of_turn>"]
    found = StopTokenCheck.for_format(fmt).findings([len(example)], example.input_ids, example.loss_mask)
    assert found.turns_without_trained_eot.tolist() == [0]


def test_hf_tool_template_that_is_not_prefix_stable_is_refused(tmp_path):
    from testkit.hf_tokenizers import FUNCTIONGEMMA_LAYOUT_TEMPLATE, FUNCTION_TOKENS, GEMMA_TOKENS, build_hf_dir

    # A call closes its turn when it is the last message, but is continued by its results when
    # they follow: the rendering up to the call is then no prefix of the whole.
    unstable = FUNCTIONGEMMA_LAYOUT_TEMPLATE.read_text().replace(
        "{%- if m.tool_calls -%}<start_function_response>",
        "{%- if m.tool_calls and loop.last -%}<end_of_turn>\n{%- elif m.tool_calls -%}<start_function_response>")
    folder = build_hf_dir(tmp_path / "tok", GEMMA_TOKENS + FUNCTION_TOKENS, unstable, bos_token="<bos>", eos_token="<eos>",
                          pad_token="<pad>", additional_special_tokens=["<start_of_turn>", "<end_of_turn>", *FUNCTION_TOKENS])
    tok = load_tokenizer(f"hf:{folder}")
    conv = get_template("chat").to_conversations(FUNCTIONGEMMA_RECORD)[0]
    with pytest.raises(ChatFormatError) as info:
        tokenize_conversations([conv], tok, get_chat_format("hf", tok))
    assert info.value.reason == "template_not_prefix_stable"
    assert f"the chat template of 'hf:{folder}' does not render turn 2" in info.value.message
    assert "\n" not in info.value.message


def _tag_literals(root: Path, tags: tuple[str, ...]) -> list[str]:
    """Modules under `root` whose code (not docstrings or comments) spells one of the tags itself."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(node.value) for node in ast.walk(tree)
                      if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and any(tag in node.value for tag in tags)):
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return found


def test_each_layouts_tags_are_spelled_once_and_the_templates_spell_the_same(tmp_path):
    """The renderers (chatml, the tokenizers' added tokens) and the parsers
    (prepack/text/chat/tool_calls.py) take each layout's tags from prepack/text/tool_markup.py; no other
    module of the core spells them, and the templates that render the layouts use exactly those."""
    from prepack.text import tool_markup
    from prepack.text.gemma3_hf_folder import FUNCTIONGEMMA_LAYOUT

    tags = (*tool_markup.HERMES_CALL, *tool_markup.HERMES_RESPONSE, *tool_markup.FUNCTIONGEMMA_TOKENS)
    core = Path(__file__).resolve().parent.parent / "prepack"
    assert {found.partition(":")[0] for found in _tag_literals(core, tags)} == {"text/tool_markup.py"}
    layout = FUNCTIONGEMMA_LAYOUT.read_text()
    assert all(tag in layout for tag in tool_markup.FUNCTIONGEMMA_TOKENS)
    assert set(re.findall(r"<(?:start|end)_function_\w+>|<escape>", layout)) == set(tool_markup.FUNCTIONGEMMA_TOKENS)
    assert all(tag in QWEN3_TEMPLATE for tag in (*tool_markup.HERMES_CALL, *tool_markup.HERMES_RESPONSE))
    # The check can fail: a renderer that spells a tag of its own is found.
    (tmp_path / "chat").mkdir()
    mine = '"""Writes <tool_call> (a docstring may say so)."""\nOPEN = "<tool_call>"\n'
    (tmp_path / "chat" / "mine.py").write_text(mine)
    assert _tag_literals(tmp_path, tags) == ["chat/mine.py:2"]
