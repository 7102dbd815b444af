"""`--loss-chunk-tokens N`: the masked loss without a [B, L, V] logits array.

The model runs with `output_hidden_states=True` (Tunix 0.1.7's own option on Gemma3 and
Qwen3: it sows the final-normed hidden states as `nnx.Intermediate('all_hidden_states')`);
the states are popped off the model and its logits output is left unused, so XLA removes
the model's own output projection from the program. Nothing of Tunix is forked or wrapped:
the projection is redone here from the model's own weights, exactly as its decode does:

- Gemma3: `x @ embedder.input_embedding.T` (tied), in the parameter dtype, then the final
  logit soft-cap `tanh(z / c) * c` when the config has one (`final_logit_softcap`; 0.1.7's
  Gemma3 has none);
- Qwen3 tied: the same in `embedder.dtype`; untied: `x @ lm_head.w` (`BTD,DV->BTV`).

The B*L positions are cut into chunks of N tokens and `lax.map` runs one checkpointed
function per chunk (logits, float32 logsumexp, target logit -> per-token NLL), so only one
chunk's [N, V] logits exist at a time, in the forward and, recomputed, in the backward pass.
Per-token NLLs, the token or example mean (--loss-mean), the aux and the per-source sums
are then the ones train/loss.py computes from full logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from train import loss as loss_lib

HIDDEN_STATES = "all_hidden_states"


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
    """What the model's decode multiplies its final hidden states with (Gemma3 or Qwen3)."""
    config = model.config
    softcap = getattr(config, "final_logit_softcap", None)
    if hasattr(config, "num_embed"):  # Gemma3: tied; decode is jnp.dot(x, input_embedding.T)
        emb = model.embedder.input_embedding[...]
        return Projection(emb, True, emb.dtype, softcap)
    if config.use_tied_embedding:  # Qwen3 tied: both cast to the embedder's compute dtype
        return Projection(model.embedder.input_embedding[...], True, model.embedder.dtype, softcap)
    head = model.lm_head
    if getattr(head, "einsum_str", "BTD,DV->BTV") != "BTD,DV->BTV":
        raise ValueError(f"unexpected Qwen3 lm_head einsum {head.einsum_str!r}; the chunked loss needs BTD,DV->BTV")
    return Projection(head.w[...], False, config.dtype, softcap)


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


def chunked_token_nll(h: jax.Array, projection: Projection, targets: jax.Array, chunk_tokens: int) -> jax.Array:
    """Per-position NLL [B, L] (float32) of `targets`, computing [chunk_tokens, V] logits at a time."""
    b, length, d = h.shape
    n = b * length
    chunks = -(-n // chunk_tokens)
    pad = chunks * chunk_tokens - n
    flat_h = jnp.pad(h.reshape(n, d), ((0, pad), (0, 0))).reshape(chunks, chunk_tokens, d)
    flat_t = jnp.pad(targets.reshape(n).astype(jnp.int32), (0, pad)).reshape(chunks, chunk_tokens)

    # Nothing saved: the backward pass recomputes this chunk's logits from (h, targets, weights).
    @jax.checkpoint
    def chunk_nll(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        hc, tc = args
        logits = projection.logits(hc).astype(jnp.float32)
        target_logit = jnp.take_along_axis(logits, tc[:, None], axis=-1)[:, 0]
        return jax.nn.logsumexp(logits, axis=-1) - target_logit

    nll = jax.lax.map(chunk_nll, (flat_h, flat_t))
    return nll.reshape(-1)[:n].reshape(b, length)


def make_chunked_loss_fn(chunk_tokens: int, loss_mean: str = loss_lib.TOKEN_MEAN) -> Callable[..., tuple[jax.Array, dict[str, jax.Array]]]:
    """A PeftTrainer loss (has_aux) with the signature and results of loss.make_masked_loss_fn(loss_mean)."""
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
        nll = chunked_token_nll(h, output_projection(model), targets, chunk_tokens)
        return loss_lib.mean_and_aux(nll, weights, source_ids, loss_mean, segment_ids, example_targets)

    return chunked_loss_fn_with_aux
