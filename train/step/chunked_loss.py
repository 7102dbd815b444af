"""`--loss-chunk-tokens N`: the masked loss without a [B, L, V] logits array.

The model runs with `output_hidden_states=True` (Tunix 0.1.7's own option on Gemma3 and
Qwen3, the layer-scan class's on Llama3: it sows the final-normed hidden states as
`nnx.Intermediate('all_hidden_states')`);
the states are popped off the model and its logits output is left unused, so XLA removes
the model's own output projection from the program. Nothing of Tunix is forked or wrapped:
the projection is redone here from the model's own weights, exactly as its decode does:

- Gemma3: `x @ embedder.input_embedding.T` (tied), in the parameter dtype, then the final
  logit soft-cap `tanh(z / c) * c` when the config has one (`final_logit_softcap`; 0.1.7's
  Gemma3 has none);
- Qwen3 tied: the same in `embedder.dtype`; untied: `x @ lm_head.w` (`BTD,DV->BTV`);
- Llama3 likewise, in the weights' dtype (each family's `output_head`, train/families/).

The projection is most of a LoRA step's work for these models (Gemma3 270M's tied
262,144 x 640 head is 168M of its 268M parameters), and most positions of a batch are no
target (prompt, padding: 32% of packed Alpaca rows at L1024, 94% unpacked), so:
- the B*L positions are put targets first (a stable sort of the loss mask, per batch) and cut
  into chunks of N tokens; `lax.map` runs one chunk at a time, so only one chunk's [N, V]
  logits exist, and a chunk that holds no target skips its projection (`lax.cond`, shapes
  static) and gives NLL 0 where the loss weighs nothing;
- a custom VJP (`head_nll`) computes each chunk's dL/dh in the forward pass while its logits
  exist (the head is frozen under LoRA, so no weight gradient is needed): two projections per
  chunk with targets instead of three (forward, recompute, backward), none for the others.
Per-token NLLs, the token or example mean (--loss-mean), the aux and the per-source sums
are then the ones train/step/loss.py computes from full logits (tests/test_train_chunked_loss.py:
same loss and gradients as the full logits, float32 to ~1e-5; benchmarks/bench_loss_skip.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from train import families
from train.step import fused_head
from train.step import loss as loss_lib

HIDDEN_STATES = "all_hidden_states"
PROFILE_SCOPE = "loss_head"  # a profile's ops are attributed by it (benchmarks/profile_categories.py)


@dataclasses.dataclass(frozen=True)
class Projection:
    """The model's output projection as data: logits = (h @ matrix, or h @ matrix.T) in dtype."""

    matrix: jax.Array
    transposed: bool  # True: matrix is [V, D] (a tied embedding); False: [D, V] (an lm_head)
    dtype: Any
    softcap: float | None = None

    def logits(self, h: jax.Array) -> jax.Array:
        w = self.matrix.astype(self.dtype)
        z = jnp.dot(h.astype(self.dtype), w.T if self.transposed else w)
        if self.softcap:
            z = jnp.tanh(z / self.softcap) * self.softcap
        return z


def output_projection(model: nnx.Module) -> Projection:
    """What the model's decode multiplies its final hidden states with (its family's `output_head`)."""
    return Projection(*families.of(model).output_head(model))


def final_hidden_states(model: nnx.Module, input_tokens: jax.Array, positions: jax.Array,
                        attention_mask: jax.Array) -> jax.Array:
    """[B, L, D] final-normed hidden states, through the model's own output_hidden_states."""
    model(input_tokens, positions, None, attention_mask, True)
    sown = nnx.pop(model, nnx.Intermediate)
    states = getattr(sown, HIDDEN_STATES, None)
    if states is None:
        raise ValueError(f"the model sowed no {HIDDEN_STATES!r} with output_hidden_states=True")
    value = states.get_value() if isinstance(states, nnx.Variable) else states
    return value[0] if isinstance(value, tuple) else value


