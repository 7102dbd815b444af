"""Train/serve parity of the prompt: what `prepack generate` feeds the model is the training
rendering, id for id, on every chat format, tools included.

For each chat format the prompts come from the command's own reading path (apps/generate.py
read_prompts: the job's readers and Preparer, then prepack/text/chat/prompts.py), and must equal
(a) the packed example's ids (the job's prepare stage) up to the first trained token of the same
turn, and (b) what the model's own template writes at inference: Gemma's layout with its
generation prompt `<start_of_turn>model\\n`, Qwen/Qwen3-0.6B's template (tests/fixtures) with
add_generation_prompt (and enable_thinking=False for `qwen3`: its empty think block), and for
`hf` transformers' apply_chat_template(..., add_generation_prompt=True) with the tools.
A prompt without its generation prompt fails (b) (test_a_prompt_without_its_generation_prompt_fails).
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prepack.text.chat import get_chat_format
from prepack.text.chat.prompts import PromptError, target_runs, turn_prompts
from prepack.text.tokenizer import load_tokenizer

QWEN3_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3-0.6b.chat_template.jinja").read_text()

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call(name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


PLAIN = [
    {"messages": [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Parcel."}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "  3+3? "},
                  {"role": "assistant", "content": "6"}]},
]
TOOLS = [
    {"tools": [WEATHER], "messages": [
        {"role": "system", "content": "You can call functions."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris"})]}]},
    {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Oslo"})]},
        {"role": "tool", "name": "get_weather", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny in Oslo."}]},
]


def args_for(path: Path, **kw: Any) -> argparse.Namespace:
    base = dict(input=[str(path)], format="chat", columns=None, roles=None, source_lang=None, target_lang=None,
                prompt_format=None, expand_turns=False, all_turns=False, tfds_data_dir=None)
    base.update(kw)
    return argparse.Namespace(**base)


def command_prompts(tmp_path: Path, records: list[dict], tokenizer: Any, chat_format: Any, **kw: Any) -> list[Any]:
    """The prompts as `prepack generate` reads them."""
    from apps.generate import read_prompts

    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    items, letters, _, _ = read_prompts(args_for(path, **kw), tokenizer, chat_format)
    assert letters == []
    return items


def packed_examples(tmp_path: Path, records: list[dict], tokenizer: Any, chat_format: Any, expand_turns: bool = False) -> dict:
    """example id -> (ids, loss mask), as the job's prepare stage tokenizes them for `prepack pack`."""
    from apps import read_inputs
    from pipelines.preparer import Preparer, Templated
    from prepack.packing.accounting import Tally

    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    metas, tasks = read_inputs.read_tasks(str(path))
    preparer = Preparer(metas, read_inputs.make_template("chat", {}), tokenizer, chat_format, expand_turns=expand_turns)
    tally = Tally()
    out = {}
    from pipelines.inputs.limits import InputLimits

    templated = list(read_inputs.templated(preparer, metas, tasks, tally, InputLimits()))
    for batch in preparer.tokenize(Templated.of(templated), tally, []):
        ends = np.cumsum(batch.examples.lens)
        for k, eid in enumerate(batch.example_ids):
            start = int(ends[k] - batch.examples.lens[k])
            out[eid] = (batch.examples.ids[start:ends[k]], batch.examples.mask[start:ends[k]])
    return out


def assert_prompts_are_packed_prefixes(items: list[Any], packed: dict, all_turns: bool, expanded: bool = False) -> None:
    assert items
    for item in items:
        eid, _, turn = item.id.rpartition("#") if all_turns and not expanded else (item.id, "", "")
        ids, mask = packed[eid]
        runs = target_runs(mask)
        k = int(turn) if turn else len(runs) - 1
        first_trained = runs[k][0]
        assert item.prompt_ids.tolist() == ids[:first_trained].tolist()
        assert item.reference_ids.tolist() == ids[runs[k][0]:runs[k][1]].tolist()
        assert mask[first_trained] == 1 and mask[first_trained - 1] == 0


def split_encode(tokenizer: Any, text: str, specials: list[str]) -> list[int]:
    """A rendered text tokenized as a Hugging Face tokenizer does: split on the special tokens
    first, each run of text between them encoded on its own."""
    pattern = re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
    ids: list[int] = []
    for k, piece in enumerate(pattern.split(text)):
        if k % 2:
            ids.append(tokenizer.token_to_id(piece))
        elif piece:
            ids += tokenizer.encode(piece)
    return ids


