"""`prepack tokenizer-folder`: Gemma 3's tokenizer as a Hugging Face folder, built from the packaged
GGUF. Its ids must be `--tokenizer gemma3`'s for every text, or Gemma 3 270M's weights would read
other tokens; FunctionGemma's control tokens must each be one id, so a calling turn ends, trains
and stops on `<start_function_response>`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps import tokenizer_folder
from prepack.text import gemma3_gguf, gemma3_hf_folder
from prepack.text.chat import get_chat_format
from prepack.text.chat.prompts import conversation_prompts
from prepack.text.chat.batch import tokenize_conversations
from prepack.text.formats import get_template
from prepack.text.stop_check import StopTokenCheck
from prepack.text.tokenizer import load_tokenizer
from train import families

SAMPLE_DATA = Path(gemma3_gguf.__file__).resolve().parent.parent / "sample_data"
# What SentencePiece treats specially: whitespace runs and newlines (user-defined pieces, some of
# them spaces stored as U+2581), HTML tags (user-defined), control pieces spelled in text (never
# matched), reserved image markers (made control here), digits (split one by one), byte fallback.
EDGE_TEXTS = [
    "a  b   c    d\n\n\ne", "   ", "trailing   ", " leading", "\t\ttabs\t", "x" * 80, "12345 6789.01",
    "<mask> <unused0> <bos> <start_of_turn>user <end_of_turn>", "<start_of_image>[multimodal]<end_of_image>",
    "<table><tr><td>1</td></tr></table> <b>bold</b>", "Ünïcödé 日本語 한국어 😀🧪", "\u0000\u0007\u00a0nbsp",
    "<start_function_call>call:f{a:<escape>x<escape>}<end_function_call>", "",
]


@pytest.fixture(scope="module")
def gemma3():
    return load_tokenizer("gemma3")


@pytest.fixture(scope="module")
def tools_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "gemma3-tools"
    assert tokenizer_folder.main(["--output", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def tools_tok(tools_folder):
    return load_tokenizer(f"hf:{tools_folder}")


def _sample_texts() -> list[str]:
    texts = []

    def walk(v):
        if isinstance(v, str):
            texts.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    for path in sorted(SAMPLE_DATA.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            walk(json.loads(line))
    return texts


def test_folder_encodes_every_text_to_gemma3_ids(gemma3, tools_tok):
    texts = EDGE_TEXTS + _sample_texts()
    assert len(texts) > 500
    assert tools_tok.encode_batch(texts) == gemma3.encode_batch(texts)
    assert tools_tok.vocab_size == gemma3.vocab_size == 262144
    assert (tools_tok.bos_id, tools_tok.eos_id, tools_tok.pad_id) == (gemma3.bos_id, gemma3.eos_id, gemma3.pad_id)
    ids = gemma3.encode("Hello  world\n\nÜ 😀 <b>x</b>")
    assert tools_tok.decode(ids) == gemma3.decode(ids) == "Hello  world\n\nÜ 😀 <b>x</b>"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list("ab Z09\t\n<>/_|éü日😀\u2581") + ["  ", "<b>", "</td>", "<end_of_turn>", "<mask>",
                                                                     "<escape>", "the", " world"]), max_size=30))
def test_folder_matches_gemma3_on_generated_text(gemma3, tools_tok, parts):
    text = "".join(parts)
    assert tools_tok.encode(text) == gemma3.encode(text)


def test_function_tokens_take_the_reserved_slots_and_stay_text_in_data(gemma3, tools_tok):
    for k, token in enumerate(gemma3_hf_folder.FUNCTION_TOKENS):
        slot = gemma3_hf_folder.FUNCTION_TOKEN_SLOTS[k]
        assert tools_tok.token_to_id(token) == gemma3.token_to_id(slot) == 6 + k
        # Spelled inside a record, the markup is ordinary text, as in every other tokenizer here.
        assert len(tools_tok.encode(token)) > 1
    assert tools_tok.identity()["vocab_hash"] != families.by_name("gemma3").vocab_hash


@pytest.fixture(scope="module")
def plain_over_tools(tools_folder, tmp_path_factory):
    """A copy of the tools folder with an older model file and a file of the user's, rebuilt with
    `--template none --no-function-tokens --overwrite` (one build of ~12 s for the two tests below:
    what --no-function-tokens writes does not depend on what the folder held before)."""
    import shutil

    folder = tmp_path_factory.mktemp("tok_overwrite") / "reused"
    shutil.copytree(tools_folder, folder)
    (folder / "tokenizer.model").write_bytes(b"an older sentencepiece model")
    (folder / "README.md").write_text("mine")
    assert tokenizer_folder.main(["--output", str(folder), "--template", "none", "--no-function-tokens", "--overwrite"]) == 0
    return folder


@pytest.fixture(scope="module")
def plain_tok(plain_over_tools):
    return load_tokenizer(f"hf:{plain_over_tools}")  # a 262k-token tokenizer.json: seconds to load


def test_without_function_tokens_the_vocabulary_is_gemma3s(plain_tok, gemma3):
    plain = plain_tok
    assert plain.identity()["vocab_hash"] == gemma3.identity()["vocab_hash"] == families.by_name("gemma3").vocab_hash
    assert plain.chat_template is None


TOOL_RECORD = {
    "tools": [{"type": "function", "function": {"name": "set_timer", "description": "Start a timer",
                                                "parameters": {"type": "object",
                                                               "properties": {"minutes": {"type": "integer"}}}}}],
    "messages": [{"role": "user", "content": "Set a timer for 5 minutes."},
                 {"role": "assistant", "tool_calls": [{"type": "function",
                                                       "function": {"name": "set_timer", "arguments": {"minutes": 5}}}]},
                 {"role": "tool", "name": "set_timer", "content": "started"},
                 {"role": "assistant", "content": "Your timer is running."}]}


def test_calls_train_and_stop_on_one_token_and_prompts_are_the_training_ids(tools_tok):
    fmt = get_chat_format("hf", tools_tok)
    conv = get_template("chat").to_conversations(TOOL_RECORD)[0]
    (example,) = tokenize_conversations([conv], tools_tok, fmt)
    ids, mask = example.input_ids.tolist(), example.loss_mask.tolist()
    response = tools_tok.token_to_id("<start_function_response>")
    assert response in fmt.end_of_turn_ids()
    runs, run = [], []
    for tid, m in zip(ids + [0], mask + [0]):
        if m:
            run.append(tid)
        elif run:
            runs.append(run)
            run = []
    assert [r[-1] for r in runs] == [response, tools_tok.token_to_id("<end_of_turn>")]
    assert tools_tok.decode(runs[0]) == ("<start_function_call>call:set_timer{minutes:5}<end_function_call>"
                                         "<start_function_response>")
    found = StopTokenCheck.for_format(fmt).findings([len(ids)], example.input_ids, example.loss_mask)
    assert found.turns_without_trained_eot.tolist() == [0]
    # generate's prompt for each turn is the packed example's ids up to that turn's first target.
    prompts = conversation_prompts(conv, tools_tok, fmt, all_turns=True)
    starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
    assert [p.prompt_ids.tolist() for p in prompts] == [ids[:s] for s in starts]


def test_bad_options_get_one_line(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    huge = tmp_path / "huge.jinja"
    huge.write_bytes(b"{{ x }}" * (tokenizer_folder.MAX_TEMPLATE_BYTES // 7 + 1))
    cases = [
        (["--output", str(tmp_path / "a"), "--template", str(tmp_path / "missing.jinja")],
         "--template", "no such file"),
        (["--output", str(tmp_path / "b"), "--no-function-tokens"], "--no-function-tokens", "FunctionGemma's control tokens"),
        (["--output", str(taken)], "already exists and is not an empty folder", "--overwrite"),
        (["--output", str(a_file)], "exists and is not a folder", "another --output"),
        # hf:FOLDER reads a local folder; other schemes would become local folders named after them.
        (["--output", "gs://bucket/tok"], "--output 'gs://bucket/tok' is not on this machine", "local folder"),
        (["--output", "s3://bucket/tok"], "--output 's3://bucket/tok'", "only local paths and gs://"),
        (["--output", "gs:/bucket/tok"], "is not a gs:// URL", "gs://BUCKET/FOLDER"),
        (["--output", str(link)], "is a symbolic link", "the folder itself"),
        (["--output", str(tmp_path / "c"), "--template", str(huge)], "--template", "too large for a chat template"),
    ]
    for argv, *words in cases:
        assert tokenizer_folder.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("prepack tokenizer-folder: "), err
        assert all(w in err for w in words), err
    assert (taken / "notes.txt").read_text() == "mine" and sorted(p.name for p in taken.iterdir()) == ["notes.txt"]
    assert not any((tmp_path / name).exists() for name in ("a", "b", "c", "gs:", "s3:"))
    assert not any(elsewhere.iterdir())


def test_overwrite_replaces_every_tokenizer_file_and_keeps_the_rest(plain_over_tools, plain_tok):
    folder = plain_over_tools
    # The old template and model would be read with the new files: both are gone; the user's file stays.
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "tokenizer.json", "tokenizer_config.json"]
    assert plain_tok.chat_template is None
    assert not any(p.name.startswith(".reused.") for p in folder.parent.iterdir())
