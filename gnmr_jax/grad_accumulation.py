"""Gradient accumulation inside the jitted step: the global batch as micro-batches.

``config.train.grad_accum_steps = k`` makes the train step run forward and backward once per
micro-batch of ``batch_size / k`` sequences under a ``lax.scan`` (so the compiled program holds
one micro-batch's activations), sum the gradients in float32 and hand the sum to the optax chain
once: the controller ranks the step's gradient, not a micro-batch's, and every micro-batch runs
under the same recovery mask. Each micro-batch's loss is its token-loss sum over the *global*
token count, so the summed loss and gradients are the un-accumulated step's up to the order of
float32 additions.

Micro-batch ``i`` holds rows ``i, i + k, i + 2k, ...`` of the global batch: a batch sharded over
its leading axis then splits inside each device's block, so no row moves between devices.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from gnmr_jax.precision import explicit_sharding


def micro_batches(batch, steps: int):
  """Every leaf [B, ...] of ``batch`` as [steps, B / steps, ...], micro-batch i = rows i::steps."""
  def split(x):
    if x.shape[0] % steps:
      raise ValueError(f"gradient accumulation: a batch leaf of leading size {x.shape[0]} does "
                       f"not split into train.grad_accum_steps={steps} micro-batches.")
    return jnp.swapaxes(x.reshape(x.shape[0] // steps, steps, *x.shape[1:]), 0, 1)
  return jax.tree_util.tree_map(split, batch)


def over_micro_batches(fn: Callable, batch, steps: int, combine: Callable):
  """``fn(batch)`` when ``steps == 1``; else ``fn`` folded over the micro-batches under a
  ``lax.scan``: ``combine(carry, fn(micro_batch))`` from a carry of zeros shaped like ``fn``'s
  output (the identity of a sum, and of a max over non-negative values), typed with its
  shardings under an explicit mesh (a scan's carry keeps its type)."""
  if steps == 1:
    return fn(batch)
  micro = micro_batches(batch, steps)
  first = jax.tree_util.tree_map(lambda x: x[0], micro)
  zeros = jax.tree_util.tree_map(explicit_sharding.zeros, jax.eval_shape(fn, first))

  def body(carry, micro_batch):
    return combine(carry, fn(micro_batch)), None

  out, _ = jax.lax.scan(body, zeros, micro)
  return out

