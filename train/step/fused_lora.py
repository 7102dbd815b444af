"""`--lora-kernel fused`: a LoRA'd dense projection whose input is read once and whose input gradient is written once.

qwix adds LoRA to a projection y = x W as y + s (x A) B: two more matmuls that read x again. For
a rank-8 adapter those products are nearly free in FLOPs and dear in memory traffic: on a TPU v5e
(Gemma3 270M, (8, 2048), docs/benchmarks.md) they took 23 ms of a 162 ms step for under 1% of its
FLOPs, most of it the MLP's down projection re-reading its [8, 2048, 2048] input (gelu(gate) x up)
after the base matmul had, writing its input gradient apart and adding it to the base one.

Here the base and the adapter's first factor are one matmul against [W | A] ([K, N + r]): x is read
once, and its output split into x W and x A. The backward pass (a custom VJP) does the same with
[dy | s dy B^T] against [W | A]^T: one matmul writes dx, where the output is not much wider than the input (the down
projection; for gate and up, [dy | ...] would copy more than it saves, so dx is two products there,
as qwix's). The adapter's gradients are what qwix's
would be: dA = x^T (s dy B^T), dB = s (x A)^T dy, and W's is x^T dy (the trainer differentiates
the adapters alone, so XLA drops it). Only x, W, A, B and x A are kept for the backward ([W | A] is
built again there: a copy of every W kept alive across the step would cost Gemma3 1B 1.2 GB).
The products run with qwix's interception off: under --remat layer or --scan-layers JAX traces
this forward again outside qwix's handler, and these are the fused site's own matmuls, not sites.

Where it applies: qwix's dot_general sites of the simplest form, x [..., K] against a plain [K, N]
kernel (flax's nnx.Linear: Gemma3's and Qwen3's MLP projections), without QLoRA (a quantized
kernel computes through qwix's quantized path) or adapter dropout. Everything else, the attention
projections' einsums among them, stays qwix's own. The adapters' names, shapes, initialisation and
the values the model computes are qwix's (tests/test_fused_lora.py holds the two paths equal).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import qwix
# qwix's own helpers, so that the fused sites make and find the very adapters qwix's would (pinned qwix).
from qwix._src import interception
from qwix._src.core import qarray
from qwix._src.providers import lora as qwix_lora
from qwix._src.providers import ptq
from qwix._src.utils import flax_util

QWIX, FUSED = "qwix", "fused"
KINDS = (QWIX, FUSED)


def _dot(x: jax.Array, w: jax.Array, precision: Any) -> jax.Array:
    """x [..., K] @ w [K, N], as nnx.Linear's dot_general."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def _with_adapter(w: jax.Array, a: jax.Array) -> jax.Array:
    return jnp.concatenate([w, a.astype(w.dtype)], axis=1)  # [K, N + r]


@interception.disable_interceptions
def _fused_forward(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array, scale: float,
                   precision: Any) -> tuple[jax.Array, jax.Array]:
    z = _dot(x, _with_adapter(w, a), precision)
    n = w.shape[1]
    xa = z[..., n:]
    y = z[..., :n] + (_dot(xa, b.astype(xa.dtype), precision) * scale).astype(z.dtype)
    return y, xa


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def lora_linear(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array, scale: float, precision: Any = None) -> jax.Array:
    """x W + scale (x A) B: x read once for both products; dx written once where that pays (_lora_linear_bwd)."""
    return _fused_forward(x, w, a, b, scale, precision)[0]


def _lora_linear_fwd(x, w, a, b, scale, precision):
    y, xa = _fused_forward(x, w, a, b, scale, precision)
    return y, (x, w, a, b, xa)


@interception.disable_interceptions
def _lora_linear_bwd(scale, precision, residuals, dy):
    x, w, a, b, xa = residuals
    g = (_dot(dy, b.astype(dy.dtype).T, precision) * scale).astype(dy.dtype)  # dL/d(xA): [..., r]
    k, n = w.shape
    if 2 * k > n:  # one matmul writes dx: saves writing [..., K] twice and adding, costs a copy of dy ([..., N])
        dx = _dot(jnp.concatenate([dy, g], axis=-1), _with_adapter(w, a).T, precision)
    else:  # a wide output (gate, up: N = 3.2 K) would make that copy dearer than what it saves
        dx = _dot(dy, w.T, precision) + _dot(g, a.astype(g.dtype).T, precision)
    batch = tuple(range(x.ndim - 1))
    over_tokens = ((batch, batch), ((), ()))
    dw = jax.lax.dot_general(x, dy, over_tokens, precision=precision)  # [K, N]; dropped where W is frozen
    da = jax.lax.dot_general(x, g, over_tokens, precision=precision)  # [K, r]
    db = jax.lax.dot_general(xa, dy, over_tokens, precision=precision) * scale  # [r, N]
    return dx.astype(x.dtype), dw.astype(w.dtype), da.astype(a.dtype), db.astype(b.dtype)


lora_linear.defvjp(_lora_linear_fwd, _lora_linear_bwd)


def _plain_linear(lhs: Any, rhs: Any, dimension_numbers: Any) -> bool:
    """x [..., K] against a plain [K, N] kernel: the only form the fused product takes."""
    if isinstance(rhs, (ptq.WithAux, qarray.QArray)) or getattr(rhs, "ndim", None) != 2:
        return False
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
    return tuple(lhs_c) == (lhs.ndim - 1,) and tuple(rhs_c) == (0,) and not lhs_b and not rhs_b


class FusedLoraProvider(qwix.LoraProvider):
    """qwix's LoraProvider, its plain dense projections computed by `lora_linear`."""

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    out_sharding=None):
        rule, _ = self._get_current_rule_and_op_id("dot_general", only_rule=True)
        fusable = (isinstance(rule, qwix_lora.LoraRule) and rule.weight_qtype is None and rule.dropout == 0
                   and preferred_element_type is None and out_sharding is None
                   and _plain_linear(lhs, rhs, dimension_numbers))
        name = flax_util.find_param(rhs, ptq.WithAux) if fusable else None
        if name is None:
            return super().dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                                       out_sharding=out_sharding)
        self._get_current_rule_and_op_id("dot_general")  # the op id qwix's own path takes here
        # The same parameters qwix would make or find for this site (names, shapes, initialisers).
        a_shape, a_transpose, b_shape, b_transpose = qwix_lora._create_lora_layer_shapes(
            (0,), (), (1,), (rhs.shape[0],), (), (rhs.shape[1],), rule.rank)
        lora_a, lora_b = qwix_lora._get_or_create_lora_params(
            name=name, rule=rule, a_shape=a_shape, b_shape=b_shape,
            a_sharding_transpose=a_transpose, b_sharding_transpose=b_transpose)
        return lora_linear(lhs, rhs, lora_a, lora_b, rule.alpha / rule.rank, precision)
