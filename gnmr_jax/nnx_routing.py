r"""Routing an existing Flax NNX model through a precision policy, unit by unit.

``route(model, policy, recovery_mask)`` is a context manager: inside it, every
``nnx.Linear`` and ``nnx.LinearGeneral`` (their ``dot_general``; LinearGeneral over
trailing input axes, without batch axes) and ``nnx.Einsum`` (its ``einsum_op``)
whose kernel has a bit in ``recovery_mask`` runs
``lax.cond(bit, recovery, low_cost)`` of ``policy``; on exit the layers get
their own functions back. Use it inside the traced step::

  @nnx.jit
  def train_step(model, optimizer, x, y):
    mask = gnmr_jax.recovery_mask(optimizer.opt_state)  # traced, one bit per unit
    def loss_fn(model):
      with nnx_routing.route(model, policy, mask):
        return jnp.mean((model(x) - y) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

Why a context manager that installs small modules, rather than
``nnx.Linear(dot_general=policy.dot_general(bit))``: a ``dot_general`` attribute
is static, so a bit closed over in it is either a constant baked into the
compiled step (set outside ``nnx.jit``: the step keeps running the path of the
first bit it was traced with, or retraces every step) or a tracer stored in a
static attribute (set inside: it outlives the trace and leaks). ``route``
instead installs ``RoutedDotGeneral``/``RoutedEinsum`` modules whose bit is an
``nnx.Variable`` (``RecoveryBit``), i.e. state: every NNX transform passes it as
a traced input (``nnx.jit`` never bakes it in; ``nnx.scan`` over layer-stacked
modules slices a bool[L] bit per layer, with the layer's kernel), and removing
the modules on exit leaves no tracer in the model.

The mask is a tree of bool arrays keyed like the model's params, a plain dict or
an ``nnx.State`` (``nnx.Variable`` boxes, as the optimizer state's, are unboxed):
the bit of the layer at module path ``p`` is the leaf at ``p + ('kernel',)``,
bool[] for one layer or bool[L] for a layer-stacked one. Leaves at other paths
(biases, norms, embeddings) are ignored; layers without a bit keep their own
function. Policies with ``recovery_storage='side_buffer'`` run their per-unit
storage here (``policy.dot``): the side buffer needs a state threaded through
the model (model.py).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import opt_einsum
from flax import nnx

from gnmr_jax.precision import explicit_sharding
from gnmr_jax.precision.policy import PrecisionPolicy

KERNEL = 'kernel'


class RecoveryBit(nnx.Variable):
  """A routed layer's recovery-mask bit (bool[], or bool[L] for stacked layers).

  A Variable type of its own, so ``nnx.Param`` filters (gradients, optimizers)
  never pick it up, and NNX transforms carry it as state, never as a constant.
  """


class RoutedDotGeneral(nnx.Module):
  """An ``nnx.Linear`` ``dot_general`` that runs ``policy.dot_general(bit)``."""

  def __init__(self, policy: PrecisionPolicy, bit: jax.Array):
    self.policy = policy
    self.bit = RecoveryBit(bit)

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    return self.policy.dot_general(self.bit[...])(
        lhs, rhs, dimension_numbers, precision=precision,
        preferred_element_type=preferred_element_type, out_sharding=out_sharding)


class RoutedEinsum(nnx.Module):
  """An ``nnx.Einsum`` ``einsum_op`` that contracts through ``policy.dot``.

  The input plays ``x`` and the kernel ``W`` of the policy's dot (per-row scales
  of the input, per-column scales of the kernel), whichever order ``jnp.einsum``
  would pick. Axes shared by both operands and kept in the output are batch axes
  (one routed dot per index, same bit).
  """

  def __init__(self, policy: PrecisionPolicy, bit: jax.Array):
    self.policy = policy
    self.bit = RecoveryBit(bit)

  def __call__(self, subscripts, lhs, rhs, precision=None, preferred_element_type=None,
               out_sharding=None):
    del precision  # Each path fixes its own operand precision.
    y = routed_einsum(self.policy, self.bit[...], subscripts, lhs, rhs)
    if preferred_element_type is not None:
      y = y.astype(preferred_element_type)
    return explicit_sharding.to_output(y, out_sharding)


def routed_einsum(policy: PrecisionPolicy, recover, subscripts: str, lhs: jax.Array,
                  rhs: jax.Array) -> jax.Array:
  """Two-operand einsum through ``policy.dot(x, kernel, recover)``.

  The operands are transposed to x [batch..., M, K] and kernel [batch..., K, N]
  (K: the contracted names, M / N: names of only the input / only the kernel),
  contracted by the policy, and put back in the output's order.

  Args:
    policy: a ``PrecisionPolicy``.
    recover: bool[] mask bit, or None.
    subscripts: an explicit two-operand equation, e.g. ``'...a,hab->...hb'``.
    lhs: the input (plays x).
    rhs: the kernel (plays W).

  Returns:
    The einsum, in ``lhs.dtype``.

  Raises:
    ValueError: a name summed within one operand only (not supported).

  Example:
    >>> import jax.numpy as jnp
    >>> from gnmr_jax.precision import make_policy, default_precision_config
    >>> policy = make_policy(default_precision_config())
    >>> routed_einsum(policy, jnp.array(True), 'nta,hab->nthb',
    ...               jnp.ones((2, 3, 4)), jnp.ones((5, 4, 6))).shape
    (2, 3, 5, 6)
  """
  inputs, out_names, _ = opt_einsum.parser.parse_einsum_input((subscripts, lhs, rhs))
  lhs_names, rhs_names = inputs.split(',')
  shared = set(lhs_names) & set(rhs_names)
  lonely = [n for n in lhs_names + rhs_names if n not in shared and n not in out_names]
  if lonely:
    raise ValueError(f'routed einsum {subscripts!r}: names {lonely} are summed within one '
                     'operand; only names shared by both operands may be contracted.')
  batch = [n for n in out_names if n in shared]
  contracted = [n for n in lhs_names if n in shared and n not in out_names]
  lhs_free = [n for n in lhs_names if n not in shared]
  rhs_free = [n for n in rhs_names if n not in shared]
  size = dict(zip(lhs_names, lhs.shape)) | dict(zip(rhs_names, rhs.shape))

  def prod(names):
    return math.prod(size[n] for n in names)

  x = jnp.transpose(lhs, [lhs_names.index(n) for n in batch + lhs_free + contracted])
  x = x.reshape([size[n] for n in batch] + [prod(lhs_free), prod(contracted)])
  kernel = jnp.transpose(rhs, [rhs_names.index(n) for n in batch + contracted + rhs_free])
  kernel = kernel.reshape([size[n] for n in batch] + [prod(contracted), prod(rhs_free)])
  dot = lambda a, b: policy.dot(a, b, recover)
  for _ in batch:  # The bit is closed over, unbatched: the cond stays a cond.
    dot = jax.vmap(dot)
  y = dot(x, kernel)
  y = y.reshape([size[n] for n in batch + lhs_free + rhs_free])
  order = batch + lhs_free + rhs_free
  return jnp.transpose(y, [order.index(n) for n in out_names])


def _key(entry) -> Any:
  for attr in ('key', 'name', 'idx'):
    if hasattr(entry, attr):
      return getattr(entry, attr)
  return entry


def mask_bits(recovery_mask) -> dict[tuple, jax.Array]:
  """The mask's bool leaves by key path, ``nnx.Variable`` boxes unboxed.

  Example:
    >>> import jax.numpy as jnp
    >>> bits = mask_bits({'up': {'kernel': jnp.array(True), 'bias': jnp.array(False)}})
    >>> sorted(bits)
    [('up', 'bias'), ('up', 'kernel')]
  """
  flat = jax.tree_util.tree_flatten_with_path(
      recovery_mask, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  bits = {}
  for path, leaf in flat:
    if isinstance(leaf, nnx.Variable):
      leaf = leaf[...]
    name = tuple(_key(entry) for entry in path)
    if jnp.result_type(leaf) != jnp.bool_:
      raise ValueError(f'recovery_mask leaf {"/".join(map(str, name))} must be bool, got '
                       f'{jnp.result_type(leaf)}.')
    bits[name] = leaf
  return bits


# The attribute each routable layer type calls its matmul through.
_ROUTABLE = ((nnx.Linear, 'dot_general', RoutedDotGeneral),
             (nnx.LinearGeneral, 'dot_general', RoutedDotGeneral),
             (nnx.Einsum, 'einsum_op', RoutedEinsum))


@contextlib.contextmanager
def route(model: nnx.Module, policy: PrecisionPolicy, recovery_mask
          ) -> Iterator[tuple[tuple, ...]]:
  """Runs the model's Linear/Einsum layers named in ``recovery_mask`` on ``policy``.

  Inside the block each such layer computes ``policy.dot_general(bit)`` (Linear)
  or ``routed_einsum(policy, bit, ...)`` (Einsum) with ``bit`` its kernel's leaf
  of the mask; on exit (also on an exception) every layer gets its own function
  back, so the model's graph is as before and keeps no tracer. Enter it inside
  the traced function (``nnx.jit``, ``nnx.value_and_grad``), around the
  forward pass. The bits may be traced (the controller's mask from the
  optimizer state) or concrete; either way they are state, not constants.

  Args:
    model: an NNX module (the whole model or a part).
    policy: a ``PrecisionPolicy`` (``gnmr_jax.precision.make_policy``). A static
      policy ignores the bits: every routed layer runs the low-cost path.
    recovery_mask: bool leaves keyed like the model's params (dict or
      ``nnx.State``; Variable boxes are unboxed); see the module docstring.

  Yields:
    The module paths of the routed layers, in graph order.

  Raises:
    ValueError: ``policy`` is not a PrecisionPolicy, a mask leaf is not bool, a
      layer is already routed, or no Linear/Einsum kernel has a bit in the mask
      (mask keyed differently from the model).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> from gnmr_jax.precision import make_policy, default_precision_config
    >>> policy = make_policy(default_precision_config())      # int8, recovery bf16
    >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    >>> @nnx.jit
    ... def apply(model, bit, x):
    ...   with route(model, policy, {'kernel': bit}):
    ...     return model(x)
    >>> x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    >>> bool((apply(model, jnp.array(True), x) != apply(model, jnp.array(False), x)).any())
    True
    >>> model.dot_general is jax.lax.dot_general   # restored
    True
  """
  if not isinstance(policy, PrecisionPolicy):
    raise ValueError('route: policy must be a gnmr_jax.precision.PrecisionPolicy '
                     f'(make_policy(config)), got {type(policy).__name__}.')
  bits = mask_bits(recovery_mask)
  targets = []
  for path, module in nnx.iter_modules(model):
    for layer_type, attr, routed_type in _ROUTABLE:
      if isinstance(module, layer_type) and path + (KERNEL,) in bits:
        if isinstance(getattr(module, attr), (RoutedDotGeneral, RoutedEinsum)):
          raise ValueError(f'route: layer {"/".join(map(str, path)) or "(root)"} is '
                           'already routed (nested route on the same model).')
        targets.append((path, module, attr, routed_type(policy, bits[path + (KERNEL,)])))
  if not targets:
    layers = [p for p, m in nnx.iter_modules(model)
              if isinstance(m, tuple(t for t, _, _ in _ROUTABLE))]
    raise ValueError(
        'route: no nnx.Linear/nnx.Einsum kernel of the model has a bit in recovery_mask; '
        f'layer paths are e.g. {layers[:4]}, mask paths e.g. {list(bits)[:4]} (the bit '
        "of the layer at path p is the mask's leaf at p + ('kernel',)).")
  swapped = []
  try:
    for _, module, attr, routed in targets:
      swapped.append((module, attr, getattr(module, attr)))
      # nnx.data: the routed module (and its bit) is a graph node, i.e. state.
      setattr(module, attr, nnx.data(routed))
    yield tuple(path for path, *_ in targets)
  finally:
    for module, attr, original in reversed(swapped):
      setattr(module, attr, nnx.static(original))
