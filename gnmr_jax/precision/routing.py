r"""Routed execution: one real branch per recoverable unit.

``routed_dot(recovery, low_cost)`` is a ``custom_vjp`` dot whose forward is
``lax.cond(recover, recovery.forward, low_cost.forward)`` and whose backward is
``lax.cond(recover, recovery.backward, low_cost.backward)``. It stays a real
branch (one path executed) only while ``recover`` is an unbatched scalar: under
``vmap`` with a batched predicate JAX turns ``cond`` into ``select_n`` and
computes both paths. With layer-stacked params under ``nn.scan``/``lax.scan``,
pass the per-layer mask bit as a scan input, never ``vmap`` over layers.

Why a custom_vjp around the conds rather than differentiating ``lax.cond``:
JAX's cond partial-eval returns every residual of every branch from the cond
(zeros from the branch not taken) and copies branch inputs such as the kernel
into new residual buffers. Here the residuals are laid out explicitly: ``x``
once (if either path needs it), the kernel as given (a scan forwards it without
a copy), and the paths' own residuals merged by shape and dtype, so a 4-bit and
an 8-bit saved activation stored as uint8 nibble planes share their slots.

Cost: on an H200, per-matmul conds inside a scanned fwd+bwd loop cost +14% (int8)
and +18% (fp8) step time with nothing recovered; the same conds with the layers
unrolled cost +0.3%. Routed policies therefore ask the model to unroll its layer
scan (``PrecisionPolicy.scan_unroll``).
"""

from __future__ import annotations

import collections
import itertools

import jax
import jax.numpy as jnp
from jax import lax

from gnmr_jax.precision import path as path_lib


def _aval_key(leaf):
  return (tuple(leaf.shape), jnp.dtype(leaf.dtype))


def merge_residual_slots(*branch_avals):
  """Shared residual slots for several branches, merged by (shape, dtype).

  The k-th residual of a given (shape, dtype) in every branch goes to the same
  slot, so the slots hold the largest branch's set, not the sum.

  Args:
    *branch_avals: per branch, a list of ``jax.ShapeDtypeStruct``.

  Returns:
    ``(slots, indices)``: slot avals, and per branch the slot of each residual.
  """
  tagged = []
  for avals in branch_avals:
    counts = collections.defaultdict(itertools.count)
    tagged.append([(_aval_key(a), next(counts[_aval_key(a)])) for a in avals])
  order = list(dict.fromkeys(itertools.chain.from_iterable(tagged)))
  slot_of = {tag: i for i, tag in enumerate(order)}
  slots = [jax.ShapeDtypeStruct(shape, dtype) for (shape, dtype), _ in order]
  return slots, [[slot_of[t] for t in branch] for branch in tagged]


def routed_dot(recovery: path_lib.Path, low_cost: path_lib.Path):
  r"""A dot that runs ``recovery`` if ``recover`` else ``low_cost``, forward and backward.

  Args:
    recovery: recovery ``Path``.
    low_cost: low-cost ``Path``.

  Returns:
    ``dot(x [M,K], kernel [K,N], recover bool[]) -> [M,N]`` in ``x.dtype``.
  """
  saves_input = recovery.saves_input or low_cost.saves_input

  def layout(x, kernel):
    trees = [jax.eval_shape(lambda a, b, p=p: p.forward(a, b)[1], x, kernel)
             for p in (low_cost, recovery)]
    leaves = [jax.tree.leaves(t) for t in trees]
    slots, indices = merge_residual_slots(*leaves)
    return trees, slots, indices

  def branch_forward(p, slots, slot_indices):
    def run(x, kernel):
      y, residuals = p.forward(x, kernel)
      filled = [jnp.zeros(s.shape, s.dtype) for s in slots]
      for leaf, i in zip(jax.tree.leaves(residuals), slot_indices):
        filled[i] = leaf
      return y, tuple(filled)
    return run

  def branch_backward(p, tree, slot_indices):
    treedef = jax.tree.structure(tree)
    def run(filled, x, kernel, g):
      residuals = jax.tree.unflatten(treedef, [filled[i] for i in slot_indices])
      return p.backward(residuals, x if p.saves_input else None, kernel, g)
    return run

  def forward(x, kernel, recover):
    _, slots, indices = layout(x, kernel)
    y, filled = lax.cond(
        recover,
        branch_forward(recovery, slots, indices[1]),
        branch_forward(low_cost, slots, indices[0]),
        x, kernel)
    return y, (filled, x if saves_input else None, kernel, recover)

  @jax.custom_vjp
  def dot(x, kernel, recover):
    return forward(x, kernel, recover)[0]

  def dot_fwd(x, kernel, recover):
    return forward(x, kernel, recover)

  def dot_bwd_impl(saved, g):
    filled, x, kernel, recover = saved
    x_aval = jax.ShapeDtypeStruct((g.shape[0], kernel.shape[0]), g.dtype)
    trees, _, indices = layout(x_aval, kernel)
    dx, dkernel = lax.cond(
        recover,
        branch_backward(recovery, trees[1], indices[1]),
        branch_backward(low_cost, trees[0], indices[0]),
        filled, x, kernel, g)
    return dx, dkernel, None

  dot.defvjp(dot_fwd, dot_bwd_impl)
  return dot


def check_recover(recover) -> jax.Array:
  """Validates a mask bit: a bool[] scalar (raises ValueError otherwise)."""
  recover = jnp.asarray(recover)
  if recover.shape != ():
    raise ValueError('recover must be a bool[] scalar (one mask bit per unit), got shape '
                     f'{recover.shape}; slice the per-layer bit out of the mask first.')
  if recover.dtype != jnp.bool_:
    raise ValueError(f'recover must have dtype bool, got {recover.dtype}.')
  return recover
