"""A Hugging Face tokenizer folder for Gemma 3, built offline from the packaged GGUF, for chat
format `hf` (`--tokenizer hf:FOLDER --chat-format hf`): tool-calling templates such as
FunctionGemma's need the tokenizer's own jinja template, and an offline machine cannot download
a Gemma 3 folder from the Hub.

The folder encodes every text to the same ids as `--tokenizer gemma3` (tests/test_gemma3_hf_folder.py
checks it on the shipped samples, edge cases and generated text): both are built from one reading of the GGUF arrays
(gemma3_gguf.sentencepiece_pieces). SentencePiece's BPE becomes a `tokenizers` BPE the way
transformers' GemmaConverter does it (merges ranked by piece score, byte fallback, spaces as
U+2581, no pre-split but at spaces), without the protobuf round trip that converter needs
(sentencepiece's generated code wants protobuf 7; apache-beam pins 6).

FunctionGemma (ai.google.dev/gemma/docs/functiongemma) is Gemma 3 270M tuned with seven control
tokens for tool use (three marker pairs and `<escape>`). With `function_tokens`, they take the first seven
reserved `<unusedN>` slots (ids 6-12; FunctionGemma's own ids may differ): each is then one id, so
`<start_function_response>` can end a turn and stop generation, and the template's markup can
never be spelled by data (chat format `hf` refuses a record that does). Their embedding rows are
the base model's reserved rows (as long as any other row in the GGUF, not zero), which a LoRA
learns to emit like any other (docs/benchmarks.md: 100% valid calls after tuning).
Without `function_tokens` the folder's vocabulary is exactly Gemma 3's (the same vocab_hash).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prepack.text import gemma3_gguf
from prepack.text.tool_markup import FUNCTIONGEMMA_TOKENS

__all__ = ["FUNCTION_TOKENS", "FUNCTION_TOKEN_SLOTS", "FUNCTIONGEMMA_LAYOUT", "build_tokenizer", "fast_tokenizer"]

# FunctionGemma's control tokens: declarations, calls, responses, and the string delimiter (the
# layout's tags, spelled once in prepack/text/tool_markup.py).
FUNCTION_TOKENS = FUNCTIONGEMMA_TOKENS
FUNCTION_TOKEN_SLOTS = tuple(f"<unused{k}>" for k in range(len(FUNCTION_TOKENS)))
# A chat template in FunctionGemma's published layout, written for this project (not FunctionGemma's file).
FUNCTIONGEMMA_LAYOUT = Path(__file__).resolve().parent / "chat" / "templates" / "functiongemma_layout.jinja"
_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")
# Every file transformers reads a tokenizer folder from: what --overwrite replaces or removes.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")
_SP_CONTROL, _SP_USER_DEFINED = 3, 4


class FolderError(ValueError):
    """A folder that cannot be written as asked (the message is one line for the user)."""


def build_tokenizer(function_tokens: bool = True, gguf_path: str | os.PathLike[str] | None = None) -> Any:
    """The Gemma 3 tokenizer as a `tokenizers.Tokenizer` (the same ids as `--tokenizer gemma3`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    from prepack.text import transformers_quiet
    transformers_quiet.quiet()
    from transformers.convert_slow_tokenizer import generate_merges

    meta = gemma3_gguf.read_tokenizer_metadata(gguf_path)
    pieces = gemma3_gguf.sentencepiece_pieces(meta)
    if function_tokens:
        pieces = _with_function_tokens(pieces)
    vocab = {text: i for i, (text, _, _) in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise FolderError(f"the GGUF's tokenizer has {len(pieces) - len(vocab)} repeated pieces; it is not Gemma 3's")
    # SentencePiece BPE applies the highest-scoring merge first: rank merges by the merged piece's score.
    merges = generate_merges(vocab, {text: score for text, score, _ in pieces})
    tok = Tokenizer(BPE(vocab, merges, unk_token=pieces[meta.unk_id][0], fuse_unk=True, byte_fallback=True, dropout=None))
    # SentencePiece matches user-defined pieces in the text before BPE, never control pieces; both
    # become added tokens, control ones special (HFTokenizer splits those like plain text). A
    # user-defined piece holding spaces is stored escaped, so it matches the normalized text.
    tok.add_tokens([AddedToken(text, normalized="\u2581" in text, special=ptype == _SP_CONTROL)
                    for text, _, ptype in pieces if ptype in (_SP_CONTROL, _SP_USER_DEFINED)])
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    if tok.get_vocab_size(with_added_tokens=True) != len(pieces):
        raise FolderError(f"building the tokenizer gave {tok.get_vocab_size(with_added_tokens=True):,} ids, "
                          f"not the GGUF's {len(pieces):,}")
    return tok


def _with_function_tokens(pieces: list[tuple[str, float, int]]) -> list[tuple[str, float, int]]:
    out = list(pieces)
    slot = {text: i for i, (text, _, _) in enumerate(pieces)}
    for token, reserved in zip(FUNCTION_TOKENS, FUNCTION_TOKEN_SLOTS):
        i = slot.get(reserved)
        if i is None or pieces[i][2] != _SP_CONTROL:
            raise FolderError(f"the GGUF's tokenizer has no reserved control piece {reserved!r} to hold {token!r}")
        out[i] = (token, pieces[i][1], _SP_CONTROL)
    return out


def fast_tokenizer(chat_template: str | None, function_tokens: bool = True,
                   gguf_path: str | os.PathLike[str] | None = None) -> Any:
    """The tokenizer as transformers' PreTrainedTokenizerFast, with the chat template: its
    `save_pretrained` writes the folder's files (TOKENIZER_FILES; apps/tokenizer_folder.py writes
    them into --output, replacing only those)."""
    from prepack.text import transformers_quiet
    transformers_quiet.quiet()
    from transformers import PreTrainedTokenizerFast

    specials = list(_TURN_TOKENS) + (list(FUNCTION_TOKENS) if function_tokens else [])
    fast = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(function_tokens, gguf_path), bos_token="<bos>",
                                   eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
                                   additional_special_tokens=specials, add_bos_token=False, add_eos_token=False)
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast
