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

from gnmr_jax.precision import explicit_sharding
from gnmr_jax.precision import path as path_lib
from gnmr_jax.precision import side_buffer


def _aval_key(leaf):
  # The sharding is part of an array's type under an explicit mesh (None otherwise):
  # a slot shared by two branches must have one type for lax.cond.
  return (tuple(leaf.shape), jnp.dtype(leaf.dtype), explicit_sharding.out_sharding(leaf))


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
  slots = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
           for (shape, dtype, sharding), _ in order]
  return slots, [[slot_of[t] for t in branch] for branch in tagged]


def routed_dot(recovery: path_lib.Path, low_cost: path_lib.Path):
  r"""A dot that runs ``recovery`` if ``recover`` else ``low_cost``, forward and backward.

  Args:
    recovery: recovery ``Path``.
    low_cost: low-cost ``Path``.

  Returns:
    ``dot(x [M,K], kernel [K,N], recover bool[], history=None) -> [M,N]`` in ``x.dtype``;
    ``history``: the unit's amax history (amax_history.py), needed when a path takes one,
    observed whichever branch runs (its cotangent is the next history).
  """
  saves_input = recovery.saves_input or low_cost.saves_input

  def layout(x, kernel, history):
    trees = [jax.eval_shape(lambda a, b, h, p=p: path_lib.call_forward(p, a, b, h)[1],
                            x, kernel, history)
             for p in (low_cost, recovery)]
    leaves = [jax.tree.leaves(t) for t in trees]
    slots, indices = merge_residual_slots(*leaves)
    return trees, slots, indices

  def branch_forward(p, slots, slot_indices, hoisted):
    run_path = _branch_forward(p, low_cost, hoisted)
    def run(x, kernel, history, operands):
      y, residuals, observed = run_path(x, kernel, history, operands)
      # Under an explicit mesh the zeros carry the slot's sharding (cond types match).
      filled = [explicit_sharding.zeros(s) for s in slots]
      for leaf, i in zip(jax.tree.leaves(residuals), slot_indices):
        filled[i] = leaf
      return y, tuple(filled), observed
    return run

  def branch_backward(p, tree, slot_indices, x_type, observe, hoisted):
    treedef = jax.tree.structure(tree)
    run_path = _branch_backward(p, low_cost, hoisted, observe)
    def run(filled, x, kernel, g, g_operands):
      residuals = jax.tree.unflatten(treedef, [filled[i] for i in slot_indices])
      return run_path(residuals, x if p.saves_input else x_type, kernel, g, g_operands)
    return run

  def forward(x, kernel, recover, history):
    _, slots, indices = layout(x, kernel, history)
    hoisted = _hoisting(recovery, low_cost, history)
    operands, observed_outside = (hoisted.quantize_inputs(x, kernel, history) if hoisted
                                  else (None, None))
    y, filled, observed = lax.cond(
        recover,
        branch_forward(recovery, slots, indices[1], hoisted),
        branch_forward(low_cost, slots, indices[0], hoisted),
        x, kernel, history, operands)
    observed = observed_outside if hoisted else observed
    return y, (filled, x if saves_input else None, kernel, recover, observed)

  @jax.custom_vjp
  def dot(x, kernel, recover, history):
    return forward(x, kernel, recover, history)[0]

  def dot_fwd(x, kernel, recover, history):
    y, (filled, x_saved, kernel, recover, observed) = forward(x, kernel, recover, history)
    # x's type rides along as static structure (its sharding, when no path saves x).
    return y, (filled, x_saved, kernel, recover, explicit_sharding.static_type(x),
               history, observed)

  def dot_bwd_impl(saved, g):
    filled, x, kernel, recover, x_type, history, observed = saved
    trees, _, indices = layout(x_type.aval, kernel, history)
    observe = history is not None
    hoisted = _hoisting(recovery, low_cost, history)
    g_operands, observed_g_outside = (hoisted.quantize_gradient(g, history) if hoisted
                                      else (None, None))
    dx, dkernel, observed_g = lax.cond(
        recover,
        branch_backward(recovery, trees[1], indices[1], x_type.aval, observe, hoisted),
        branch_backward(low_cost, trees[0], indices[0], x_type.aval, observe, hoisted),
        filled, x, kernel, g, g_operands)
    observed_g = observed_g_outside if hoisted else observed_g
    return dx, dkernel, None, path_lib.next_history(history, observed, observed_g)

  dot.defvjp(dot_fwd, dot_bwd_impl)
  return _with_optional_history(dot, recovery, low_cost)


def _hoisting(recovery: path_lib.Path, low_cost: path_lib.Path, history):
  """``low_cost.hoisted`` where a routed dot quantizes outside its cond (path.Hoisted): the
  low-cost path splits its quantization from its GEMMs and the recovery path takes no
  history; else None. (``history`` None: nothing is observed; a path that needs one has
  refused already.)"""
  if low_cost.hoisted is None or recovery.takes_history:
    return None
  return low_cost.hoisted