def qwen_template_ids(tokenizer: Any, messages: list[dict], tools: list | None, thinking_off: bool) -> list[int]:
    from transformers.utils.chat_template_utils import render_jinja_template

    from prepack.text.qwen3_bpe import SPECIAL_TOKENS

    extra = {"enable_thinking": False} if thinking_off else {}
    (text,), _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=QWEN3_TEMPLATE,
                                       add_generation_prompt=True, **extra)
    return split_encode(tokenizer, text, list(SPECIAL_TOKENS))


# ----------------------------------------------------------------------------------- gemma


@pytest.fixture(scope="module")
def gemma3():
    return load_tokenizer("gemma3")


@pytest.fixture(scope="module")
def qwen3():
    return load_tokenizer("qwen3")


GEMMA_SPECIALS = ["<bos>", "<start_of_turn>", "<end_of_turn>"]


def test_gemma_prompt_is_the_packed_prefix_and_gemmas_generation_prompt(tmp_path, gemma3):
    fmt = get_chat_format("gemma", gemma3)
    items = command_prompts(tmp_path, PLAIN, gemma3, fmt)
    assert_prompts_are_packed_prefixes(items, packed_examples(tmp_path, PLAIN, gemma3, fmt), all_turns=False)
    # Gemma's layout (ai.google.dev/gemma/docs/core/prompt-structure): BOS once, the system text
    # before the first user turn, trimmed turns, and the generation prompt <start_of_turn>model\n.
    expected = ["<bos><start_of_turn>user\nWho are you?<end_of_turn>\n<start_of_turn>model\n",
                "<bos><start_of_turn>user\nBe brief.\n\n2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n"
                "<start_of_turn>user\n3+3?<end_of_turn>\n<start_of_turn>model\n"]
    assert [item.prompt_ids.tolist() for item in items] == [split_encode(gemma3, t, GEMMA_SPECIALS) for t in expected]
    assert [fmt.decode(item.reference_ids) for item in items] == ["I am Parcel.<end_of_turn>", "6<end_of_turn>"]


def test_gemma_every_turn(tmp_path, gemma3):
    fmt = get_chat_format("gemma", gemma3)
    items = command_prompts(tmp_path, PLAIN, gemma3, fmt, all_turns=True)
    assert [i.id.rpartition("/")[2] for i in items] == ["0#0", "1#0", "1#1"]
    assert_prompts_are_packed_prefixes(items, packed_examples(tmp_path, PLAIN, gemma3, fmt), all_turns=True)
    assert fmt.decode(items[1].prompt_ids) == ("<bos><start_of_turn>user\nBe brief.\n\n2+2?<end_of_turn>\n"
                                               "<start_of_turn>model\n")
    # --expand-turns: the same prompts, cut from the expanded examples (one turn each)
    expanded = command_prompts(tmp_path, PLAIN, gemma3, fmt, all_turns=True, expand_turns=True)
    assert [i.id for i in expanded] == [i.id for i in items]
    assert [i.prompt_ids.tolist() for i in expanded] == [i.prompt_ids.tolist() for i in items]
    assert_prompts_are_packed_prefixes(expanded, packed_examples(tmp_path, PLAIN, gemma3, fmt, expand_turns=True),
                                       all_turns=True, expanded=True)


# ----------------------------------------------------------------------------- chatml, qwen3


@pytest.mark.parametrize("name", ["chatml", "qwen3"])
@pytest.mark.parametrize("records", [PLAIN, TOOLS], ids=["plain", "tools"])
def test_chatml_and_qwen3_prompts_are_qwen3s_template(tmp_path, qwen3, name, records):
    fmt = get_chat_format(name, qwen3)
    items = command_prompts(tmp_path, records, qwen3, fmt)
    assert_prompts_are_packed_prefixes(items, packed_examples(tmp_path, records, qwen3, fmt), all_turns=False)
    for item, record in zip(items, records):
        last = max(i for i, m in enumerate(record["messages"]) if m["role"] == "assistant")
        want = qwen_template_ids(qwen3, record["messages"][:last], record.get("tools"), thinking_off=name == "qwen3")
        assert item.prompt_ids.tolist() == want
    if records is TOOLS:
        assert fmt.decode(items[0].reference_ids) == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                                                     '</tool_call><|im_end|>')
        assert [c.name for c in items[0].reference_calls] == ["get_weather"] and items[1].reference_calls == ()


