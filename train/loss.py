"""Token-mean cross-entropy weighted by the loss mask, without a [B, L, V] one-hot.

Tunix 0.1.7's default SFT loss builds `jax.nn.one_hot(targets, V)` in float32 and
multiplies it with a full log_softmax; for Gemma3's 262,144-token vocabulary that
one-hot alone is B*L*V*4 bytes. Here the target logit is gathered with
take_along_axis and the normalizer is a logsumexp, both in float32, so the only
[B, L, V] value is the logits themselves (and the softmax the backward pass needs).

Semantics are the same as the default (measured in tests/test_train_correctness.py):
- input_mask[t] == 1 means token t is a prediction target (predicted at t-1);
- the loss is the token-level mean over every target token of the batch,
  sum(nll * mask) / (sum(mask) + 1e-8), not a mean of per-row means.

Instead of slicing logits[:, :-1] (a copy of a [B, L-1, V] array), the targets and
the mask are shifted left by one on the cheap [B, L] side and the last column gets
weight 0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# The default's epsilon, kept so that the two losses agree on every batch.
NORM_EPS = 1e-8
# Mixture sets: per-source sums come back as fixed-size [MAX_SOURCES + 1] vectors (index =
# source, 0 = none), so the step compiles once whatever the mixture (the row format caps N).
from prepack.format.rowformat import MAX_SOURCES  # noqa: E402


def shifted_targets(input_tokens: jax.Array, input_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Targets and weights aligned to the position that predicts them: column t predicts token t+1."""
    zeros = jnp.zeros_like(input_tokens[:, :1])
    targets = jnp.concatenate([input_tokens[:, 1:], zeros], axis=1)
    weights = jnp.concatenate([input_mask[:, 1:], jnp.zeros_like(input_mask[:, :1])], axis=1)
    return targets, weights.astype(jnp.float32)


def per_token_nll(logits: jax.Array, input_tokens: jax.Array, input_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-position NLL [B, L] (float32) and its weight [B, L]; column t scores token t+1."""
    targets, weights = shifted_targets(input_tokens, input_mask)
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return log_z - target_logit, weights


def token_mean_nll(logits: jax.Array, input_tokens: jax.Array, input_mask: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    return mean_and_aux(*per_token_nll(logits, input_tokens, input_mask))


def mean_and_aux(nll: jax.Array, weights: jax.Array, source_ids: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The token-mean loss and its aux from per-position NLLs [B, L] and weights (full or chunked logits)."""
    nll_sum = jnp.sum(nll * weights)
    target_tokens = jnp.sum(weights)
    loss = nll_sum / (target_tokens + NORM_EPS)
    aux = {"loss": loss, "nll_sum": nll_sum, "target_tokens": target_tokens}
    if source_ids is not None:
        aux["nll_by_source"], aux["targets_by_source"] = by_source(nll, weights, source_ids)
    return loss, aux


def by_source(values: jax.Array, weights: jax.Array, source_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Weighted sums of per-position values [B, L] and of the weights, per source of the token
    each position scores (column t scores token t+1): two [MAX_SOURCES + 1] vectors."""
    scored = jnp.concatenate([source_ids[:, 1:], jnp.zeros_like(source_ids[:, :1])], axis=1).reshape(-1)
    n = MAX_SOURCES + 1
    return (jax.ops.segment_sum((values * weights).reshape(-1), scored, num_segments=n),
            jax.ops.segment_sum(weights.reshape(-1), scored, num_segments=n))


def masked_loss_fn_with_aux(
    model: nnx.Module,
    input_tokens: jax.Array,
    input_mask: jax.Array,
    positions: jax.Array,
    attention_mask: jax.Array,
    source_ids: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PeftTrainer loss (use with `with_loss_fn(..., has_aux=True)`).

    The aux dict carries the NLL sum and target-token count so that callers can
    aggregate exactly over batches (token-weighted), e.g. for eval. A mixture set's
    source_ids (never given to the model) add `nll_by_source` and `targets_by_source`.
    """
    # Positional call, as Tunix's default does: works for Gemma3 (last_tokens) and Qwen3 (input_tokens).
    logits, _ = model(input_tokens, positions, None, attention_mask)
    return mean_and_aux(*per_token_nll(logits, input_tokens, input_mask), source_ids)


def masked_loss_fn(
    model: nnx.Module,
    input_tokens: jax.Array,
    input_mask: jax.Array,
    positions: jax.Array,
    attention_mask: jax.Array,
    source_ids: jax.Array | None = None,
) -> jax.Array:
    """Drop-in replacement for Tunix's default loss (same signature, scalar result). A mixture
    set's inputs also carry `source_ids` (Tunix passes every input to the loss): accepted and
    not needed for the scalar loss; masked_loss_fn_with_aux splits it by source."""
    return masked_loss_fn_with_aux(model, input_tokens, input_mask, positions, attention_mask)[0]


def tunix_default_loss_fn() -> Any:
    """Tunix's own default SFT loss, for comparisons (it is module-private in 0.1.7)."""
    from tunix.sft import peft_trainer

    return peft_trainer._default_loss_fn  # pylint: disable=protected-access


def with_aux(loss_fn: Any) -> Any:
    """Wraps a scalar loss (Tunix's default) so that the trainer's aux-based metrics still work."""
    def wrapped(model: Any, input_tokens: Any, input_mask: Any, positions: Any, attention_mask: Any,
                source_ids: Any = None) -> Any:  # a scalar loss has no per-source sums
        loss = loss_fn(model, input_tokens, input_mask, positions, attention_mask)
        targets = jnp.sum(input_mask[:, 1:]).astype(jnp.float32)
        return loss, {"loss": loss, "nll_sum": loss * targets, "target_tokens": targets}

    return wrapped