def chunked_token_nll(h: jax.Array, projection: Projection, targets: jax.Array, chunk_tokens: int,
                      weights: jax.Array | None = None, kernel: str = fused_head.AUTO) -> jax.Array:
    """Per-position NLL [B, L] (float32) of `targets`, computing [chunk_tokens, V] logits at a time.

    weights (the loss's per-position weights): positions with weight 0 are no target; their NLL
    is never read by the loss, so chunks that hold only such positions skip the projection and
    give 0. Without weights every position is scored.
    kernel (--loss-kernel): each chunk through XLA or the fused head (train/step/fused_head.py)."""
    b, length, d = h.shape
    n = b * length
    chunks = -(-n // chunk_tokens)
    pad = chunks * chunk_tokens - n
    flat_h, flat_t = h.reshape(n, d), targets.reshape(n).astype(jnp.int32)
    active = jnp.ones((n,), jnp.bool_) if weights is None else weights.reshape(n) != 0
    # Targets first, in their order (a stable sort of the mask), so they fill the first chunks.
    order = jnp.argsort(jnp.logical_not(active), stable=True)
    sorted_h = jnp.pad(flat_h[order], ((0, pad), (0, 0))).reshape(chunks, chunk_tokens, d)
    sorted_t = jnp.pad(flat_t[order], (0, pad)).reshape(chunks, chunk_tokens)
    has_target = jnp.arange(chunks) * chunk_tokens < jnp.sum(active)
    fused = fused_head.use_fused(kernel, projection.dtype, projection.softcap)
    with jax.named_scope(PROFILE_SCOPE):
        nll_sorted = head_nll(projection, sorted_h, sorted_t, has_target, fused).reshape(-1)[:n]
    return jnp.zeros((n,), jnp.float32).at[order].set(nll_sorted).reshape(b, length)


def head_nll(projection: Projection, h: jax.Array, targets: jax.Array, has_target: jax.Array,
             fused: bool = False) -> jax.Array:
    """[chunks, C] NLLs of h [chunks, C, D] under the frozen output projection; chunks without a
    target give 0 and cost no projection.

    A custom VJP: the head is frozen under LoRA (only nnx.LoRAParam is differentiated,
    train/step/train_step.py), so the backward pass needs dL/dh alone, and that is linear in each
    position's NLL cotangent. The forward pass computes each chunk's logits once and, while they
    exist, d nll / d h (Liger's fused linear cross-entropy); the backward pass only scales it.
    Two head matmuls per chunk with targets instead of the checkpointed chunk's three (forward,
    recompute, backward), none for the others. The head's own cotangent is zero by that
    contract: a run that trains the head must not use this loss.
    fused: each chunk's NLL and dL/dh from one kernel, its logits never in memory (train/step/fused_head.py)."""
    matrix = projection.matrix

    def chunk_nll_and_dh(w: Any, hc: jax.Array, tc: jax.Array) -> tuple[jax.Array, jax.Array]:
        if fused:
            return fused_head.nll_and_dh(w, hc, tc)
        nll, vjp = jax.vjp(lambda x: chunk_nll(w, x, tc), hc)
        # Each position's NLL depends on its own h only: the unit cotangent gives every row's d nll / d h.
        return nll, vjp(jnp.ones_like(nll))[0]

    def chunk_nll(w: Any, hc: jax.Array, tc: jax.Array) -> jax.Array:
        if fused:
            return fused_head.nll_and_dh(w, hc, tc)[0]
        logits = dataclasses.replace(projection, matrix=w).logits(hc).astype(jnp.float32)
        target_logit = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
        return jax.nn.logsumexp(logits, axis=-1) - target_logit

    def prepared(w: jax.Array) -> Any:
        # The fused kernel's form of the projection, made once a step: the loop's chunks share it.
        return fused_head.prepare(w, projection.transposed) if fused else w

    def nll_only(w: jax.Array, hs: jax.Array, ts: jax.Array, has: jax.Array) -> jax.Array:
        w = prepared(w)

        def one(args: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
            hc, tc, any_target = args
            return jax.lax.cond(any_target, lambda: chunk_nll(w, hc, tc), lambda: jnp.zeros(tc.shape, jnp.float32))

        return jax.lax.map(one, (hs, ts, has))

    def nll_and_dh(w: jax.Array, hs: jax.Array, ts: jax.Array, has: jax.Array) -> tuple[jax.Array, jax.Array]:
        w = prepared(w)

        def one(args: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            hc, tc, any_target = args

            return jax.lax.cond(any_target, lambda: chunk_nll_and_dh(w, hc, tc), lambda: (jnp.zeros(tc.shape, jnp.float32), jnp.zeros_like(hc)))

        return jax.lax.map(one, (hs, ts, has))

    @jax.custom_vjp
    def run(w: jax.Array, hs: jax.Array, ts: jax.Array, has: jax.Array) -> jax.Array:
        return nll_only(w, hs, ts, has)

    def fwd(w: jax.Array, hs: jax.Array, ts: jax.Array, has: jax.Array) -> tuple[jax.Array, jax.Array]:
        nll, dh = nll_and_dh(w, hs, ts, has)
        return nll, dh

    def bwd(dh: jax.Array, ct: jax.Array) -> tuple[None, jax.Array, None, None]:
        return None, (ct[..., None] * dh).astype(dh.dtype), None, None

    run.defvjp(fwd, bwd)
    return run(matrix, h, targets, has_target)


def make_chunked_loss_fn(chunk_tokens: int, loss_mean: str = loss_lib.TOKEN_MEAN,
                         kernel: str = fused_head.AUTO) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """A PeftTrainer loss (has_aux) with the signature and results of loss.make_masked_loss_fn(loss_mean);
    kernel: --loss-kernel."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if loss_mean not in loss_lib.LOSS_MEANS:
        raise ValueError(f"unknown loss mean {loss_mean!r}; choose one of {', '.join(loss_lib.LOSS_MEANS)}")

    def chunked_loss_fn_with_aux(
        model: nnx.Module,
        input_tokens: jax.Array,
        input_mask: jax.Array,
        positions: jax.Array,
        attention_mask: jax.Array,
        source_ids: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        example_targets: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        h = final_hidden_states(model, input_tokens, positions, attention_mask)
        targets, weights = loss_lib.shifted_targets(input_tokens, input_mask)
        nll = chunked_token_nll(h, output_projection(model), targets, chunk_tokens, weights, kernel)
        return loss_lib.mean_and_aux(nll, weights, source_ids, loss_mean, segment_ids, example_targets)

    return chunked_loss_fn_with_aux