def _branch_forward(p: path_lib.Path, low_cost: path_lib.Path, hoisted):
  """``run(x, kernel, history, operands) -> (y, residuals, observed)`` for branch ``p``.

  Hoisted: the low-cost branch multiplies the codes quantized outside the cond, the recovery
  branch runs as it is; the histories are observed from the codes (outside), so neither
  branch observes (None).
  """
  if hoisted is None:
    return lambda x, kernel, history, operands: path_lib.call_forward(p, x, kernel, history)
  if p is low_cost:
    return lambda x, kernel, history, operands: hoisted.forward(operands, x.dtype) + (None,)
  return lambda x, kernel, history, operands: path_lib.call_forward(p, x, kernel)


def _branch_backward(p: path_lib.Path, low_cost: path_lib.Path, hoisted, observe: bool):
  """``run(residuals, x, kernel, g, g_operands) -> (dx, dkernel, observed)`` for branch ``p``
  (hoisted as in ``_branch_forward``)."""
  if hoisted is None:
    return lambda res, x, kernel, g, g_operands: path_lib.call_backward(p, res, x, kernel, g,
                                                                        observe)
  if p is low_cost:
    return lambda res, x, kernel, g, g_operands: hoisted.backward(
        res, x, kernel, g_operands, g.dtype) + (None,)
  return lambda res, x, kernel, g, g_operands: path_lib.call_backward(p, res, x, kernel, g,
                                                                      False)


def _with_optional_history(dot, recovery: path_lib.Path, low_cost: path_lib.Path):
  """``dot`` whose last argument, the unit's amax history, defaults to None (refused when a
  path takes one)."""
  needs_history = recovery.takes_history or low_cost.takes_history

  def call(*args, history=None):
    if needs_history and history is None:
      raise ValueError('a routed path scales from an amax history (delayed scaling): pass '
                       "the unit's history=, float32[3, H] (amax_history.init(H)).")
    return dot(*args, history)

  return call


