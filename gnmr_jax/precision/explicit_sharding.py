"""Output shardings for the paths' hand-written matmuls under explicit-axis meshes.

Why: with explicit mesh axes (the default of ``jax.make_mesh`` in jax 0.10)
sharding is part of every array's type, and a ``dot_general`` whose contracting
axis is sharded on both operands (``x^T g`` over a data-sharded batch) has no
unique output type, so it must be given one. ``jnp.dot``'s own transpose rule
gives its gradients the shardings of the primal operands; the paths' custom
backwards do the same with ``out_sharding(x)`` / ``out_sharding(kernel)``.

Everything here returns None, or does nothing, unless the mesh has explicit
axes, so programs under an auto-axes mesh or no mesh stay what they were (same
jaxpr, same numerics).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec


def _context_mesh():
  return jax.sharding.get_abstract_mesh()


def _is_explicit(mesh) -> bool:
  return not mesh.empty and AxisType.Explicit in tuple(mesh.axis_types)


def out_sharding(value) -> NamedSharding | None:
  """The sharding a result shaped like ``value`` should get, or None (not explicit).

  Args:
    value: an array, a tracer or a ``jax.ShapeDtypeStruct``.

  Returns:
    ``value``'s sharding type (``jax.typeof(value).sharding``) when the mesh has
    explicit axes; an array typed without a mesh under such a context mesh counts
    as replicated on it (as in JAX's own transpose rules); None otherwise.

  Example:
    >>> import jax.numpy as jnp
    >>> out_sharding(jnp.ones((2, 3))) is None   # no mesh: nothing to say
    True
  """
  if isinstance(value, jax.ShapeDtypeStruct):
    sharding = value.sharding
  else:
    sharding = jax.typeof(value).sharding
  if isinstance(sharding, NamedSharding) and not sharding.mesh.empty:
    return sharding if _is_explicit(sharding.mesh) else None
  mesh = _context_mesh()
  if not _is_explicit(mesh):
    return None
  return NamedSharding(mesh, PartitionSpec(*[None] * len(value.shape)))


def dot_kwargs(sharding) -> dict:
  """``{'out_sharding': sharding}`` for ``lax.dot_general``, or {} when None.

  Passed only when set, so programs without explicit axes keep their jaxpr.
  """
  return {} if sharding is None else {'out_sharding': sharding}


def along_axis(scale: jax.Array, sharding: NamedSharding, axis: int) -> jax.Array:
  """A [M, 1] or [1, N] scale resharded to ``sharding``'s spec on ``axis`` only.

  A per-row / per-column quantization scale reduced over a sharded axis comes out
  replicated there; the rescale of a result of ``sharding`` then needs the scale
  on the result's row / column sharding, not on another one of the same axis.
  """
  spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
  target = [None, None]
  target[axis] = spec[axis]
  target = NamedSharding(sharding.mesh, PartitionSpec(*target))
  if out_sharding(scale) == target:
    return scale
  return jax.sharding.reshard(scale, target)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class StaticType:
  """An array's type kept as a static residual of a ``custom_vjp`` (no array leaf).

  A backward whose path does not save ``x`` still needs x's sharding (dx must
  have it under an explicit mesh); a residual that is pytree structure rather
  than data carries it for free.

  Attributes:
    aval: ``jax.ShapeDtypeStruct`` with the explicit sharding, or none.
  """

  aval: jax.ShapeDtypeStruct


def static_type(value) -> StaticType:
  """``value``'s shape and dtype, with its sharding when explicit, as a static residual."""
  return StaticType(jax.ShapeDtypeStruct(value.shape, value.dtype,
                                         sharding=out_sharding(value)))


def zeros(aval) -> jax.Array:
  """Zeros of ``aval``'s shape and dtype, typed with its sharding when explicit.

  A ``lax.cond`` needs both branches to return the same types; under an explicit
  mesh a zero-filled residual slot must therefore carry the real residual's sharding.
  """
  sharding = out_sharding(aval)
  if sharding is None:
    return jnp.zeros(aval.shape, aval.dtype)
  return jnp.zeros(aval.shape, aval.dtype, out_sharding=sharding)


def unshard_contraction(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """x [..., K] with its K axis gathered when x and kernel [K, N] both shard K (else as is).

  ``x @ kernel`` contracting an axis sharded on both operands (a row-parallel
  kernel) has no unique output type. Gathering x's K axis makes it well typed
  and keeps the per-row scales of the quantized paths over the whole row, as on
  one device. No-op unless explicit.
  """
  x_sharding, kernel_sharding = out_sharding(x), out_sharding(kernel)
  if x_sharding is None or kernel_sharding is None:
    return x
  x_spec = tuple(x_sharding.spec) + (None,) * (x.ndim - len(x_sharding.spec))
  kernel_spec = tuple(kernel_sharding.spec) + (None,) * (2 - len(kernel_sharding.spec))
  if x_spec[-1] is None or kernel_spec[0] is None:
    return x
  return jax.sharding.reshard(
      x, NamedSharding(x_sharding.mesh, PartitionSpec(*x_spec[:-1], None)))


def retype(value: jax.Array, aval) -> jax.Array:
  """``value`` resharded to ``aval``'s explicit sharding (no-op when there is none)."""
  sharding = out_sharding(aval)
  if sharding is None or out_sharding(value) == sharding:
    return value
  return jax.sharding.reshard(value, sharding)


def like_rows(value: jax.Array, rows_like: jax.Array) -> jax.Array:
  """``value`` [M, ...] resharded so its leading axis shards like ``rows_like``'s.

  The side buffer holds per-token rows; under an explicit mesh it must share the
  activations' token sharding, or the routed unit's ``lax.cond`` branches (one
  writes x-sharded rows into it, one passes it through) return different types.
  No-op unless explicit.
  """
  rows_sharding = out_sharding(rows_like)
  if rows_sharding is None:
    return value
  spec = PartitionSpec(rows_sharding.spec[0] if rows_sharding.spec else None,
                       *[None] * (value.ndim - 1))
  target = NamedSharding(rows_sharding.mesh, spec)
  if out_sharding(value) == target:
    return value
  return jax.sharding.reshard(value, target)


def to_output(y: jax.Array, sharding) -> jax.Array:
  """``y`` resharded to a caller's requested ``out_sharding`` (None: unchanged).

  As ``lax.dot_general``'s ``out_sharding``: meaningful with explicit axes only
  (JAX raises for a PartitionSpec without a mesh or naming auto axes).
  """
  return y if sharding is None else jax.sharding.reshard(y, sharding)
