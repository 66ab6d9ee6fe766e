r"""Amax histories of delayed scaling: what a unit observed in its last H steps.

A unit's history is float32[3, H]: rows x (activations), W (weights) and g (the output
gradient), newest observation in column 0. A path that ``takes_history`` (path.py) scales its
operands from it; the dot wrappers (``path.path_dot``, ``routing.routed_dot``,
``routing.routed_side_dot``) observe :math:`\max|x|` and :math:`\max|W|` in the forward pass
and :math:`\max|g|` in the backward, and return the pushed history as the history's cotangent
(Transformer Engine's and flax ``fp8_ops``' overwrite-with-gradient: the gradient of a history
is the next history). The train step keeps that cotangent as the next step's history.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROWS = ('x', 'kernel', 'gradient')


def init(length: int) -> jax.Array:
  """An empty history (zeros: no observation yet) of ``length`` steps."""
  if not isinstance(length, int) or isinstance(length, bool) or length < 1:
    raise ValueError(f'amax history length must be an int >= 1, got {length!r}.')
  return jnp.zeros((len(ROWS), length), jnp.float32)


def amax(x: jax.Array) -> jax.Array:
  r"""float32[] :math:`\max |x|` over the whole tensor."""
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def push(history: jax.Array, amax_x, amax_kernel, amax_gradient) -> jax.Array:
  """``history`` shifted one step older with the three observations in column 0, as observed
  (a non-finite one too: the step :func:`settle` s it once its micro-batches are combined)."""
  observed = jnp.stack([amax_x, amax_kernel, amax_gradient]).astype(jnp.float32)
  return jnp.concatenate([observed[:, None], history[:, :-1]], axis=1)


def settle(history: jax.Array) -> jax.Array:
  """A pushed history as the next step scales from it: a non-finite observation recorded as 0
  (no observation), so one overflowing step cannot make every later scale infinite (the train
  step's non-finite guard handles that step). The train step settles after combining its
  micro-batches' observations by max, so a NaN in one of them settles as it would in the
  whole batch."""
  return jnp.where(jnp.isfinite(history), history, 0.0)


def history_amax(history_row: jax.Array) -> jax.Array:
  """The amax a row scales by: the largest observation it holds (0: none yet)."""
  return jnp.max(history_row)
