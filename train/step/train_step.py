"""The optimizer step `prepack train` runs: K micro-batches, an exact loss, clipping, the schedule's rate.

PeftTrainer jits `create_train_step_fn()`'s function as `step(model, optimizer, inputs)` (Tunix
0.1.7's calling convention, pinned by train/tunix_contract.py); this module builds that function.

Gradient accumulation (`--grad-accum-steps K`). The batch arrives with every field [B, K, L]
(train/data.py stacks K loader batches on axis 1, so Tunix still shards the rows' axis). The
step scans the K micro-batches, summing gradients and the loss's sums, and updates once. Each
micro-batch differentiates its loss's numerator divided by the denominator of all K (token
mean: the K batches' target count; example mean: their example count, both known from the data
before the model runs, `loss.loss_denominator`), so the summed gradient is exactly the gradient
of the loss over the K*B rows: Σ grads / Σ targets, not Tunix 0.1.7's `optax.MultiSteps`
average of K per-batch means (a mean of means, biased when the micro-batches carry different
numbers of targets, as packed rows do). DPO (train/objectives/dpo_loss.py) divides the same way: the K
micro-batches' summed pair losses over all their pairs (`StepSums` says which sums). With K = 1 there is no scan and the step is the same
computation as one batch's loss (the denominator is that batch's own).

The record of the step (the aux) carries the summed numerators and denominators, the loss they
give, the gradient norm before clipping, whether clipping scaled it (`--max-grad-norm`), and
the learning rate the update used (read from the optimizer state, where optax's
inject_hyperparams keeps the schedule's value).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from train.step import loss as loss_lib
from train.step.optimizer import learning_rate_of

StepFn = Callable[[nnx.Module, nnx.Optimizer, Mapping[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array], jax.Array]]

# The axis of a stacked batch's fields that counts micro-batches ([B, K, L]).
MICRO_AXIS = 1

# What the jitted step donates (train/packed_trainer.py's `jit_train_and_eval_step`). nnx.jit returns
# the state of every Variable of its graph arguments, the frozen base included; an output that is an
# undonated input cannot share its buffer, so XLA copied every frozen weight once a step: 1.4 ms of a
# 162 ms Gemma3 270M step at (8, 2048) on a TPU v5e (1.0 ms of it the 262,144 x 640 embedding; the
# profile in docs/benchmarks.md). Donated, the unchanged weights' outputs alias their inputs: no copy
# and no second buffer. Tunix 0.1.7 donates the optimizer only.
DONATED = ("model", "optimizer")


@dataclasses.dataclass(frozen=True)
class StepSums:
    """What a step's loss is a ratio of: the aux sum `numerator`, summed over the micro-batches,
    over `denominator` of the step's fields (from the data alone, known before the model runs);
    `loss` gives the step's loss from the summed aux."""

    numerator: str
    denominator: Callable[[Mapping[str, jax.Array]], jax.Array]
    loss: Callable[[Mapping[str, jax.Array]], jax.Array]


def sft_sums(loss_mean: str) -> StepSums:
    """SFT: the token or example mean (train/step/loss.py)."""
    return StepSums(loss_lib.NUMERATOR[loss_mean],
                    lambda f: loss_lib.loss_denominator(f["loss_mask"], f.get("segment_ids"), f.get("example_targets"), loss_mean),
                    lambda aux: loss_lib.loss_from_sums(aux, loss_mean))


def make_train_step(loss_fn: Callable[..., Any], gen_model_input_fn: Callable[..., Any], *, loss_mean: str,
                    accumulate: bool, max_grad_norm: float = 0.0, sums: StepSums | None = None) -> StepFn:
    """loss_fn: a has_aux Tunix loss whose aux holds the sums `sums` divides (default: SFT's by
    loss_mean; DPO's: train/objectives/dpo_loss.step_sums). accumulate: the batch's fields are [B, K, L]
    (K micro-batches), else [B, L]."""
    sums = sums if sums is not None else sft_sums(loss_mean)
    numerator = sums.numerator

    def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Mapping[str, jax.Array]) -> Any:
        fields = dict(batch)
        denominator = sums.denominator(fields)
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

        def micro(lora: Any, micro_fields: Mapping[str, jax.Array]) -> tuple[Any, dict[str, jax.Array]]:
            def objective(lora: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
                _, aux = loss_fn(nnx.merge(graphdef, lora, rest), **gen_model_input_fn(micro_fields))
                return aux[numerator] / (denominator + loss_lib.NORM_EPS), aux

            (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(lora)
            return grads, {k: v for k, v in aux.items() if k != "loss"}  # sums only; the loss comes from them

        if accumulate:
            stacked = {k: jnp.moveaxis(v, MICRO_AXIS, 0) for k, v in fields.items()}
            first = {k: v[0] for k, v in stacked.items()}
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(micro, lora, first))

            def body(carry: Any, micro_fields: Mapping[str, jax.Array]) -> tuple[Any, None]:
                return jax.tree.map(jnp.add, carry, micro(lora, micro_fields)), None

            (grads, aux), _ = jax.lax.scan(body, zeros, stacked)
        else:
            grads, aux = micro(lora, fields)
        aux["loss"] = sums.loss(aux)
        grad_norm = optax.global_norm(grads)  # before clipping: what the run's records report
        optimizer.update(model, grads)
        # Finite gradients can still make an update that is not (a learning rate that overflows the LoRA
        # values): --nan-policy stop reads this too. One reduction over the LoRA values, which are small.
        aux["lora_finite"] = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))]))
        aux["grad_norm"] = grad_norm
        aux["learning_rate"] = learning_rate_of(optimizer.opt_state)
        aux["clipped"] = grad_norm > max_grad_norm if max_grad_norm else jnp.zeros((), jnp.bool_)
        return aux["loss"], aux, grad_norm

    return train_step
