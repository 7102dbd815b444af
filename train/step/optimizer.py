"""The optimizer `prepack train` uses: gradient clipping, then AdamW on a learning-rate schedule, state in float32.

`optax.inject_hyperparams` keeps the hyperparameters (learning rate, b1, b2, eps, weight decay)
in the optimizer state so that they can be read (every step's record gives the learning rate
it used) and restored with a checkpoint (a resumed schedule continues where it stopped). Without
`hyperparam_dtype` it stores them in the params' dtype: in bfloat16 b2 = 0.999 becomes exactly
1.0 and Adam divides 0 by 0 at the first step (train/step/precision.py). They are float32 here
whatever the params are, and so are the moments (`mu_dtype`): with float32 hyperparameters and
lower-precision params, `b1 * mu` would promote mu to float32 after the first update and the
changed state type would compile the train step a second time. (`mu_dtype` is declared static:
inject_hyperparams would otherwise take the callable jnp.float32 for a schedule.)

`--max-grad-norm X` (default 1.0, as MaxText and TRL; 0 turns it off): `optax.clip_by_global_norm`
before the update, so the step that would move furthest is scaled to norm X. The train step
reports the norm before clipping (train/step/train_step.py).

--nan-policy skip-step wraps the whole chain in `optax.apply_if_finite`: an update whose
gradients hold a NaN or Inf is not applied (params, moments and the schedule's count unchanged),
and the state counts them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

STATE_DTYPE = jnp.float32
# skip-step never gives up on its own; the trainer reports every skipped step.
MAX_SKIPPED_IN_A_ROW = 2**30
DEFAULT_MAX_GRAD_NORM = 1.0


def adamw(learning_rate: float | Any, *, max_grad_norm: float = 0.0, skip_nonfinite: bool = False) -> optax.GradientTransformation:
    """learning_rate: a number or an optax schedule (train/run_config/schedule.py)."""
    optimizer = optax.inject_hyperparams(optax.adamw, static_args=("mu_dtype",), hyperparam_dtype=STATE_DTYPE)(
        learning_rate=learning_rate, mu_dtype=STATE_DTYPE
    )
    if max_grad_norm:
        optimizer = optax.chain(optax.clip_by_global_norm(max_grad_norm), optimizer)
    if skip_nonfinite:
        optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=MAX_SKIPPED_IN_A_ROW)
    return optimizer


def learning_rate_of(opt_state: Any) -> jax.Array:
    """The learning rate of the last update (inject_hyperparams stores the one it just used),
    wherever the chain and apply_if_finite put its state."""
    for node in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams")):
        if hasattr(node, "hyperparams"):
            value = node.hyperparams["learning_rate"]
            return jnp.asarray(value.get_value() if hasattr(value, "get_value") else value, jnp.float32)
    raise ValueError("the optimizer state holds no injected learning rate")
