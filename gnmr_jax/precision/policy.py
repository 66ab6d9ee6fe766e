"""The precision policy: one object the model calls for every projection."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_collections

from gnmr_jax.precision import config as config_lib
from gnmr_jax.precision import path as path_lib
from gnmr_jax.precision import registry, routing


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
  """Runs each matmul on the low-cost or the recovery path.

  Attributes:
    routed: True when ``dot`` branches on the recovery bit (mode='gnmr').
    low_cost: the low-cost ``Path`` (path.py).
    recovery: the recovery ``Path`` (used only when ``routed``).
    low_cost_path: registered name of the low-cost path.
    recovery_path: registered name of the recovery path.
    routed_scan_unroll: layers per unrolled scan iteration when routed, 0 = all.
  """

  routed: bool
  low_cost: path_lib.Path
  recovery: path_lib.Path
  low_cost_path: str
  recovery_path: str
  routed_scan_unroll: int = 0

  def dot(self, x: jax.Array, kernel: jax.Array, recover: jax.Array | None = None
          ) -> jax.Array:
    """Contracts the last axis of ``x`` [..., K] with the first of ``kernel`` [K, N].

    Static policies ignore ``recover`` (no cond in the program). Routed policies
    run ``lax.cond(recover, recovery, low_cost)``; ``recover=None`` means the unit
    is not recoverable and runs the low-cost path.

    Args:
      x: [..., K] activations.
      kernel: [K, N] weights (float32 masters are fine; paths cast).
      recover: bool[] scalar mask bit, or None.

    Returns:
      [..., N] in ``x.dtype``.

    Example:
      >>> import jax.numpy as jnp
      >>> from gnmr_jax.precision import make_policy, default_precision_config
      >>> policy = make_policy(default_precision_config())
      >>> policy.dot(jnp.ones((2, 5, 8)), jnp.ones((8, 3)), jnp.array(False)).shape
      (2, 5, 3)
    """
    if kernel.ndim != 2 or x.shape[-1] != kernel.shape[0]:
      raise ValueError(f'dot expects x [..., K] and kernel [K, N], got x {x.shape} and '
                       f'kernel {kernel.shape}.')
    x_2d = x.reshape(-1, x.shape[-1])
    if self.routed and recover is not None:
      y_2d = self._routed_dot(x_2d, kernel, routing.check_recover(recover))
    else:
      y_2d = self._static_dot(x_2d, kernel)
    return y_2d.reshape(x.shape[:-1] + (kernel.shape[1],))

  def dot_general(self, recover: jax.Array | None = None):
    """A ``lax.dot_general``-compatible function for ``flax.linen.Dense(dot_general=...)``.

    Supports contracting trailing lhs axes with the same number of leading rhs
    axes, no batch axes (Dense and DenseGeneral over trailing axes).

    Args:
      recover: bool[] scalar mask bit for the unit, or None.

    Returns:
      ``fn(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None)``.

    Example:
      A Flax ``Dense`` whose matmul runs ``lax.cond(recover, bf16, int8)``:

      >>> import flax.linen as nn, jax, jax.numpy as jnp
      >>> from gnmr_jax.precision import make_policy, default_precision_config
      >>> policy = make_policy(default_precision_config())  # mode='gnmr': int8 / bf16
      >>> layer = nn.Dense(3, dot_general=policy.dot_general(jnp.array(True)))
      >>> x = jnp.ones((2, 8))
      >>> variables = layer.init(jax.random.key(0), x)
      >>> layer.apply(variables, x).shape
      (2, 3)
      >>> 'cond' in str(jax.make_jaxpr(lambda v: layer.apply(v, x))(variables))
      True
    """

    def dot_general(lhs, rhs, dimension_numbers, precision=None,
                    preferred_element_type=None, **unused_kwargs):
      del precision  # Each path fixes its own operand precision.
      (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
      num = len(lhs_contract)
      if (tuple(lhs_batch) or tuple(rhs_batch)
          or tuple(lhs_contract) != tuple(range(lhs.ndim - num, lhs.ndim))
          or tuple(rhs_contract) != tuple(range(num))):
        raise ValueError('policy.dot_general supports dimension_numbers contracting the '
                         'trailing lhs axes with the leading rhs axes and no batch axes, '
                         f'got {dimension_numbers}.')
      k = math.prod(lhs.shape[lhs.ndim - num:])
      out_shape = rhs.shape[num:]
      y = self.dot(lhs.reshape(lhs.shape[:lhs.ndim - num] + (k,)),
                   rhs.reshape(k, math.prod(out_shape)), recover)
      y = y.reshape(y.shape[:-1] + out_shape)
      return y if preferred_element_type is None else y.astype(preferred_element_type)

    return dot_general

  @functools.cached_property
  def _static_dot(self):
    return path_lib.path_dot(self.low_cost)

  @functools.cached_property
  def _routed_dot(self):
    return routing.routed_dot(self.recovery, self.low_cost)

  def scan_unroll(self, num_layers: int) -> int:
    """The ``unroll=`` a model should give its layer scan: 1 if static, else
    ``routed_scan_unroll`` (0 meaning ``num_layers``, fully unrolled).

    Example:
      >>> from gnmr_jax.precision import make_policy, default_precision_config
      >>> config = default_precision_config()
      >>> make_policy(config).scan_unroll(12)   # routed, routed_scan_unroll=0
      12
      >>> config.mode = 'static'
      >>> make_policy(config).scan_unroll(12)
      1
    """
    if not self.routed:
      return 1
    return num_layers if self.routed_scan_unroll == 0 else min(
        self.routed_scan_unroll, num_layers)


def make_policy(config: ml_collections.ConfigDict) -> PrecisionPolicy:
  """Maps a precision config to a policy, validating every field first.

  Args:
    config: see ``default_precision_config``.

  Returns:
    A ``PrecisionPolicy``; ``routed`` iff ``config.mode == 'gnmr'``.

  Example:
    >>> from gnmr_jax.precision import make_policy, default_precision_config
    >>> config = default_precision_config()
    >>> config.mode, config.low_cost_path = 'static', 'bf16'   # the bf16 reference
    >>> make_policy(config).routed
    False
  """
  config_lib.validate_config(config)
  routed = config.mode == 'gnmr'
  low_cost = registry.get_path(config.low_cost_path)(config, 'low_cost')
  recovery = (registry.get_path(config.recovery_path)(config, 'recovery')
              if routed else low_cost)
  return PrecisionPolicy(
      routed=routed, low_cost=low_cost, recovery=recovery,
      low_cost_path=config.low_cost_path,
      recovery_path=config.recovery_path if routed else config.low_cost_path,
      routed_scan_unroll=config.routed_scan_unroll)
