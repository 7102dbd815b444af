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

`--loss-mean example` (loss_mean="example") averages each example's token-mean NLL, then
the examples of the batch: the same per-token NLLs, each target weighted 1 / (its example's
target tokens), normalised by the sum of those weights (the batch's example count). The
example of a target comes from segment_ids on the device; a set cut by `--overlong split` or
`window` (row format 3 or 4) stores in `example_targets` the whole example's target count on
every piece, so the pieces of one example weigh as one example (docs/row_format.md).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# The default's epsilon, kept so that the two losses agree on every batch.
NORM_EPS = 1e-8
# --loss-mean: the token mean over every target of the batch (Tunix's default), or the mean of
# per-example token means.
TOKEN_MEAN, EXAMPLE_MEAN = "token", "example"
LOSS_MEANS = (TOKEN_MEAN, EXAMPLE_MEAN)
# Mixture sets: per-source sums come back as fixed-size [MAX_SOURCES + 1] vectors (index =
# source, 0 = none), so the step compiles once whatever the mixture (the mixture file caps N).
from prepack.packing.mixture import MAX_SOURCES  # noqa: E402


def target_weights(input_mask: jax.Array) -> jax.Array:
    """[B, L] float32: the weight of the target each column predicts (column t predicts token t+1)."""
    return jnp.concatenate([input_mask[:, 1:], jnp.zeros_like(input_mask[:, :1])], axis=1).astype(jnp.float32)


def shifted_targets(input_tokens: jax.Array, input_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Targets and weights aligned to the position that predicts them: column t predicts token t+1."""
    zeros = jnp.zeros_like(input_tokens[:, :1])
    targets = jnp.concatenate([input_tokens[:, 1:], zeros], axis=1)
    return targets, target_weights(input_mask)


def per_token_nll(logits: jax.Array, input_tokens: jax.Array, input_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-position NLL [B, L] (float32) and its weight [B, L]; column t scores token t+1."""
    targets, weights = shifted_targets(input_tokens, input_mask)
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return log_z - target_logit, weights


def mean_and_aux(nll: jax.Array, weights: jax.Array, source_ids: jax.Array | None = None,
                 loss_mean: str = TOKEN_MEAN, segment_ids: jax.Array | None = None,
                 example_targets: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss and its aux from per-position NLLs [B, L] and weights (full or chunked logits).

    The aux always carries the token sums (nll_sum, target_tokens: eval aggregates them and the
    metrics cross-check the count); the example mean adds its own sums, example_nll_sum and
    examples, whose ratio is its loss, so batches (eval, or micro-batches) combine exactly."""
    nll_sum = jnp.sum(nll * weights)
    target_tokens = jnp.sum(weights)
    aux = {"nll_sum": nll_sum, "target_tokens": target_tokens}
    if loss_mean == TOKEN_MEAN:
        loss = nll_sum / (target_tokens + NORM_EPS)
    elif loss_mean == EXAMPLE_MEAN:
        if segment_ids is None:
            raise ValueError("the example mean needs the batch's segment_ids")
        per_example = weights * inverse_example_targets(weights, segment_ids, example_targets)
        aux["example_nll_sum"] = jnp.sum(nll * per_example)
        aux["examples"] = jnp.sum(per_example)
        loss = aux["example_nll_sum"] / (aux["examples"] + NORM_EPS)
    else:
        raise ValueError(f"unknown loss mean {loss_mean!r}; choose one of {', '.join(LOSS_MEANS)}")
    aux["loss"] = loss
    if source_ids is not None:
        aux["nll_by_source"], aux["targets_by_source"] = by_source(nll, weights, source_ids)
    return loss, aux


# What each --loss-mean divides: the loss is aux[numerator] / (aux[denominator] + NORM_EPS), so
# batches (eval batches, gradient-accumulation micro-batches) combine exactly by summing both.
NUMERATOR = {TOKEN_MEAN: "nll_sum", EXAMPLE_MEAN: "example_nll_sum"}
DENOMINATOR = {TOKEN_MEAN: "target_tokens", EXAMPLE_MEAN: "examples"}


def loss_denominator(loss_mask: jax.Array, segment_ids: jax.Array | None, example_targets: jax.Array | None,
                     loss_mean: str) -> jax.Array:
    """The loss's denominator over rows [..., L] (any leading dims: micro-batches), from the data
    alone: what mean_and_aux's target_tokens or examples sum to over the same rows. Rows are
    independent, so leading dims fold into rows."""
    length = loss_mask.shape[-1]
    weights = target_weights(loss_mask.reshape(-1, length))
    if loss_mean == TOKEN_MEAN:
        return jnp.sum(weights)
    if segment_ids is None:
        raise ValueError("the example mean needs the batch's segment_ids")
    flat_targets = None if example_targets is None else example_targets.reshape(-1, length)
    return jnp.sum(weights * inverse_example_targets(weights, segment_ids.reshape(-1, length), flat_targets))


def loss_from_sums(aux: dict[str, jax.Array], loss_mean: str) -> jax.Array:
    return aux[NUMERATOR[loss_mean]] / (aux[DENOMINATOR[loss_mean]] + NORM_EPS)


def inverse_example_targets(weights: jax.Array, segment_ids: jax.Array,
                            example_targets: jax.Array | None = None) -> jax.Array:
    """[B, L]: 1 / (target tokens of the example each position scores), 0 where it has none.

    Column t scores token t+1, so it belongs to token t+1's segment. A segment's example has
    the segment's own target count, unless `example_targets` (a split set's field: the whole
    example's count on each of its pieces, a whole example's own count; 0 is read as the own count too) says more."""
    b, length = segment_ids.shape
    scored = jnp.concatenate([segment_ids[:, 1:], jnp.zeros_like(segment_ids[:, :1])], axis=1)
    # One id per (row, segment) for the whole batch: segment ids restart at 1 in every row.
    keys = (scored + jnp.arange(b, dtype=scored.dtype)[:, None] * (length + 1)).reshape(-1)
    n = b * (length + 1)
    per_segment = jax.ops.segment_sum(weights.reshape(-1), keys, num_segments=n)
    if example_targets is not None:
        shifted = jnp.concatenate([example_targets[:, 1:], jnp.zeros_like(example_targets[:, :1])], axis=1)
        stored = jax.ops.segment_max(shifted.reshape(-1).astype(jnp.float32), keys, num_segments=n)
        per_segment = jnp.where(stored > 0, stored, per_segment)
    inverse = jnp.where(per_segment > 0, 1.0 / jnp.maximum(per_segment, 1.0), 0.0)
    return inverse[keys].reshape(b, length)


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
    segment_ids: jax.Array | None = None,
    example_targets: jax.Array | None = None,
    loss_mean: str = TOKEN_MEAN,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PeftTrainer loss (use with `with_loss_fn(..., has_aux=True)`).

    The aux dict carries the NLL sum and target-token count so that callers can
    aggregate exactly over batches (token-weighted), e.g. for eval. A mixture set's
    source_ids (never given to the model) add `nll_by_source` and `targets_by_source`.
    segment_ids and example_targets are the example mean's (make_masked_loss_fn).
    """
    # Positional call, as Tunix's default does: works for Gemma3 (last_tokens) and Qwen3 (input_tokens).
    logits, _ = model(input_tokens, positions, None, attention_mask)
    return mean_and_aux(*per_token_nll(logits, input_tokens, input_mask), source_ids, loss_mean, segment_ids, example_targets)


def make_masked_loss_fn(loss_mean: str = TOKEN_MEAN) -> Any:
    """masked_loss_fn_with_aux for one --loss-mean, with the signature Tunix calls it by."""
    if loss_mean not in LOSS_MEANS:
        raise ValueError(f"unknown loss mean {loss_mean!r}; choose one of {', '.join(LOSS_MEANS)}")
    if loss_mean == TOKEN_MEAN:
        return masked_loss_fn_with_aux

    def example_mean_loss_fn_with_aux(model: nnx.Module, input_tokens: jax.Array, input_mask: jax.Array,
                                      positions: jax.Array, attention_mask: jax.Array,
                                      source_ids: jax.Array | None = None, segment_ids: jax.Array | None = None,
                                      example_targets: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        return masked_loss_fn_with_aux(model, input_tokens, input_mask, positions, attention_mask, source_ids,
                                       segment_ids, example_targets, loss_mean=EXAMPLE_MEAN)

    return example_mean_loss_fn_with_aux


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
