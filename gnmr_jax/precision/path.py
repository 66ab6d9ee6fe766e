r"""A precision path: an explicit forward and backward for :math:`y = xW`.

A path is two functions and a flag, not a ``custom_vjp`` function, because the
routed dot (routing.py) needs to run the forward legs of two paths under one
``lax.cond`` and keep the residuals in slots it lays out itself:

* ``forward(x [M,K], kernel [K,N]) -> (y [M,N] in x.dtype, residuals)``, where
  ``residuals`` is a tuple of arrays other than ``x`` and ``kernel``;
* ``backward(residuals, x, kernel, g) -> (dx in g.dtype, dkernel in kernel.dtype)``,
  where ``x`` is the saved input if ``saves_input``, else its
  ``jax.ShapeDtypeStruct`` (shape, dtype, and sharding under an explicit mesh).

``x`` and ``kernel`` are kept outside the path's residuals so that a routed dot
keeps them once (and a scan can forward the kernel slice instead of copying it).

A path that ``takes_history`` (delayed scaling, delayed_scaling.py) scales its operands from
the unit's amax history (amax_history.py, float32[3, H]) and observes the amaxes itself (from
what it already reads, so no pass of their own): ``forward(x, kernel, history) -> (y,
residuals, float32[2] amaxes of x and W)`` and ``backward(...) -> (dx, dkernel, float32[]
amax of g)``. Given a history, the dot wrappers observe any other path's amaxes directly
(``call_forward`` / ``call_backward``) and return the next history as the history's
cotangent.

Under a mesh with explicit axes ``dx`` and ``dkernel`` must have the shardings of
``x`` and ``kernel`` (JAX checks a custom backward's output types), and a matmul
contracting an axis sharded on both operands needs its ``out_sharding``; the
backward reads them with ``explicit_sharding.out_sharding(x)`` and
``out_sharding(kernel)``, both None without explicit axes.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable

import jax
import jax.numpy as jnp

from gnmr_jax.precision import amax_history, explicit_sharding


@dataclasses.dataclass(frozen=True)
class Hoisted:
  """A path's quantization split from its GEMMs (the per-tensor recipes, per_tensor.py), so
  that a routed dot (routing.py) quantizes outside its ``lax.cond`` (in the fusions that
  produce the operands, as the static step does) and the cond chooses only the GEMMs. The
  recovery branch ignores the codes; given a history, both branches observe it from them.

  Attributes:
    quantize_inputs: ``(x, kernel, history) -> (operands, float32[2] observed amaxes)``.
    forward: ``(operands, y dtype) -> (y, residuals)``, the residuals ``Path.forward``
      returns.
    quantize_gradient: ``(g, history) -> (gradient operands, float32[] observed amax)``.
    backward: ``(residuals, x, kernel, gradient operands, dx dtype) -> (dx, dkernel)``.
  """

  quantize_inputs: Callable
  forward: Callable
  quantize_gradient: Callable
  backward: Callable


@dataclasses.dataclass(frozen=True)
class Path:
  """Forward/backward legs of one precision path (see the module docstring)."""

  forward: Callable
  backward: Callable
  saves_input: bool
  takes_history: bool = False
  hoisted: Hoisted | None = None


def call_forward(path: Path, x, kernel, history=None):
  """``(y, residuals, observed)``: the forward with the unit's history when the path takes
  one; ``observed`` is float32[2] (max|x|, max|W|) when a history is given, else None."""
  if path.takes_history:
    return path.forward(x, kernel, history)
  y, residuals = path.forward(x, kernel)
  if history is None:
    return y, residuals, None
  return y, residuals, jnp.stack([amax_history.amax(x), amax_history.amax(kernel)])


def call_backward(path: Path, residuals, x, kernel, g, observe: bool):
  """``(dx, dkernel, observed)``: ``observed`` is float32[] max|g| when ``observe``."""
  if path.takes_history:
    return path.backward(residuals, x, kernel, g)
  dx, dkernel = path.backward(residuals, x, kernel, g)
  return dx, dkernel, amax_history.amax(g) if observe else None


def next_history(history, observed_forward, observed_gradient):
  """The history's cotangent (the next history), or None without a history."""
  if history is None:
    return None
  return amax_history.push(history, observed_forward[0], observed_forward[1],
                           observed_gradient)


