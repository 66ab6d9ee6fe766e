"""The precision policy: one object the model calls for every projection."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import ml_collections

from gnmr_jax.precision import config as config_lib
from gnmr_jax.precision import explicit_sharding
from gnmr_jax.precision import path as path_lib
from gnmr_jax.precision import native_microscaling, registry, routing, scaling, side_buffer


def _check_dot_shapes(x, kernel) -> None:
  if kernel.ndim != 2 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(f'dot expects x [..., K] and kernel [K, N], got x {x.shape} and '
                     f'kernel {kernel.shape}.')


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
  """Runs each matmul on the low-cost or the recovery path.

  Attributes:
    routed: True when ``dot`` branches on the recovery bit (mode='gnmr').
    low_cost: the low-cost ``Path`` (path.py).
    recovery: the recovery ``Path`` (used only when ``routed``).
    low_cost_path: registered name of the low-cost path.
    recovery_path: registered name of the recovery path.
    routed_scan_unroll: layers per unrolled scan iteration when routed, 0 = all, -1 = per
      backend (ROUTED_SCAN_UNROLL_BY_PLATFORM).
    recovery_storage: where routed units keep the recovery path's residuals:
      'side_buffer' (one buffer for ``side_buffer_units`` recovered units,
      threaded with ``dot_side``) or 'per_unit' (every unit has slots for both
      paths, ``dot``).
    side_buffer_units: how many recovered units the side buffer holds (the
      controller's max_o; 0 = none: every unit runs the low-cost path), or None
      when unset (a policy that needs a buffer then refuses to build one).
  """

  routed: bool
  low_cost: path_lib.Path
  recovery: path_lib.Path
  low_cost_path: str
  recovery_path: str
  routed_scan_unroll: int = -1
  recovery_storage: str = 'per_unit'
  side_buffer_units: int | None = None
  amax_history_length: int = 0

  @property
  def takes_history(self) -> bool:
    """Whether a path this policy runs scales from its unit's amax history (delayed
    scaling): ``dot`` then needs ``history=``, the unit's float32[3, amax_history_length]."""
    return self.low_cost.takes_history or (self.routed and self.recovery.takes_history)

  def dot(self, x: jax.Array, kernel: jax.Array, recover: jax.Array | None = None,
          history: jax.Array | None = None) -> jax.Array:
    """Contracts the last axis of ``x`` [..., K] with the first of ``kernel`` [K, N].

    Static policies ignore ``recover`` (no cond in the program). Routed policies
    run ``lax.cond(recover, recovery, low_cost)``; ``recover=None`` means the unit
    is not recoverable and runs the low-cost path. The unit keeps both paths'
    residuals in its own slots (merged by shape and dtype); ``dot_side`` keeps the
    recovery path's in the shared side buffer instead.

    Args:
      x: [..., K] activations.
      kernel: [K, N] weights (float32 masters are fine; paths cast).
      recover: bool[] scalar mask bit, or None.
      history: the unit's amax history (amax_history.py, float32[3, H]) or None; required
        when ``takes_history``; given, its cotangent is the next history.

    Returns:
      [..., N] in ``x.dtype``.

    Example:
      >>> import jax.numpy as jnp
      >>> from gnmr_jax.precision import make_policy, default_precision_config
      >>> policy = make_policy(default_precision_config())
      >>> policy.dot(jnp.ones((2, 5, 8)), jnp.ones((8, 3)), jnp.array(False)).shape
      (2, 5, 3)
    """
    _check_dot_shapes(x, kernel)
    x_2d = explicit_sharding.unshard_contraction(x.reshape(-1, x.shape[-1]), kernel)
    if self.routed and recover is not None:
      y_2d = self._routed_dot(x_2d, kernel, routing.check_recover(recover), history=history)
    else:
      y_2d = self._static_dot(x_2d, kernel, history)
    return y_2d.reshape(x.shape[:-1] + (kernel.shape[1],))

  def dot_general(self, recover: jax.Array | None = None):
    """A ``lax.dot_general``-compatible function for ``flax.linen.Dense(dot_general=...)``.

    Supports contracting trailing lhs axes with the same number of leading rhs
    axes, no batch axes (Dense and DenseGeneral over trailing axes). An
    ``out_sharding`` (as ``nnx.Linear(...)(x, out_sharding=...)`` passes) reshards
    the result, which, as for ``lax.dot_general``, needs explicit mesh axes.

    Args:
      recover: bool[] scalar mask bit for the unit, or None.

    Returns:
      ``fn(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
      out_sharding=None)``.

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
                    preferred_element_type=None, out_sharding=None, **unused_kwargs):
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
      if preferred_element_type is not None:
        y = y.astype(preferred_element_type)
      return explicit_sharding.to_output(y, out_sharding)

    return dot_general

  def _largest_unit_side_words(self, unit_dims, dtype) -> int:
    """Words per token one recovery of the largest unit takes in the side buffer (0: none)."""
    if not self.routed or self.recovery_storage != 'side_buffer':
      return 0
    return max((routing.side_words_per_row(self.recovery, self.low_cost, k, n, dtype)
                for k, n in unit_dims), default=0)

  def side_words_per_token(self, unit_dims, dtype) -> int:
    """Side-buffer width (float32 words per token) for units of these [K, N] shapes.

    ``side_buffer_units`` times the largest unit's recovery residual words; 0
    (no buffer needed) unless routed with ``recovery_storage='side_buffer'`` and
    the recovery path keeps more than the low-cost path.

    Args:
      unit_dims: iterable of ``(K, N)`` kernel shapes of the recoverable units.
      dtype: the activations' dtype.

    Raises:
      ValueError: a buffer is needed but ``side_buffer_units`` is unset.
    """
    per_unit = self._largest_unit_side_words(unit_dims, dtype)
    if per_unit and self.side_buffer_units is None:
      raise ValueError(
          f'the routed {self.low_cost_path}/{self.recovery_path} policy keeps recovery '
          "residuals in a side buffer, but its size is unset: set the precision config's "
          "side_buffer_units, or pass the controller's max_o as make_policy(..., "
          "max_recovered=), or use recovery_storage='per_unit'.")
    return per_unit * self.side_buffer_units

  def init_side(self, token_shape, unit_dims, dtype) -> side_buffer.SideState | None:
    """An empty side state for one forward pass, or None when none is needed.

    Args:
      token_shape: the activations' leading (token) axes, e.g. ``(batch, seq)``.
      unit_dims: ``(K, N)`` of every recoverable unit's kernel.
      dtype: the activations' dtype (a bf16 recovery path keeps x at its size).

    Example:
      >>> import jax.numpy as jnp
      >>> from gnmr_jax.precision import make_policy, default_precision_config
      >>> config = default_precision_config()
      >>> config.low_cost_path = config.recovery_path = 'saved_activation'  # 4/8 bits
      >>> policy = make_policy(config, max_recovered=2)
      >>> side = policy.init_side((2, 5), [(8, 3)], jnp.bfloat16)
      >>> side.buffer.shape   # 2 units x ceil((8 bytes + 4 scale bytes) / 3) words
      (2, 5, 8)
      >>> y, side = policy.dot_side(jnp.ones((2, 5, 8)), jnp.ones((8, 3)), jnp.array(True), side)
      >>> int(side.offset)
      4
      >>> make_policy(default_precision_config()).init_side((2, 5), [(8, 3)], jnp.bfloat16) is None
      True
    """
    if not self._largest_unit_side_words(unit_dims, dtype):
      return None  # Nothing to keep aside: dot_side is dot.
    # With side_buffer_units=0 the buffer has no room: every unit runs the low-cost path.
    return side_buffer.init(token_shape, self.side_words_per_token(unit_dims, dtype))

  def dot_side(self, x: jax.Array, kernel: jax.Array, recover: jax.Array | None,
               side: side_buffer.SideState | None, history: jax.Array | None = None
               ) -> tuple[jax.Array, side_buffer.SideState | None]:
    """``dot`` that threads the side state (``init_side``) through the unit.

    With ``side=None`` this is ``(dot(x, kernel, recover), None)``. Pass the
    returned state to the next unit, and the last one to
    ``side_buffer.attach`` on the model's output.

    Args:
      x: [..., K] activations; ``side.buffer`` is [..., W] with the same
        leading axes.
      kernel: [K, N] weights.
      recover: bool[] mask bit, or None (the unit runs the low-cost path).
      side: a ``SideState`` or None.
      history: the unit's amax history, as in ``dot``.

    Returns:
      ``(y [..., N], side)``.
    """
    if side is None or recover is None:
      return self.dot(x, kernel, recover, history), side
    if side.buffer.shape[:-1] != x.shape[:-1]:
      raise ValueError(f'side buffer {side.buffer.shape} must have the leading axes of '
                       f'x {x.shape}.')
    _check_dot_shapes(x, kernel)
    rows = math.prod(x.shape[:-1])
    x_2d = explicit_sharding.unshard_contraction(x.reshape(rows, x.shape[-1]), kernel)
    # Explicit meshes: the buffer must shard its rows like the tokens (no-op otherwise).
    buffer_2d = explicit_sharding.like_rows(side.buffer.reshape(rows, -1), x_2d)
    y_2d, out = self._routed_side_dot(
        x_2d, kernel, routing.check_recover(recover), side._replace(buffer=buffer_2d),
        history=history)
    buffer = out.buffer.reshape(side.buffer.shape)
    return y_2d.reshape(x.shape[:-1] + (kernel.shape[1],)), out._replace(buffer=buffer)

  @functools.cached_property
  def _routed_side_dot(self):
    return routing.routed_side_dot(self.recovery, self.low_cost)

  @functools.cached_property
  def _static_dot(self):
    return path_lib.path_dot(self.low_cost)

  @functools.cached_property
  def _routed_dot(self):
    return routing.routed_dot(self.recovery, self.low_cost)

  def scan_unroll(self, num_layers: int, platform: str = 'cpu') -> int:
    """The ``unroll=`` a model should give its layer scan on ``platform``.

    1 if static; else ``routed_scan_unroll`` (0 meaning ``num_layers``, fully unrolled; -1
    the backend's choice in ``ROUTED_SCAN_UNROLL_BY_PLATFORM``).

    Args:
      num_layers: the model's depth.
      platform: the devices' platform (``'cpu'``, ``'gpu'``, ``'tpu'``; ``'cuda'`` and
        ``'rocm'`` count as ``'gpu'``), e.g. ``mesh.devices.flat[0].platform``.

    Example:
      >>> from gnmr_jax.precision import make_policy, default_precision_config
      >>> config = default_precision_config()
      >>> policy = make_policy(config)          # routed, routed_scan_unroll=-1
      >>> policy.scan_unroll(12, 'gpu'), policy.scan_unroll(12, 'tpu')
      (12, 1)
      >>> config.mode = 'static'
      >>> make_policy(config).scan_unroll(12, 'gpu')
      1
    """
    if not self.routed:
      return 1
    unroll = self.routed_scan_unroll
    if unroll == -1:
      platform = {'cuda': 'gpu', 'rocm': 'gpu'}.get(platform, platform)
      unroll = ROUTED_SCAN_UNROLL_BY_PLATFORM.get(platform, 0)
    return num_layers if unroll == 0 else min(unroll, num_layers)


# routed_scan_unroll=-1, per platform (0 = fully unrolled). GPU: conditionals in a scanned loop
# cost +14..18% step time on an H200, unrolled +0.3% (../shared/reference/gpu-anchors.md);
# unrolled with remat, the model stops XLA merging the recomputation into the forward
# (model.py), so the step's temporaries stay at the static step's. TPU: the loop stays rolled:
# compiled for v5e-4 at 1B (BENCHMARKS.md "Routed step at scale") the rolled routed step matches
# the static one's compile time (1.00x; unrolled 2.15x) at 1.10x its temporaries and 1.21x its
# program, and a TPU conditional is decided on the chip, without the host (its step time is not
# measured: no TPU was lent). CPU: unrolled, as every test and experiment here ran.
ROUTED_SCAN_UNROLL_BY_PLATFORM = {'gpu': 0, 'tpu': 1, 'cpu': 0}


def make_policy(config: ml_collections.ConfigDict,
                max_recovered: int | None = None, device=None) -> PrecisionPolicy:
  """Maps a precision config to a policy, validating every field first.

  Args:
    config: see ``default_precision_config``.
    max_recovered: the controller's max_o; sizes the side buffer when
      ``config.side_buffer_units`` is 0.
    device: the jax Device the policy's programs are compiled for (default
      ``jax.devices()[0]``, asked only by an NVFP4 / MXFP8 path): resolves
      ``microscaling_impl='auto'`` and refuses ``'native'`` where it cannot run.

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
  config = scaling.resolved_config(native_microscaling.resolved_config(config, device), device)
  routed = config.mode == 'gnmr'
  low_cost = registry.get_path(config.low_cost_path)(config, 'low_cost')
  recovery = (registry.get_path(config.recovery_path)(config, 'recovery')
              if routed else low_cost)
  return PrecisionPolicy(
      routed=routed, low_cost=low_cost, recovery=recovery,
      low_cost_path=config.low_cost_path,
      recovery_path=config.recovery_path if routed else config.low_cost_path,
      routed_scan_unroll=config.routed_scan_unroll,
      recovery_storage=config.recovery_storage,
      side_buffer_units=config.side_buffer_units or max_recovered,
      amax_history_length=config.amax_history_length)


def recovery_policy(config: ml_collections.ConfigDict, device=None) -> PrecisionPolicy:
  """A static policy that runs every unit on the configured *recovery* path (no conds).

  The recovery-gap measurement computes g_rec with it: the same numerics as a routed policy
  with every bit True, without a cond per unit or a side buffer sized for max_o units.

  Example:
    >>> from gnmr_jax.precision import default_precision_config
    >>> policy = recovery_policy(default_precision_config())
    >>> policy.routed, policy.low_cost_path, policy.recovery_path
    (False, 'bf16', 'bf16')
  """
  make_policy(config, device=device)  # validates every field
  config = scaling.resolved_config(native_microscaling.resolved_config(config, device), device)
  name = config.recovery_path
  path = registry.get_path(name)(config, 'recovery')
  return PrecisionPolicy(routed=False, low_cost=path, recovery=path,
                         low_cost_path=name, recovery_path=name,
                         amax_history_length=config.amax_history_length)
