"""The optimizer `prepack train` uses: AdamW, its state and hyperparameters in float32.

`optax.inject_hyperparams` keeps the hyperparameters (learning rate, b1, b2, eps, weight decay)
in the optimizer state so that they can be read (Tunix logs the learning rate) and restored.
Without `hyperparam_dtype` it stores them in the params' dtype: in bfloat16 b2 = 0.999 becomes
exactly 1.0 and Adam divides 0 by 0 at the first step (train/precision.py). They are float32
here whatever the params are, and so are the moments (`mu_dtype`): with float32 hyperparameters
and lower-precision params, `b1 * mu` would promote mu to float32 after the first update and
the changed state type would compile the train step a second time. (`mu_dtype` is declared
static: inject_hyperparams would otherwise take the callable jnp.float32 for a schedule.)

--nan-policy skip-step wraps the optimizer in `optax.apply_if_finite`: an update whose gradients
hold a NaN or Inf is not applied (params and moments unchanged), and the state counts them.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

STATE_DTYPE = jnp.float32
# skip-step never gives up on its own; the trainer reports every skipped step.
MAX_SKIPPED_IN_A_ROW = 2**30


def adamw(learning_rate: float, *, skip_nonfinite: bool = False) -> optax.GradientTransformation:
    optimizer = optax.inject_hyperparams(optax.adamw, static_args=("mu_dtype",), hyperparam_dtype=STATE_DTYPE)(
        learning_rate=learning_rate, mu_dtype=STATE_DTYPE
    )
    if skip_nonfinite:
        optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=MAX_SKIPPED_IN_A_ROW)
    return optimizer
