"""`prepack train --objective dpo`: the sigmoid DPO loss on packed preference pairs (row formats 5, 6).

A pair's two sides are adjacent segments of one row, 2k-1 (chosen) and 2k (rejected), both
starting with the same prompt tokens; the targets (`loss_mask`) are each side's completion
(docs/row_format.md). What Tunix 0.1.7's DPOTrainer computes on its padded batches
(tunix/sft/dpo/dpo_trainer.py: the summed completion log-probabilities of each side, under the
policy and under a reference model), computed here on the packed rows:

- per-token log-probabilities come from the SFT loss path: the chunked projection of
  train/step/chunked_loss.py (targets first, a custom VJP, never [B, L, V] logits), or full logits
  with --loss-chunk-tokens 0; the attention kinds apply as in SFT (each side is a segment);
- each side's sum is a segment sum inside the step: column t scores token t+1, so it belongs
  to token t+1's pair ((segment + 1) // 2) and side (`pair_side`), a [B, L // 2 + 1] table per side;
- the reference log-probabilities are the same model's with the LoRA update switched off: the
  graph is re-merged with its nnx.LoRAParam leaves replaced by zeros (x A B = 0 exactly, so the
  base computes alone), sharing every base array, so there is no second model copy; the pass is
  a constant of the LoRA parameters (stop_gradient), so no gradient flows through it;
- loss = -log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))), averaged over the pairs.

The loss returns sums (the loss's over pairs, rewards, accuracies, log-probabilities) and the
pair count, so that gradient accumulation divides the K micro-batches' summed numerators by
all their pairs (`step_sums`: the mean over every pair of the step, exactly), and eval and the
metrics (TRL's names, train/objectives/dpo_metrics.py) combine batches exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from prepack.format.rowformat import CHOSEN, REJECTED
from train.step import loss as loss_lib
from train.objectives.dpo_metrics import (ACCURACY_SUM, CHOSEN_LOGPS_SUM, CHOSEN_REWARDS_SUM, DEFAULT_BETA, LOSS_SUM, PAIRS,
                                          REJECTED_LOGPS_SUM, REJECTED_REWARDS_SUM)
from train.step.train_step import StepSums

Reference = Callable[[nnx.Module], nnx.Module]


def lora_off(model: nnx.Module) -> nnx.Module:
    """The same model with the LoRA update switched off: its LoRA parameters replaced by zeros
    (constants, not the differentiated ones), every base array shared."""
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), lora)
    return nnx.merge(graphdef, zeros, rest)


def scored(field: jax.Array) -> jax.Array:
    """[B, L]: the value of the token each column scores (column t scores token t+1; 0 at the end)."""
    return jnp.concatenate([field[:, 1:], jnp.zeros_like(field[:, :1])], axis=1)


def side_sums(values: jax.Array, weights: jax.Array, segment_ids: jax.Array,
              pair_side: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chosen, rejected, present) [B, P]: per row and pair k (index k, 1..; 0 collects padding),
    the weighted sums of the per-column values over each side's targets, and 1.0 where the pair
    exists (both sides in the row: the row rules say each row ends with a rejected side)."""
    b, length = segment_ids.shape
    p = length // 2 + 2  # pair indices 0..(L + 1) // 2
    seg = scored(segment_ids)
    side = scored(pair_side)
    keys = ((seg + 1) // 2 + jnp.arange(b, dtype=seg.dtype)[:, None] * p).reshape(-1)
    weighted = (values * weights).reshape(-1)
    chosen = jax.ops.segment_sum(jnp.where(side.reshape(-1) == CHOSEN, weighted, 0.0), keys, num_segments=b * p)
    rejected = jax.ops.segment_sum(jnp.where(side.reshape(-1) == REJECTED, weighted, 0.0), keys, num_segments=b * p)
    pairs = jnp.max(segment_ids, axis=1) // 2  # complete pairs per row
    present = (jnp.arange(p)[None, :] >= 1) & (jnp.arange(p)[None, :] <= pairs[:, None])
    return chosen.reshape(b, p), rejected.reshape(b, p), present.astype(jnp.float32)


def pair_count(segment_ids: jax.Array) -> jax.Array:
    """The pairs in rows [..., L] (any leading dims: micro-batches), from the data alone."""
    return jnp.sum(jnp.max(segment_ids, axis=-1) // 2).astype(jnp.float32)


def dpo_terms(policy: tuple[jax.Array, jax.Array], reference: tuple[jax.Array, jax.Array], present: jax.Array,
              beta: float) -> dict[str, jax.Array]:
    """The sums of the sigmoid DPO loss and of TRL's metrics over the present pairs."""
    chosen, rejected = policy
    ref_chosen, ref_rejected = reference
    chosen_rewards = beta * (chosen - ref_chosen)
    rejected_rewards = beta * (rejected - ref_rejected)
    losses = -jax.nn.log_sigmoid(chosen_rewards - rejected_rewards)
    return {
        PAIRS: jnp.sum(present),
        LOSS_SUM: jnp.sum(losses * present),
        CHOSEN_REWARDS_SUM: jnp.sum(chosen_rewards * present),
        REJECTED_REWARDS_SUM: jnp.sum(rejected_rewards * present),
        ACCURACY_SUM: jnp.sum((chosen_rewards > rejected_rewards) * present),
        CHOSEN_LOGPS_SUM: jnp.sum(chosen * present),
        REJECTED_LOGPS_SUM: jnp.sum(rejected * present),
    }


def make_token_nll(chunk_tokens: int, kernel: str = "auto") -> Callable[..., jax.Array]:
    """(model, tokens, positions, attention_mask, targets, weights) -> per-column NLL [B, L] of the
    SFT loss path: chunked (train/step/chunked_loss.py) or, with 0, full logits (train/step/loss.py)."""
    if chunk_tokens < 0:
        raise ValueError(f"chunk_tokens must be 0 (full logits) or positive, got {chunk_tokens}")
    from train.step import chunked_loss

    def token_nll(model: nnx.Module, tokens: jax.Array, positions: jax.Array, attention_mask: jax.Array,
                  input_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        if chunk_tokens:
            h = chunked_loss.final_hidden_states(model, tokens, positions, attention_mask)
            targets, weights = loss_lib.shifted_targets(tokens, input_mask)
            return chunked_loss.chunked_token_nll(h, chunked_loss.output_projection(model), targets, chunk_tokens, weights,
                                                     kernel), weights
        logits, _ = model(tokens, positions, None, attention_mask)
        return loss_lib.per_token_nll(logits, tokens, input_mask)

    return token_nll


def make_dpo_loss_fn(beta: float = DEFAULT_BETA, chunk_tokens: int = 1024,
                     reference: Reference = lora_off, kernel: str = "auto") -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """A PeftTrainer loss (has_aux) on packed pair rows: (loss, sums). `reference` turns the policy
    into the reference model (tests pass others to show the comparison with Tunix fails);
    kernel: --loss-kernel."""
    token_nll = make_token_nll(chunk_tokens, kernel)

    def dpo_loss_fn(model: nnx.Module, input_tokens: jax.Array, input_mask: jax.Array, positions: jax.Array,
                    attention_mask: jax.Array, segment_ids: jax.Array, pair_side: jax.Array,
                    source_ids: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        del source_ids  # a mixture of preference sources: the pair mean takes no per-source weights
        nll, weights = token_nll(model, input_tokens, positions, attention_mask, input_mask)
        ref_nll, _ = token_nll(reference(model), input_tokens, positions, attention_mask, input_mask)
        ref_nll = jax.lax.stop_gradient(ref_nll)
        chosen, rejected, present = side_sums(-nll, weights, segment_ids, pair_side)
        ref_chosen, ref_rejected, _ = side_sums(-ref_nll, weights, segment_ids, pair_side)
        aux = dpo_terms((chosen, rejected), (ref_chosen, ref_rejected), present, beta)
        aux["nll_sum"] = jnp.sum(nll * weights)  # the policy's token NLL over both sides' completions
        aux["target_tokens"] = jnp.sum(weights)
        aux["loss"] = aux[LOSS_SUM] / (aux[PAIRS] + loss_lib.NORM_EPS)
        return aux["loss"], aux

    return dpo_loss_fn


def step_sums() -> StepSums:
    """What a DPO step divides: the K micro-batches' summed losses by all their pairs."""
    return StepSums(numerator=LOSS_SUM, denominator=lambda fields: pair_count(fields["segment_ids"]),
                    loss=lambda aux: aux[LOSS_SUM] / (aux[PAIRS] + loss_lib.NORM_EPS))


def make_gen_model_input_fn(base: Callable[[Mapping[str, Any]], dict[str, jax.Array]]) -> Callable[[Mapping[str, Any]], dict[str, jax.Array]]:
    """SFT's model inputs (train/step/model_inputs.py: the attention kind's mask or segment ids), plus
    what the loss needs to find each target's pair and side. Jit-traceable."""

    def gen_model_input_fn(batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        inputs = base(batch)
        inputs["segment_ids"] = jnp.asarray(batch["segment_ids"])
        inputs["pair_side"] = jnp.asarray(batch["pair_side"])
        return inputs

    return gen_model_input_fn
