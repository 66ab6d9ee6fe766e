"""Registry of precision paths: a path is added by registering one builder.

A builder is ``builder(config, role) -> Path`` where ``config`` is the precision
``ConfigDict``, ``role`` is ``'low_cost'`` or ``'recovery'`` (a path may store or
compute differently in each role, e.g. the saved-activation bit width), and the
``Path`` (path.py) gives the forward and backward legs of
``dot(x [M, K], kernel [K, N]) -> [M, N]`` (output in ``x.dtype``, ``dx`` in
``x.dtype``, ``dkernel`` in ``kernel.dtype``). GNMR never imports a
path: it only sees the policy built from these names.
"""

from __future__ import annotations

from typing import Callable

import jax
import ml_collections

from gnmr_jax.precision import path as path_lib

Dot = Callable[[jax.Array, jax.Array], jax.Array]
PathBuilder = Callable[[ml_collections.ConfigDict, str], 'path_lib.Path']

ROLES = ('low_cost', 'recovery')

_PATHS: dict[str, PathBuilder] = {}


def fixed_path(path: 'path_lib.Path') -> PathBuilder:
  """A builder for a path that is the same whatever the config and role (bf16, int8, fp8)."""
  def build(config, role):
    del config, role
    return path
  return build


def register_path(name: str, builder: PathBuilder) -> PathBuilder:
  """Registers ``builder`` under ``name`` (later registrations must use new names).

  Args:
    name: path name used in ``config.low_cost_path`` / ``config.recovery_path``.
    builder: ``(config, role) -> Path``, see the module docstring.

  Returns:
    ``builder``, so this can be used as a decorator helper.

  Example:
    A float32 recovery path from its three matmuls (forward, dlhs, drhs), routed
    against the int8 low-cost path:

    >>> import jax.numpy as jnp
    >>> from gnmr_jax import precision
    >>> from gnmr_jax.precision.path import three_leg_path
    >>> def f32_matmul(a, b, out_dtype):
    ...   return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)).astype(out_dtype)
    >>> f32_path = three_leg_path(f32_matmul, f32_matmul, f32_matmul)
    >>> _ = precision.register_path('doc_f32', lambda config, role: f32_path)
    >>> config = precision.default_precision_config()
    >>> config.recovery_path = 'doc_f32'
    >>> policy = precision.make_policy(config)
    >>> policy.recovery_path, policy.low_cost_path
    ('doc_f32', 'int8')
    >>> policy.dot(jnp.full((1, 4), 0.1), jnp.ones((4, 2)), jnp.array(True)).tolist()
    [[0.4000000059604645, 0.4000000059604645]]
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f'register_path: name must be a non-empty str, got {name!r}.')
  if name in _PATHS and _PATHS[name] is not builder:
    raise ValueError(f'register_path: path {name!r} is already registered; '
                     f'registered paths: {available_paths()}.')
  _PATHS[name] = builder
  return builder


def available_paths() -> tuple[str, ...]:
  """Names of the registered paths, sorted.

  Example:
    >>> from gnmr_jax.precision import available_paths
    >>> {'bf16', 'int8', 'fp8', 'saved_activation', 'blockwise'} <= set(available_paths())
    True
  """
  return tuple(sorted(_PATHS))


def get_path(name: str) -> PathBuilder:
  """The builder registered as ``name``; ValueError listing the valid names otherwise.

  Example:
    >>> get_path('int3')
    Traceback (most recent call last):
    ...
    ValueError: Unknown precision path 'int3'; valid paths: (...'int8'...).
  """
  if name not in _PATHS:
    raise ValueError(f'Unknown precision path {name!r}; valid paths: {available_paths()}.')
  return _PATHS[name]
