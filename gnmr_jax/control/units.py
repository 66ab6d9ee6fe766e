"""Which leaves of a parameter tree are recoverable units: the unit layout and its codec.

A *recoverable unit* is one projection matrix (one leaf), or one slice of a
layer-stacked leaf along its layer axis (Flax ``nn.scan`` stacks per-layer
params into one leaf of shape ``[L, ...]``; each of the ``L`` slices is its
own unit). Unit selection is static: it depends only on key paths and shapes,
never on values, so it is resolved in Python at trace time.

Flax metadata boxes (Linen ``nn.Partitioned`` from ``nn.with_partitioning``,
NNX ``nnx.Variable`` in ``nnx.state(model)``) are looked through: a boxed kernel
is named ``hidden/kernel`` and handed to selectors as its array, exactly like
the unboxed gradient that reaches ``update``, so init and update agree.

:class:`UnitLayout` is the one object that flattens per-unit trees to a vector over the N
units (tree order, slices of layer-stacked leaves in layer order), unflattens vectors
back to trees and names the units; every module that does so uses it.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp

UnitSelector = Union[None, str, Callable[[str, Any], bool]]
LayerAxisSelector = Union[None, str, Callable[[str, Any], Optional[int]]]


def path_to_str(path: Sequence[Any]) -> str:
  """Joins a JAX key path with '/' (``('params', 'layers', 'q')`` -> ``'params/layers/q'``).

  These are the names that the ``units`` and ``layer_axis`` regexes are searched in.

  Example:
    >>> import jax
    >>> tree = {'params': {'mlp': {'kernel': 0, 'bias': 0}}, 'step': [0]}
    >>> [path_to_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    ['params/mlp/bias', 'params/mlp/kernel', 'step/0']
  """
  parts = []
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      parts.append(str(key.key))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      parts.append(str(key.name))
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(str(key.idx))
    elif isinstance(key, jax.tree_util.FlattenedIndexKey):
      parts.append(str(key.key))
    else:
      parts.append(str(key))
  return "/".join(parts)


def _box_types() -> tuple[type, ...]:
  """Flax's metadata box types, among the modules already imported.

  A box object can only exist once its module is imported, so looking in
  ``sys.modules`` finds every box without making ``import gnmr_jax`` import Flax.
  """
  types = []
  meta = sys.modules.get("flax.core.meta")
  if meta is not None:
    types.append(meta.AxisMetadata)  # linen Partitioned, LogicallyPartitioned
  variablelib = sys.modules.get("flax.nnx.variablelib")
  if variablelib is not None:
    types.append(variablelib.Variable)  # nnx Param, OptArray, ...
  return tuple(types)


def unbox(tree):
  """``tree`` with every Flax metadata box replaced by the array it holds.

  The box's own pytree children are read (not ``Partitioned.unbox()``, which
  would add a sharding constraint), so this works for any box holding one leaf.

  Example:
    >>> import flax.linen as nn, jax.numpy as jnp
    >>> boxed = {'kernel': nn.Partitioned(jnp.ones((2, 4)), names=(None, 'model'))}
    >>> jax.tree_util.tree_structure(unbox(boxed))
    PyTreeDef({'kernel': *})
  """
  types = _box_types()
  if not types:
    return tree

  def strip(x):
    if not isinstance(x, types):
      return x
    leaves = jax.tree_util.tree_leaves(x)
    if len(leaves) > 1:
      raise ValueError(f"gnmr: a {type(x).__name__} box holding {len(leaves)} arrays is not "
                       f"a parameter; expected one array per box.")
    return leaves[0] if leaves else None

  return jax.tree_util.tree_map(strip, tree, is_leaf=lambda x: isinstance(x, types))


@dataclasses.dataclass(frozen=True)
class LeafUnits:
  """How one leaf maps to units.

  Attributes:
    path: '/'-joined key path of the leaf.
    is_unit: whether the leaf holds recoverable units.
    layer_axis: axis whose slices are separate units, or None (the leaf is one unit).
    unit_shape: shape of the per-unit state leaf: () or (L,). () for non-units too.
  """

  path: str
  is_unit: bool
  layer_axis: Optional[int]
  unit_shape: tuple[int, ...]

  @property
  def num_units(self) -> int:
    if not self.is_unit:
      return 0
    return self.unit_shape[0] if self.unit_shape else 1


def _replicated(x):
  """``x`` resharded to replicated where its type carries a sharding (explicit mesh axes).

  Under an explicit-axis mesh a per-layer norm of a leaf sharded on its layer
  axis is itself sharded, and ``jnp.concatenate`` refuses operands of different
  shardings. The per-unit vectors are tiny, so every device gets all of them.
  Under auto axes (or no mesh) the type has no sharding and ``x`` is returned as is.
  """
  sharding = jax.typeof(x).sharding
  if all(axis is None for axis in sharding.spec):
    return x
  return jax.sharding.reshard(x, jax.sharding.NamedSharding(sharding.mesh,
                                                            jax.sharding.PartitionSpec()))


@dataclasses.dataclass(frozen=True)
class UnitLayout:
  """The unit layout of a (params-shaped) tree: one :class:`LeafUnits` per leaf, in tree order.

  It iterates, indexes and has a length like the tuple of its leaves. Per-unit trees (the
  controller's state, masks, recovery gaps) mirror the params with a leaf of shape () or
  (L,) (plus trailing axes) per unit leaf and a scalar per other leaf.

  Attributes:
    leaves: one LeafUnits per leaf of the (unboxed) tree.
    treedef: the structure of the unboxed tree.

  Example:
    >>> import jax.numpy as jnp
    >>> params = {'layers': {'w': jnp.zeros((2, 4, 4))}, 'head': jnp.zeros((4, 3)),
    ...           'norm': jnp.zeros(4)}
    >>> layout = layout_of(params, layer_axis=r'^layers/')
    >>> layout.num_units, layout.names()
    (3, ['head', 'layers/w[0]', 'layers/w[1]'])
    >>> mask = layout.unflat(jnp.array([True, False, True]), jnp.bool_)
    >>> mask['layers']['w'].tolist(), bool(mask['head']), mask['norm'].shape
    ([False, True], True, ())
    >>> layout.flat(mask).tolist()
    [True, False, True]
  """

  leaves: tuple[LeafUnits, ...]
  treedef: Any

  def __iter__(self):
    return iter(self.leaves)

  def __len__(self):
    return len(self.leaves)

  def __getitem__(self, index):
    return self.leaves[index]

  @property
  def num_units(self) -> int:
    return sum(u.num_units for u in self.leaves)

  @property
  def leaf_flags(self) -> list[bool]:
    """Whether each leaf holds units."""
    return [u.is_unit for u in self.leaves]

  def names(self) -> list[str]:
    """Unit names in flat order: the leaf path, 'path[l]' for the slices of a stacked leaf."""
    names = []
    for info in self.leaves:
      if info.is_unit:
        names.extend([f"{info.path}[{i}]" for i in range(info.unit_shape[0])]
                     if info.unit_shape else [info.path])
    return names

  def flat(self, tree, trailing: int = 0):
    """The unit leaves of a per-unit tree as one ``[N, *trailing]`` array (replicated); None
    without units. ``trailing`` counts the axes after the unit axes (the GNMR window's).
    A :class:`UnitValues` is already flat: its array is returned (replicated), after a
    check that its rows follow this layout."""
    tree = unbox(tree)
    if isinstance(tree, UnitValues):
      if tree.layout.unit_shapes() != self.unit_shapes():
        raise ValueError(
            f"per-unit values of another unit layout ({tree.layout.num_units} units of "
            f"{sum(u.is_unit for u in tree.layout)} leaves) read with this one "
            f"({self.num_units} units of {sum(u.is_unit for u in self)} leaves)")
      return _replicated(tree.values)
    leaves = jax.tree_util.tree_leaves(tree)
    parts = []
    for leaf, info in zip(leaves, self.leaves):
      if info.is_unit:
        shape = (info.num_units,) + tuple(jnp.shape(leaf)[jnp.ndim(leaf) - trailing:])
        parts.append(_replicated(jnp.reshape(leaf, shape)))
    if not parts:
      return None
    return jnp.concatenate(parts, axis=0)

  def unflat(self, vec, dtype, trailing_shape=()):
    """Inverse of :meth:`flat`: ``[N, *trailing_shape]`` back to a per-unit tree of ``dtype``;
    leaves that are not units get a scalar zero."""
    leaves, offset = [], 0
    for info in self.leaves:
      if info.is_unit:
        part = vec[offset:offset + info.num_units]
        leaves.append(jnp.reshape(part, info.unit_shape + tuple(trailing_shape)).astype(dtype))
        offset += info.num_units
      else:
        leaves.append(jnp.zeros((), dtype))
    return jax.tree_util.tree_unflatten(self.treedef, leaves)

  def per_unit(self, vectors, dtype):
    """Per-leaf unit vectors (e.g. :func:`unit_norms`) as a per-unit tree of ``dtype``."""
    vec = (jnp.concatenate([_replicated(jnp.reshape(v, (-1,))) for v in vectors])
           if vectors else jnp.zeros((0,)))
    return self.unflat(vec, dtype)

  def full(self, value, dtype):
    """A per-unit tree with ``value`` at every unit (zero at other leaves)."""
    return self.unflat(jnp.full((self.num_units,), value, dtype), dtype)

  def values(self, vec) -> "UnitValues":
    """``vec`` ([N, ...], one row per unit in flat order) as the :class:`UnitValues` of this
    layout."""
    return UnitValues(vec, self)

  def unit_shapes(self) -> tuple:
    """(is_unit, unit_shape) per leaf: what two layouts must share to hold the same units."""
    return tuple((u.is_unit, u.unit_shape) for u in self.leaves)

  def norms(self, tree):
    """The [N] vector of per-unit gradient norms of a params-shaped tree (float32)."""
    parts = [_replicated(jnp.reshape(n, (-1,)))
             for n in unit_norms(jax.tree_util.tree_leaves(unbox(tree)), self.leaves)]
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.float32)


@jax.tree_util.register_pytree_with_keys_class
class UnitValues:
  """Per-unit values held as one array of shape ``[N, *trailing]`` (N units in flat order) that
  reads like the params-shaped per-unit tree: the controller states' per-unit fields.

  Held flat, a controller state has one array per field whatever the number of parameter
  leaves, so its update compiles to a handful of XLA ops instead of one output per (field,
  leaf) (a model without ``nn.scan`` has a leaf per layer: benchmarks/controller_compile.py).
  The layout (names, shapes, the params' structure) is static pytree metadata: ``jax.jit``,
  ``vmap``, donation, orbax and ``jax.tree.map`` see one array (key path ``.values``).

  Attributes:
    values: the ``[N, *trailing]`` array (any pytree leaf while it is a spec or a stand-in).
    layout: the :class:`UnitLayout` the rows follow.

  Example:
    >>> import jax.numpy as jnp
    >>> layout = layout_of({'layers': {'w': jnp.zeros((2, 4, 4))}, 'head': jnp.zeros((4, 3))},
    ...                    layer_axis=r'^layers/')
    >>> norm = layout.values(jnp.array([1.0, 2.0, 3.0]))
    >>> norm['layers']['w'].tolist(), float(norm['head']), norm.values.shape
    ([2.0, 3.0], 1.0, (3,))
  """

  __slots__ = ("values", "layout", "trailing")

  def __init__(self, values, layout: "UnitLayout", trailing: int | None = None):
    self.values = values
    self.layout = layout
    # The axes after the unit axis, fixed where the values are made (inside a vmap they
    # have no batch axis), so that batched values ([B, N, ...] from jax.vmap(tx.init) or a
    # scan over states) still read right.
    if trailing is None and hasattr(values, "shape"):
      trailing = len(values.shape) - 1
    self.trailing = trailing

  def tree_flatten_with_keys(self):
    return ((jax.tree_util.GetAttrKey("values"), self.values),), (self.layout, self.trailing)

  def tree_flatten(self):
    return (self.values,), (self.layout, self.trailing)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def tree(self):
    """The per-unit tree (mirrors the params; a leaf () or (L,) per unit leaf, plus the
    trailing axes; scalar 0 / False at other leaves). Values with leading batch axes
    ([B, N, ...]: a vmapped init, stacked states) give leaves with those axes first. A spec
    or other non-array stand-in (a ``PartitionSpec`` of the whole vector) is given to every
    leaf, a ``ShapeDtypeStruct`` gives the leaves' ShapeDtypeStructs."""
    values, layout = self.values, self.layout
    if not hasattr(values, "dtype") or not hasattr(values, "shape"):
      return jax.tree_util.tree_unflatten(layout.treedef, [values] * len(layout))
    trailing = len(values.shape) - 1 if self.trailing is None else self.trailing
    batch = len(values.shape) - 1 - trailing
    if batch < 0 or values.shape[batch] != layout.num_units:
      raise ValueError(
          f"UnitValues of shape {tuple(values.shape)} with {trailing} trailing axes: expected "
          f"{layout.num_units} units (one per row of the layout) at axis {max(batch, 0)}")
    unflat = lambda v: layout.unflat(v, v.dtype, v.shape[1:])
    for _ in range(batch):
      unflat = jax.vmap(unflat)
    if isinstance(values, jax.ShapeDtypeStruct):
      return jax.eval_shape(unflat, values)
    return unflat(values)

  def __getitem__(self, key):
    return self.tree()[key]

  def __repr__(self):
    return (f"UnitValues({self.values!r}, {self.layout.num_units} units of "
            f"{sum(u.is_unit for u in self.layout)} leaves)")


def compile_selector(selector, what: str):
  """Turns a regex string into a predicate; validates callables. Raises ValueError.

  Example:
    >>> compile_selector(r'(attn|mlp)/[a-z]+/kernel', 'units').search('layers/mlp/up/kernel') is not None
    True
    >>> compile_selector('(', 'units')
    Traceback (most recent call last):
    ...
    ValueError: gnmr: `units` is not a valid regular expression ('(': ...).
  """
  if selector is None or callable(selector):
    return selector
  if isinstance(selector, str):
    try:
      pattern = re.compile(selector)
    except re.error as e:
      raise ValueError(f"gnmr: `{what}` is not a valid regular expression "
                       f"({selector!r}: {e}).") from e
    return pattern
  raise ValueError(f"gnmr: `{what}` must be None, a regex string or a callable "
                   f"(path, leaf) -> ..., got {type(selector).__name__}.")


def resolve_units(tree, units, layer_axis) -> UnitLayout:
  """Resolves the unit layout of every leaf of ``tree`` (in tree order).

  Args:
    tree: params or updates (arrays or ShapeDtypeStructs), Flax boxes allowed
      (paths and selector arguments skip them, see :func:`unbox`).
    units: None (every leaf with ndim >= 2), a compiled regex searched in the
      '/'-joined key path, or a callable ``(path, leaf) -> bool``.
    layer_axis: None, a compiled regex (matching leaves use axis 0), or a
      callable ``(path, leaf) -> int | None``.

  Returns:
    The :class:`UnitLayout`: one LeafUnits per leaf.

  Raises:
    ValueError: a regex that matches no leaf, or a layer axis out of range.

  Example:
    >>> import re, jax.numpy as jnp
    >>> tree = {'layers': {'q': {'kernel': jnp.zeros((2, 8, 8))}}, 'norm': jnp.zeros(8)}
    >>> layout = resolve_units(tree, None, re.compile(r'^layers/'))
    >>> [(u.path, u.is_unit, u.unit_shape, u.num_units) for u in layout]
    [('layers/q/kernel', True, (2,), 2), ('norm', False, (), 0)]
  """
  leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(unbox(tree))
  layout = []
  for path, leaf in leaves_with_path:
    name = path_to_str(path)
    ndim = len(jnp.shape(leaf))
    if units is None:
      is_unit = ndim >= 2
    elif isinstance(units, re.Pattern):
      is_unit = units.search(name) is not None
    else:
      is_unit = bool(units(name, leaf))
    axis = None
    if is_unit and layer_axis is not None:
      if isinstance(layer_axis, re.Pattern):
        axis = 0 if layer_axis.search(name) is not None else None
      else:
        axis = layer_axis(name, leaf)
      if axis is not None:
        if not -ndim <= axis < ndim:
          raise ValueError(f"gnmr: layer_axis {axis} is out of range for leaf "
                           f"{name!r} of shape {tuple(jnp.shape(leaf))}.")
        axis = axis % ndim
    unit_shape = (int(jnp.shape(leaf)[axis]),) if axis is not None else ()
    layout.append(LeafUnits(name, is_unit, axis, unit_shape))
  if isinstance(units, re.Pattern) and not any(u.is_unit for u in layout):
    raise ValueError(f"gnmr: `units` regex {units.pattern!r} matches no leaf; "
                     f"leaf paths are e.g. {[u.path for u in layout[:5]]}.")
  if isinstance(layer_axis, re.Pattern) and not any(
      u.layer_axis is not None for u in layout):
    raise ValueError(f"gnmr: `layer_axis` regex {layer_axis.pattern!r} matches no "
                     f"recoverable leaf; leaf paths are e.g. "
                     f"{[u.path for u in layout if u.is_unit][:5]}.")
  return UnitLayout(tuple(layout), treedef)


def layout_of(tree, units=None, layer_axis=None) -> UnitLayout:
  """:func:`resolve_units` with uncompiled selectors (regex strings, callables or None)."""
  return resolve_units(tree, compile_selector(units, "units"),
                       compile_selector(layer_axis, "layer_axis"))


def unit_norms(leaves: Sequence[jax.Array], layout: Sequence[LeafUnits]) -> list[jax.Array]:
  """L2 (Frobenius) norm of each unit's gradient in float32, one array per unit leaf.

  A unit leaf with a layer axis gives a vector of L norms (reduction over all
  other axes); a plain unit leaf gives a scalar. Non-unit leaves are skipped.
  Complex gradients use their modulus: the norm of ``1j * ones((2, 2))`` is 2.

  Example:
    >>> import re, jax.numpy as jnp
    >>> grads = {'layers': {'kernel': jnp.stack([jnp.ones((4, 4)), 2 * jnp.ones((4, 4))])},
    ...          'norm': jnp.ones(4)}
    >>> layout = resolve_units(grads, None, re.compile(r'^layers/'))
    >>> [n.tolist() for n in unit_norms(jax.tree_util.tree_leaves(grads), layout)]
    [[4.0, 8.0]]
  """
  norms = []
  for leaf, info in zip(leaves, layout):
    if not info.is_unit:
      continue
    # The barrier keeps XLA from fusing this reduction into the optimizer's
    # elementwise loops over the same gradient: on CPU such a multi-output
    # fusion runs serially and made chain(gnmr, adamw) 2.5x slower than adamw
    # (benchmarks/controller_overhead.py); with it the controller costs ~nothing.
    g = jax.lax.optimization_barrier(jnp.asarray(leaf))
    if jnp.iscomplexobj(g):  # |z|^2 = re^2 + im^2; a plain float cast would drop im
      squares = (jnp.square(jnp.real(g).astype(jnp.float32)) +
                 jnp.square(jnp.imag(g).astype(jnp.float32)))
    else:
      squares = jnp.square(g.astype(jnp.float32))
    axes = tuple(a for a in range(g.ndim) if a != info.layer_axis)
    norms.append(jnp.sqrt(jnp.sum(squares, axis=axes)))
  return norms