def test_qwen3_every_turn_with_expand_turns_is_qwen3s_template(tmp_path, qwen3):
    """With --expand-turns each turn is rendered as Qwen3 renders it at that point: its generation
    prompt with the empty think block, for every turn."""
    fmt = get_chat_format("qwen3", qwen3)
    records = PLAIN + TOOLS
    items = command_prompts(tmp_path, records, qwen3, fmt, all_turns=True, expand_turns=True)
    assert_prompts_are_packed_prefixes(items, packed_examples(tmp_path, records, qwen3, fmt, expand_turns=True),
                                       all_turns=True, expanded=True)
    wanted = []
    for record in records:
        for i, m in enumerate(record["messages"]):
            if m["role"] == "assistant":
                wanted.append(qwen_template_ids(qwen3, record["messages"][:i], record.get("tools"), thinking_off=True))
    assert [item.prompt_ids.tolist() for item in items] == wanted


# ------------------------------------------------------------------------------------- hf


@pytest.fixture(scope="module")
def functiongemma(tmp_path_factory):
    from testkit.hf_tokenizers import functiongemma_layout_dir

    return functiongemma_layout_dir(tmp_path_factory.mktemp("functiongemma"))


@pytest.mark.parametrize("all_turns", [False, True])
def test_hf_prompts_are_the_templates_generation_prompt_with_tools(tmp_path, functiongemma, all_turns):
    from transformers import AutoTokenizer

    tok = load_tokenizer(f"hf:{functiongemma}")
    fmt = get_chat_format("hf", tok)
    records = PLAIN + TOOLS
    items = command_prompts(tmp_path, records, tok, fmt, all_turns=all_turns)
    assert_prompts_are_packed_prefixes(items, packed_examples(tmp_path, records, tok, fmt), all_turns=all_turns)
    hf = AutoTokenizer.from_pretrained(functiongemma)
    wanted = []
    for record in records:
        turns = [i for i, m in enumerate(record["messages"]) if m["role"] == "assistant"]
        for i in (turns if all_turns else turns[-1:]):
            text = hf.apply_chat_template(record["messages"][:i], tools=record.get("tools"), add_generation_prompt=True,
                                          tokenize=False)
            wanted.append(hf(text, add_special_tokens=False)["input_ids"])
    assert [item.prompt_ids.tolist() for item in items] == wanted
    if all_turns:  # the call's reference ends at FunctionGemma's stop after a call
        call_turn = next(i for i in items if i.id.endswith("3#0"))
        assert fmt.decode(call_turn.reference_ids) == ("<start_function_call>call:get_weather{city:<escape>Oslo<escape>}"
                                                       "<end_function_call><start_function_response>")


def test_a_prompt_without_its_generation_prompt_fails(tmp_path, gemma3, qwen3):
    """The rule's own check can fail: the same example cut one turn header too early (the
    rendering of the conversation up to the user turn, no generation prompt) is neither the
    packed prefix nor the template's prompt."""
    fmt = get_chat_format("qwen3", qwen3)
    (item,) = command_prompts(tmp_path, PLAIN[:1], qwen3, fmt)
    want = qwen_template_ids(qwen3, PLAIN[0]["messages"][:1], None, thinking_off=True)
    assert item.prompt_ids.tolist() == want
    header = qwen3.encode("assistant\n")
    without = want[:len(want) - len(header) - 1 - 4]  # no <|im_start|>assistant\n, no empty think block
    assert qwen3.decode(without).endswith("<|im_end|>\n")
    assert without != item.prompt_ids.tolist()
    with pytest.raises(AssertionError):
        assert_prompts_are_packed_prefixes([type(item)(item.id, np.asarray(without), item.reference_ids)],
                                           packed_examples(tmp_path, PLAIN[:1], qwen3, fmt), all_turns=False)


def test_turns_that_touch_cannot_be_cut():
    ids = np.arange(10)
    mask = np.array([0, 0, 1, 1, 1, 1, 0, 0, 1, 1])
    assert target_runs(mask) == [(2, 6), (8, 10)]
    assert [p.prompt_ids.tolist() for p in turn_prompts(ids, mask, 2, all_turns=True)] == [[0, 1], list(range(8))]
    with pytest.raises(PromptError) as info:
        turn_prompts(ids, mask, 3)
    assert info.value.reason == "turns_not_separable" and "trains 3 turns but its trained tokens form 2 runs" in info.value.message