def path_dot(path: Path):
  """The path as a differentiable ``dot(x [M,K], kernel [K,N]) -> [M,N]`` (static use).

  Args:
    path: a ``Path``.

  Returns:
    A ``jax.custom_vjp`` function whose residuals are the path's residuals, the
    kernel, and ``x`` iff ``path.saves_input`` (wrapped so that, under explicit mesh
    axes, an ``x`` sharding the contraction like a row-parallel kernel gets it gathered
    first, as in ``policy.dot``; otherwise it is called as is).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from gnmr_jax.precision import bf16
    >>> dot = path_dot(bf16.PATH)
    >>> jax.grad(lambda w: dot(jnp.ones((2, 3)), w).sum())(jnp.ones((3, 4)))[0].tolist()
    [2.0, 2.0, 2.0, 2.0]
  """

  @jax.custom_vjp
  def dot(x, kernel, history):
    return call_forward(path, x, kernel, history)[0]

  def dot_fwd(x, kernel, history):
    y, residuals, observed = call_forward(path, x, kernel, history)
    # x's type rides along as static structure: a path that does not save x still
    # learns x's sharding, which dx must have under an explicit mesh.
    return y, (residuals, x if path.saves_input else explicit_sharding.static_type(x),
               kernel, history, observed)

  def dot_bwd(saved, g):
    residuals, x, kernel, history, observed = saved
    x = x if path.saves_input else x.aval
    dx, dkernel, observed_g = call_backward(path, residuals, x, kernel, g,
                                            history is not None)
    return dx, dkernel, next_history(history, observed, observed_g)

  dot.defvjp(dot_fwd, dot_bwd)
  # A partial, not a function: modules set its __doc__ (bf16_dot), as on a custom_vjp.
  return functools.partial(_row_parallel_dot, dot, path.takes_history)


def _row_parallel_dot(dot, takes_history, x, kernel, history=None):
  """dot(x, kernel) with x's K shards gathered when x and a row-parallel kernel both shard K.

  That contraction is ill-typed under explicit axes; the gather (as in policy.dot, a no-op
  otherwise) sits outside the custom_vjp, so its transpose gives dx x's own sharding.
  ``history``: the unit's amax history (float32[3, H]), required by a path that takes one
  and observed for any path when given (its cotangent is the next history).
  """
  if takes_history and history is None:
    raise ValueError('this path scales from an amax history (delayed scaling): pass the '
                     "unit's history, float32[3, H] (amax_history.init(H)).")
  return dot(explicit_sharding.unshard_contraction(x, kernel), kernel, history)


def _call_leg(leg, lhs, rhs, out_dtype, out_sharding):
  """``leg(lhs, rhs, out_dtype)`` with a result of ``out_sharding`` (None: as is).

  A leg that takes an ``out_sharding`` keyword gets it; one that does not (a
  plain ``(a, b, out_dtype)`` function written before explicit meshes) runs under
  ``jax.sharding.auto_axes``, where the partitioner picks the collectives, with
  its result resharded to ``out_sharding``.
  """
  if out_sharding is None:
    return leg(lhs, rhs, out_dtype)
  if _takes_out_sharding(leg):
    return leg(lhs, rhs, out_dtype, out_sharding=out_sharding)
  return jax.sharding.auto_axes(
      lambda a, b: leg(a, b, out_dtype), out_sharding=out_sharding)(lhs, rhs)


def _takes_out_sharding(fn) -> bool:
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):  # builtins without a signature
    return False
  return any(p.name == 'out_sharding' or p.kind is p.VAR_KEYWORD for p in params)


def three_leg_path(forward, dlhs, drhs) -> Path:
  r"""A path from its three matmuls (AQT's fwd/dlhs/drhs legs); residuals: x, W.

  With :math:`y = xW`: :math:`\partial x = g W^T`, :math:`\partial W = x^T g`.
  Under an explicit-axis mesh the backward legs are called with
  ``out_sharding=`` the sharding of ``x`` (dlhs) and of ``W`` (drhs), as
  ``jnp.dot``'s gradients get; a leg without that keyword runs under
  ``jax.sharding.auto_axes`` instead. Without explicit axes no leg gets it.

  Args:
    forward: ``(x [M,K], W [K,N], out_dtype) -> y [M,N]``.
    dlhs: ``(g [M,N], W^T [N,K], out_dtype[, out_sharding]) -> dx [M,K]``.
    drhs: ``(x^T [K,M], g [M,N], out_dtype[, out_sharding]) -> dW [K,N]``.

  Returns:
    A ``Path`` with ``saves_input=True`` and no residuals of its own.

  Example:
    >>> import jax.numpy as jnp
    >>> def f32_matmul(a, b, out_dtype):
    ...   return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)).astype(out_dtype)
    >>> path = three_leg_path(f32_matmul, f32_matmul, f32_matmul)
    >>> path_dot(path)(jnp.ones((2, 3)), jnp.ones((3, 4))).shape, path.saves_input
    ((2, 4), True)
  """
  def backward(residuals, x, kernel, g):
    del residuals
    return (_call_leg(dlhs, g, kernel.T, g.dtype, explicit_sharding.out_sharding(x)),
            _call_leg(drhs, x.T, g, kernel.dtype, explicit_sharding.out_sharding(kernel)))

  return Path(forward=lambda x, kernel: (forward(x, kernel, x.dtype), ()),
              backward=backward, saves_input=True)
