"""The embedded Qwen3 tokenizer (`--tokenizer qwen3`): pinned ids from public sources, control
tokens never produced from text, NFC normalization, identity, pickling, error messages.

Pinned ids are copied from published material, never computed by the code under test:
- QWEN_INTEGRATION_*: transformers' tests/models/qwen2/test_tokenization_qwen2.py,
  `test_tokenizer_integration` (expected ids of Qwen/Qwen-tokenizer, the same 151,643 ranks
  that Qwen2, Qwen2.5 and Qwen3 share): English with digits, Chinese with an emoji, and code
  with newlines.
- "Hello world" -> [9707, 1879]: ranks 9707 ("Hello") and 1879 (" world") of qwen.tiktoken.
- Special ids: Qwen/Qwen3-0.6B tokenizer_config.json, added_tokens_decoder.
"""
from __future__ import annotations

import pickle
import unicodedata

import pytest

from prepack.text import qwen3_bpe
from prepack.text.tokenizer import TiktokenTokenizer, Tokenizer, TokenizerError, TokenizerSpec, load_tokenizer

# transformers tests/models/qwen2/test_tokenization_qwen2.py, test_tokenizer_integration.
QWEN_INTEGRATION_EN = (
    "Transformers (formerly known as pytorch-transformers and pytorch-pretrained-bert) provides "
    "general-purpose architectures (BERT, GPT-2, RoBERTa, XLM, DistilBert, XLNet...) for Natural "
    "Language Understanding (NLU) and Natural Language Generation (NLG) with over 32+ pretrained "
    "models in 100+ languages and deep interoperability between Jax, PyTorch and TensorFlow."
)
QWEN_INTEGRATION_EN_IDS = [8963, 388, 320, 69514, 3881, 438, 4510, 27414, 32852, 388, 323, 4510, 27414, 21334, 35722, 1455, 529, 8, 5707, 4586, 58238, 77235, 320, 61437, 11, 479, 2828, 12, 17, 11, 11830, 61437, 64, 11, 1599, 10994, 11, 27604, 321, 33, 529, 11, 29881, 6954, 32574, 369, 18448, 11434, 45451, 320, 45, 23236, 8, 323, 18448, 11434, 23470, 320, 30042, 38, 8, 448, 916, 220, 18, 17, 10, 80669, 4119, 304, 220, 16, 15, 15, 10, 15459, 323, 5538, 94130, 2897, 1948, 619, 706, 11, 5355, 51, 21584, 323, 94986, 13]  # fmt: skip
QWEN_INTEGRATION_ZH = "🤗 Transformers 提供了可以轻松地下载并且训练先进的预训练模型的 API 和工具。使用预训练模型可以减少计算消耗和碳排放，并且节省从头训练所需要的时间和资源。"
QWEN_INTEGRATION_ZH_IDS = [144834, 80532, 93685, 83744, 34187, 73670, 104261, 29490, 62189, 103937, 104034, 102830, 98841, 104034, 104949, 9370, 5333, 58143, 102011, 1773, 37029, 98841, 104034, 104949, 73670, 101940, 100768, 104997, 33108, 100912, 105054, 90395, 100136, 106831, 45181, 64355, 104034, 113521, 101975, 33108, 85329, 1773]  # fmt: skip
QWEN_INTEGRATION_CODE = '```python\ntokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen-tokenizer")\ntokenizer("世界，你好！")```'
QWEN_INTEGRATION_CODE_IDS = [73594, 12669, 198, 85593, 284, 8979, 37434, 6387, 10442, 35722, 445, 48, 16948, 45274, 16948, 34841, 3135, 1138, 85593, 445, 99489, 3837, 108386, 6313, 899, 73594]  # fmt: skip

# Qwen/Qwen3-0.6B tokenizer_config.json, added_tokens_decoder (ids 151643..151668).
QWEN3_SPECIAL_IDS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646, "<|object_ref_end|>": 151647, "<|box_start|>": 151648, "<|box_end|>": 151649,
    "<|quad_start|>": 151650, "<|quad_end|>": 151651, "<|vision_start|>": 151652, "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654, "<|image_pad|>": 151655, "<|video_pad|>": 151656,
    "<tool_call>": 151657, "</tool_call>": 151658, "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662, "<|repo_name|>": 151663, "<|file_sep|>": 151664,
    "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667, "</think>": 151668,
}

# sha256 over the Qwen3 vocabulary (pieces in Hugging Face's byte-level spelling, id order) as
# defined by prepack.text.tokenizer.vocab_hash. Manifests record it: change it only on purpose.
QWEN3_VOCAB_HASH = "2b126ad4a1742c536099a31874320a4da38b49ec91d85e3e219374d897a44566"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("qwen3")


@pytest.mark.parametrize(
    "text, ids",
    [
        ("Hello world", [9707, 1879]),
        (QWEN_INTEGRATION_EN, QWEN_INTEGRATION_EN_IDS),  # " 32+" -> 220, 18, 17, 10: digits one by one
        (QWEN_INTEGRATION_ZH, QWEN_INTEGRATION_ZH_IDS),  # 🤗 -> 144834, Chinese, full-width punctuation
        (QWEN_INTEGRATION_CODE, QWEN_INTEGRATION_CODE_IDS),  # "\n" -> 198
    ],
    ids=["hello", "english-digits", "chinese-emoji", "code-newline"],
)
def test_qwen3_pinned_ids(tok: Tokenizer, text: str, ids: list[int]) -> None:
    assert tok.encode(text) == ids
    assert tok.encode_batch([text, "Hello world"]) == [ids, [9707, 1879]]
    assert tok.decode(ids) == text


