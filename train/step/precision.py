"""Mixed precision for LoRA training: base weights and compute in the model's dtype, LoRA in float32.

Why (measured on the tiny model, issue 11): with everything in bfloat16,
- Adam's hyperparameters took the params' dtype (optax's inject_hyperparams without
  hyperparam_dtype) and bfloat16(0.999) == 1.0, so b2 = 1, the bias correction 1 - b2**t is 0
  and the second-moment estimate is 0/0: NaN from step 2 on, even at learning rate 0;
- bfloat16 has an 8-bit mantissa, so a LoRA entry of magnitude ~0.1 cannot move by Adam's
  ~1e-4 steps: after 20 steps only 11% of the A entries had changed at all (100% in float32).

The standard recipe (mixed precision with float32 master weights) fixes both: the trainable
LoRA params, and therefore their gradients and the optimizer state, live in float32 (see
train/step/optimizer.py for the hyperparameters), while the frozen base weights stay in bfloat16
and the forward and backward passes run in bfloat16: `in_compute_dtype` hands the model to the
loss with bfloat16 copies of the LoRA params, and the cast's gradient brings the updates back
to float32.

qwix (0.1.8) creates each LoRA param in its base weight's dtype (`initializer(rng, shape,
base_dtype)` in `_get_or_create_lora_params`); `float32_initializers` ignore that dtype, so the
adapters are drawn in float32 from the start rather than rounded to bfloat16 first.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.nn import initializers

LORA_DTYPE = jnp.float32


def float32_initializers() -> dict[str, Callable[..., jax.Array]]:
    """qwix LoraRule initializers (A: he_uniform, B: zeros, as qwix's defaults) that draw in float32."""
    he_uniform = initializers.he_uniform()

    def lora_a(key: jax.Array, shape: Any, dtype: Any = None) -> jax.Array:
        del dtype  # qwix passes the base weight's dtype; the adapters are master weights
        return he_uniform(key, shape, LORA_DTYPE)

    def lora_b(key: jax.Array, shape: Any, dtype: Any = None) -> jax.Array:
        del key, dtype
        return jnp.zeros(shape, LORA_DTYPE)

    return {"lora_a_initializer": lora_a, "lora_b_initializer": lora_b}


def in_compute_dtype(loss_fn: Callable[..., Any], compute_dtype: Any) -> Callable[..., Any]:
    """Wraps a Tunix loss fn so the model it runs sees its LoRA params cast to `compute_dtype`.

    Without the cast, jnp's type promotion would turn every adapted layer's bfloat16 output
    into float32 (bfloat16 x float32 -> float32) and the whole network would compute in float32.
    The cast is inside the differentiated function, so the gradients w.r.t. the float32 params
    are float32. A float32 model is returned unchanged.
    """
    if jnp.dtype(compute_dtype) == jnp.dtype(LORA_DTYPE):
        return loss_fn

    # nnx.value_and_grad maps keyword arguments to positions by the signature: keep the loss's.
    @functools.wraps(loss_fn)
    def loss_in_compute_dtype(model: nnx.Module, *args: Any, **kwargs: Any) -> Any:
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        lora = jax.tree.map(lambda x: x.astype(compute_dtype), lora)
        return loss_fn(nnx.merge(graphdef, lora, rest), *args, **kwargs)

    return loss_in_compute_dtype


@contextlib.contextmanager
def matmul_precision(compute_dtype: Any) -> Iterator[None]:
    """float32 means float32 matmuls on every backend: a TPU's default float32 matmul runs bfloat16
    passes (`verify --model --dtype float32` measured packed against alone 8.7e-3 apart there, 7.6e-6
    at 'highest'), so a float32 computation traces under jax.default_matmul_precision('highest').
    Any other dtype keeps the backend's default. Scope it around the tracing (jit traces on the
    first call, and the precision is part of its cache key)."""
    if jnp.dtype(compute_dtype) != jnp.dtype(jnp.float32):
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield
