r"""A precision path: an explicit forward and backward for :math:`y = xW`.

A path is two functions and a flag, not a ``custom_vjp`` function, because the
routed dot (routing.py) needs to run the forward legs of two paths under one
``lax.cond`` and keep the residuals in slots it lays out itself:

* ``forward(x [M,K], kernel [K,N]) -> (y [M,N] in x.dtype, residuals)``, where
  ``residuals`` is a tuple of arrays other than ``x`` and ``kernel``;
* ``backward(residuals, x, kernel, g) -> (dx in g.dtype, dkernel in kernel.dtype)``,
  where ``x`` is None unless ``saves_input``.

``x`` and ``kernel`` are kept outside the path's residuals so that a routed dot
keeps them once (and a scan can forward the kernel slice instead of copying it).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax


@dataclasses.dataclass(frozen=True)
class Path:
  """Forward/backward legs of one precision path (see the module docstring)."""

  forward: Callable
  backward: Callable
  saves_input: bool


def path_dot(path: Path):
  """The path as a differentiable ``dot(x [M,K], kernel [K,N]) -> [M,N]`` (static use).

  Args:
    path: a ``Path``.

  Returns:
    A ``jax.custom_vjp`` function whose residuals are the path's residuals, the
    kernel, and ``x`` iff ``path.saves_input``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from gnmr_jax.precision import bf16
    >>> dot = path_dot(bf16.PATH)
    >>> jax.grad(lambda w: dot(jnp.ones((2, 3)), w).sum())(jnp.ones((3, 4)))[0].tolist()
    [2.0, 2.0, 2.0, 2.0]
  """

  @jax.custom_vjp
  def dot(x, kernel):
    return path.forward(x, kernel)[0]

  def dot_fwd(x, kernel):
    y, residuals = path.forward(x, kernel)
    return y, (residuals, x if path.saves_input else None, kernel)

  def dot_bwd(saved, g):
    residuals, x, kernel = saved
    return path.backward(residuals, x, kernel, g)

  dot.defvjp(dot_fwd, dot_bwd)
  return dot


def three_leg_path(forward, dlhs, drhs) -> Path:
  r"""A path from its three matmuls (AQT's fwd/dlhs/drhs legs); residuals: x, W.

  With :math:`y = xW`: :math:`\partial x = g W^T`, :math:`\partial W = x^T g`.

  Args:
    forward: ``(x [M,K], W [K,N], out_dtype) -> y [M,N]``.
    dlhs: ``(g [M,N], W^T [N,K], out_dtype) -> dx [M,K]``.
    drhs: ``(x^T [K,M], g [M,N], out_dtype) -> dW [K,N]``.

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
  return Path(
      forward=lambda x, kernel: (forward(x, kernel, x.dtype), ()),
      backward=lambda residuals, x, kernel, g: (dlhs(g, kernel.T, g.dtype),
                                                drhs(x.T, g, kernel.dtype)),
      saves_input=True)