def test_qwen3_digits_split_one_by_one(tok: Tokenizer) -> None:
    # " 100+" from the integration test is 220 (" "), 16 ("1"), 15 ("0"), 15, 10 ("+").
    assert tok.encode(" 100+") == [220, 16, 15, 15, 10]
    assert tok.encode("2026") == [17, 15, 17, 21]


def test_qwen3_leading_spaces_and_newlines(tok: Tokenizer) -> None:
    # The pattern's `\s+(?!\S)` leaves one space to the word after a run of spaces, and
    # `\s*[\r\n]+` keeps a run of newlines as one pre-token.
    assert tok.encode("  Hello world") == [220] + tok.encode(" Hello world")
    assert tok.encode("Hello\nworld")[1] == 198
    assert tok.decode(tok.encode("\n\n  x\r\n")) == "\n\n  x\r\n"


def test_qwen3_special_ids(tok: Tokenizer) -> None:
    assert tok.special_ids == QWEN3_SPECIAL_IDS
    assert {t: tok.token_to_id(t) for t in QWEN3_SPECIAL_IDS} == QWEN3_SPECIAL_IDS
    assert {tok.id_to_token(i): i for i in QWEN3_SPECIAL_IDS.values()} == QWEN3_SPECIAL_IDS
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (None, 151645, 151643)
    assert tok.vocab_size == 151_669


@pytest.mark.parametrize("token", sorted(QWEN3_SPECIAL_IDS))
def test_qwen3_special_strings_are_plain_text(tok: Tokenizer, token: str) -> None:
    ids = tok.encode(f"a {token} b")
    assert tok.encode_batch([f"a {token} b"]) == [ids]
    assert not set(ids) & set(QWEN3_SPECIAL_IDS.values())
    assert tok.decode(ids) == f"a {token} b"


def test_qwen3_reserved_pieces_never_come_from_text(tok: Tokenizer) -> None:
    """Qwen3 reserves its added tokens (chat, vision, tool and think markers): every one listed,
    and none comes from text, alone, run together or in a batch."""
    reserved = tok.reserved_ids()
    assert reserved == QWEN3_SPECIAL_IDS
    text = "x " + " ".join(reserved) + " y " + "".join(reserved)
    for ids in (tok.encode(text), tok.encode_batch([text])[0]):
        assert not set(reserved.values()) & set(ids)
    assert tok.decode(tok.encode(text)) == text


def test_qwen3_applies_nfc(tok: Tokenizer) -> None:
    # transformers' test_nfc_normalization for Qwen2: the NFD form of three characters whose
    # four normal forms all differ; Qwen normalizes with NFC only.
    nfd, nfc = "\u03d2\u0301\u03d2\u0308\u017f\u0307", "\u03d3\u03d4\u1e9b"
    assert unicodedata.normalize("NFC", nfd) == nfc
    assert tok.encode(nfd) == tok.encode(nfc)
    assert tok.encode("e\u0301") == tok.encode("\u00e9")
    assert tok.decode(tok.encode(nfd)) == nfc


def test_qwen3_pieces_are_byte_level_strings(tok: Tokenizer) -> None:
    assert tok.id_to_token(1879) == "\u0120world"
    assert tok.token_to_id("\u0120world") == 1879
    assert tok.id_to_token(198) == "\u010a"
    assert tok.token_to_id("no such piece") is None
    with pytest.raises(IndexError, match="out of range"):
        tok.id_to_token(151_669)


def test_qwen3_identity(tok: Tokenizer) -> None:
    ident = tok.identity()
    assert ident["name"] == "qwen3"
    assert ident["vocab_size"] == 151_669
    assert ident["special_ids"] == QWEN3_SPECIAL_IDS
    assert ident["vocab_hash"] == QWEN3_VOCAB_HASH
    assert (ident["bos_id"], ident["eos_id"], ident["pad_id"]) == (None, 151645, 151643)


def test_qwen3_pickle_reloads(tok: Tokenizer) -> None:
    blob = pickle.dumps(tok)
    assert len(blob) < 1000
    again = pickle.loads(blob)
    assert isinstance(again, TiktokenTokenizer)
    assert again.encode(QWEN_INTEGRATION_ZH) == QWEN_INTEGRATION_ZH_IDS


def test_qwen3_spec() -> None:
    assert TokenizerSpec.parse(" qwen3 ") == TokenizerSpec("qwen3", "qwen3")


def test_qwen3_damaged_ranks_file_is_named(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "qwen.tiktoken"
    bad.write_bytes(b"SGVsbG8= 9707\nnot-a-line\n")
    monkeypatch.setattr(qwen3_bpe, "ranks_path", lambda: bad)
    qwen3_bpe.load_ranks.cache_clear()
    try:
        with pytest.raises(TokenizerError, match=r"tokenizer 'qwen3': .*qwen.tiktoken line 2: not a 'base64 rank' line.*reinstall qwen-tokenizer"):
            load_tokenizer("qwen3")
        bad.write_bytes(b"SGVsbG8= 9707\n")
        qwen3_bpe.load_ranks.cache_clear()
        with pytest.raises(TokenizerError, match=r"expected ranks 0\.\.151642, found 1 tokens"):
            load_tokenizer("qwen3")
    finally:
        qwen3_bpe.load_ranks.cache_clear()
