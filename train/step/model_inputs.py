"""Turns a pre-packed [B, L] batch into the inputs Tunix's loss function takes.

PeftTrainer calls `gen_model_input_fn(batch)` *inside* its jitted train step
(google-tunix 0.1.7, tunix/sft/peft_trainer.py: `inputs = self.gen_model_input_fn(inputs)`
in the jitted step), so everything
here is traceable jnp code and the [B, L, L] attention mask is built on the
device from segment_ids: only [B, L] int32 arrays cross the host->device link.

What the model gets, and why:
- input_tokens   = input_ids.
- input_mask     = loss_mask, NOT shifted: Tunix's losses (and ours, train/step/loss.py)
                   read input_mask[t] as "token t is a target" and shift inside.
                   The row format already zeroes the first token of each segment,
                   so no target is ever predicted across a segment boundary.
- positions      = the stored per-segment positions (0.. at every segment start).
                   Tunix's own helper (`build_positions_from_mask`, a cumsum) would
                   count on across segments. Gemma3 and Qwen3 use RoPE only, which is
                   relative, so cumsum positions change results by float rounding
                   that grows with the offset rather than by a wrong computation;
                   stored positions make a packed segment bit-for-bit the same
                   computation as the example alone (tests/test_train_correctness.py
                   measures both).
- attention_mask = block-causal from segment_ids ([B, L, L] bool, True = may attend):
                   causal within a segment, nothing across segments or into padding.
                   This is what keeps packed examples from seeing each other; a plain
                   causal mask lets every segment attend to the ones before it.

Gemma3's local (sliding window) layers AND this mask with an index-distance band;
inside a contiguous segment index distance equals position distance, so the two
compose exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

# The batch fields the device needs. valid_mask is not among them: it equals
# segment_ids != 0, so sending it would only cost transfer.
DEVICE_FIELDS: tuple[str, ...] = ("input_ids", "loss_mask", "positions", "segment_ids")

# Fields only some sets have: a mixture's source_ids, a split set's example_targets, a preference
# set's pair_side (the DPO loss's, train/objectives/dpo_loss.py).
OPTIONAL_DEVICE_FIELDS: tuple[str, ...] = ("source_ids", "example_targets", "pair_side")

# Exactly the keyword arguments of Tunix's default loss (and of train.step.loss.*).
MODEL_INPUT_KEYS: tuple[str, ...] = ("input_tokens", "input_mask", "positions", "attention_mask")

MaskFn = Callable[[jax.Array], jax.Array]


def default_mask_fn() -> MaskFn:
    """The project's one block-causal mask, owned by loaders/ (shared with anything else that needs it)."""
    from loaders import block_causal_mask_jax

    return block_causal_mask_jax


def segment_ids_as_mask(segment_ids: jax.Array) -> jax.Array:
    """--attention blocked|splash: the model's attention_mask argument carries the [B, L] ids
    themselves (train/attention_kernels/attention.py's layers build each tile's mask from them)."""
    return segment_ids


def make_gen_model_input_fn(mask_fn: MaskFn | None = None, attention: str = "dense",
                            loss_mean: str = "token") -> Callable[[Mapping[str, Any]], dict[str, jax.Array]]:
    """Returns a jit-traceable gen_model_input_fn for PeftTrainer.with_gen_model_input_fn.

    mask_fn maps segment_ids [B, L] -> bool [B, L, L]; the default is
    loaders.block_causal_mask_jax. Tests pass other masks to show that the
    correctness checks fail without it. attention other than "dense" passes the
    segment ids where the mask goes (no [B, L, L] array at all). loss_mean "example" also hands
    the loss the segment ids and, on a split set, example_targets (train/step/loss.py).
    """
    if attention != "dense":
        mask = segment_ids_as_mask
    else:
        mask = mask_fn if mask_fn is not None else default_mask_fn()

    def gen_model_input_fn(batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        segment_ids = jnp.asarray(batch["segment_ids"])
        inputs = {
            "input_tokens": jnp.asarray(batch["input_ids"]),
            "input_mask": jnp.asarray(batch["loss_mask"]),
            "positions": jnp.asarray(batch["positions"]),
            "attention_mask": mask(segment_ids) if attention != "dense" else mask(segment_ids).astype(jnp.bool_),
        }
        if "source_ids" in batch:  # a mixture set's: for the loss's per-source sums, never for the model
            inputs["source_ids"] = jnp.asarray(batch["source_ids"])
        if loss_mean == "example":  # the loss finds each target's example from them
            inputs["segment_ids"] = segment_ids
            if "example_targets" in batch:  # a split set's: pieces of one example weigh as one
                inputs["example_targets"] = jnp.asarray(batch["example_targets"])
        return inputs

    return gen_model_input_fn


def device_fields(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of a loader batch that goes to the device (drops valid_mask)."""
    missing = [k for k in DEVICE_FIELDS if k not in batch]
    if missing:
        raise KeyError(f"batch lacks fields {missing}; has {sorted(batch)}")
    return {k: batch[k] for k in DEVICE_FIELDS + tuple(k for k in OPTIONAL_DEVICE_FIELDS if k in batch)}