def routed_side_dot(recovery: path_lib.Path, low_cost: path_lib.Path):
  r"""A routed dot that keeps the recovery residuals in the shared side buffer.

  Like ``routed_dot`` (``lax.cond`` in the forward and in the backward), but a
  unit's own residual slots are only the low-cost path's: a recovered unit
  packs its recovery residuals (and ``x`` when only the recovery path needs
  it) into ``side.buffer`` at ``side.offset`` and advances the offset; its
  backward reads them back from the buffer's cotangent (side_buffer.py). A
  recovery that does not fit in the remaining buffer runs the low-cost path
  instead, so a buffer sized for ``max_o`` of the largest units holds any
  ``max_o`` recoveries.

  Args:
    recovery: recovery ``Path``; its residuals must be [M, ...] arrays.
    low_cost: low-cost ``Path``.

  Returns:
    ``dot(x [M,K], kernel [K,N], recover bool[], side SideState, history=None)
    -> (y [M,N], side)``; ``side.buffer`` is float32[M, W]; ``history`` as in ``routed_dot``.
  """
  x_in_side = recovery.saves_input and not low_cost.saves_input

  def layout(x, kernel, history):
    low_tree = jax.eval_shape(lambda a, b, h: path_lib.call_forward(low_cost, a, b, h)[1],
                              x, kernel, history)
    rec_tree = jax.eval_shape(lambda a, b, h: path_lib.call_forward(recovery, a, b, h)[1],
                              x, kernel, history)
    rec_avals = jax.tree.leaves(rec_tree) + ([x] if x_in_side else [])
    side_buffer.check_rows(rec_avals, x.shape[0], 'the recovery path')
    return low_tree, rec_tree, rec_avals

  def forward(x, kernel, recover, side, history):
    low_tree, _, rec_avals = layout(x, kernel, history)
    words = side_buffer.num_words(rec_avals)
    hoisted = _hoisting(recovery, low_cost, history)
    operands, observed_outside = (hoisted.quantize_inputs(x, kernel, history) if hoisted
                                  else (None, None))
    run_low = _branch_forward(low_cost, low_cost, hoisted)
    run_rec = _branch_forward(recovery, low_cost, hoisted)
    if side.buffer.shape[1] < words:
      # No room for even one recovery of this unit (e.g. a zero budget): the low-cost
      # path, with no cond in the program.
      y, low_residuals, observed = run_low(x, kernel, history, operands)
      out_side = side._replace(dropped=side.dropped + recover.astype(jnp.int32))
      saved = (low_residuals, x if low_cost.saves_input else None, kernel, jnp.array(False),
               side.offset, observed_outside if hoisted else observed)
      return (y, out_side), saved
    take = recover & (side.offset + words <= side.buffer.shape[1])

    def run_recovery(x, kernel, buffer, operands):
      y, residuals, observed = run_rec(x, kernel, history, operands)
      leaves = jax.tree.leaves(residuals) + ([x] if x_in_side else [])
      buffer = lax.dynamic_update_slice(
          buffer, side_buffer.pack(leaves), (jnp.zeros((), jnp.int32), side.offset))
      return y, jax.tree.map(explicit_sharding.zeros, low_tree), buffer, observed

    def run_low_cost(x, kernel, buffer, operands):
      y, residuals, observed = run_low(x, kernel, history, operands)
      return y, residuals, buffer, observed

    y, low_residuals, buffer, observed = lax.cond(take, run_recovery, run_low_cost, x, kernel,
                                                  side.buffer, operands)
    observed = observed_outside if hoisted else observed
    out_side = side_buffer.SideState(buffer, side.offset + jnp.where(take, words, 0),
                                     side.dropped + (recover & ~take).astype(jnp.int32))
    saved = (low_residuals, x if low_cost.saves_input else None, kernel, take, side.offset,
             observed)
    return (y, out_side), saved

  @jax.custom_vjp
  def dot(x, kernel, recover, side, history):
    return forward(x, kernel, recover, side, history)[0]

  def dot_fwd(x, kernel, recover, side, history):
    out, saved = forward(x, kernel, recover, side, history)
    # x's type rides along as static structure, as in routed_dot.
    return out, saved + (explicit_sharding.static_type(x), history)

  def dot_bwd(saved, cotangents):
    g, side_cotangent = cotangents
    low_residuals, x, kernel, take, offset, observed, x_type, history = saved
    observe = history is not None
    hoisted = _hoisting(recovery, low_cost, history)
    back_low = _branch_backward(low_cost, low_cost, hoisted, observe)
    back_rec = _branch_backward(recovery, low_cost, hoisted, observe)
    x_type = x_type.aval
    rows = g.shape[0]
    _, rec_tree, rec_avals = layout(x_type, kernel, history)
    words = side_buffer.num_words(rec_avals)
    # The cotangent of the side buffer is the final buffer (side_buffer.attach).
    buffer = side_cotangent.buffer
    g = side_buffer.first_order_only(g)
    x_low = x if low_cost.saves_input else x_type
    g_operands, observed_g_outside = (hoisted.quantize_gradient(g, history) if hoisted
                                      else (None, None))
    if buffer.shape[1] < words:
      dx, dkernel, observed_g = back_low(low_residuals, x_low, kernel, g, g_operands)
      observed_g = observed_g_outside if hoisted else observed_g
      return (dx, dkernel, None, side_buffer.no_cotangent(buffer),
              path_lib.next_history(history, observed, observed_g))

    def run_recovery(low_residuals, x, kernel, g, buffer, g_operands):
      del low_residuals
      region = lax.dynamic_slice(buffer, (jnp.zeros((), jnp.int32), offset), (rows, words))
      leaves = side_buffer.unpack(region, rec_avals)
      # Unpacked rows shard like the buffer's; x goes back to its own type.
      x_rec = explicit_sharding.retype(leaves.pop(), x_type) if x_in_side else x
      residuals = jax.tree.unflatten(jax.tree.structure(rec_tree), leaves)
      return back_rec(residuals, x_rec if recovery.saves_input else x_type, kernel, g,
                      g_operands)

    def run_low_cost(low_residuals, x, kernel, g, buffer, g_operands):
      del buffer
      return back_low(low_residuals, x if low_cost.saves_input else x_type, kernel, g,
                      g_operands)

    dx, dkernel, observed_g = lax.cond(take, run_recovery, run_low_cost, low_residuals, x,
                                       kernel, g, buffer, g_operands)
    observed_g = observed_g_outside if hoisted else observed_g
    return (dx, dkernel, None, side_buffer.no_cotangent(buffer),
            path_lib.next_history(history, observed, observed_g))

  dot.defvjp(dot_fwd, dot_bwd)
  return _with_optional_history(dot, recovery, low_cost)


def side_words_per_row(recovery: path_lib.Path, low_cost: path_lib.Path, k: int,
                       n: int, dtype) -> int:
  """Side-buffer words per token that one recovered [K=k, N=n] unit takes (0: none).

  ``dtype`` is the activations' dtype. Zero when the recovery path keeps nothing beyond the low-cost path's residuals
  and ``x`` (e.g. int8 or fp8 routed to bf16: both keep ``x``).
  """
  x = jax.ShapeDtypeStruct((1, k), dtype)
  kernel = jax.ShapeDtypeStruct((k, n), jnp.float32)
  history = jax.ShapeDtypeStruct((3, 1), jnp.float32) if recovery.takes_history else None
  rec = jax.tree.leaves(jax.eval_shape(
      lambda a, b, h: path_lib.call_forward(recovery, a, b, h)[1], x, kernel, history))
  if recovery.saves_input and not low_cost.saves_input:
    rec.append(x)
  return side_buffer.num_words(rec) if rec else 0


def check_recover(recover) -> jax.Array:
  """Validates a mask bit: a bool[] scalar (raises ValueError otherwise)."""
  recover = jnp.asarray(recover)
  if recover.shape != ():
    raise ValueError('recover must be a bool[] scalar (one mask bit per unit), got shape '
                     f'{recover.shape}; slice the per-layer bit out of the mask first.')
  if recover.dtype != jnp.bool_:
    raise ValueError(f'recover must have dtype bool, got {recover.dtype}.')
  return recover
