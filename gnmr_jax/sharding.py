"""Device mesh (data, fsdp, tensor) and logical-axis sharding for the Transformer.

Every model parameter and activation carries logical axis names (model.py);
`default_logical_rules()` maps them onto mesh axes: the batch over data x fsdp,
weights' embed axis over fsdp (ZeRO-3 style), heads / kv_heads / mlp / vocab over
tensor (Megatron style), the stacked layer axis never sharded.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from gnmr_jax.model import Transformer
  >>> from gnmr_jax.model_configs import model_config
  >>> class F32Policy:
  ...   routed = False
  ...   def dot(self, x, kernel, recover=None):
  ...     return x @ kernel.astype(x.dtype)
  >>> model = Transformer(model_config('tiny'), F32Policy())
  >>> mesh = make_mesh(default_mesh_config())  # every device on fsdp
  >>> check_model_fits_mesh(model.config, mesh, batch_size=mesh.size)
  >>> params = init_params(model, jax.random.key(0), mesh)  # sharded p
  >>> tokens = jax.device_put(jnp.zeros((mesh.size, 16), jnp.int32), batch_sharding(mesh))
  >>> with activation_sharding(mesh):
  ...   logits = jax.jit(lambda p, t: model.apply({'params': p}, t))(params, tokens)
  >>> logits.shape[1:]
  (16, 256)
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from gnmr_jax.control.units import path_to_str
from gnmr_jax.model_configs import validate_model_config

MESH_AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('data', 'fsdp')
# config.mesh.axis_types: one name for every axis, or one per axis in MESH_AXES order
# ('explicit,auto,auto'). jax.make_mesh's default is 'explicit'; ours stays 'auto' because
# XLA:CPU cannot run the bf16 path's backward on a one-device explicit mesh ("Unsupported
# element type for DotThunk::Execute: BF16 x BF16 = F32"), which single-device runs need.
AXIS_TYPES = {'explicit': AxisType.Explicit, 'auto': AxisType.Auto}
DEFAULT_AXIS_TYPES = 'auto'
# Every field of config.mesh.
MESH_FIELDS = MESH_AXES + ('axis_types',)

LogicalRules = tuple[tuple[str, Any], ...]


def default_mesh_config() -> ml_collections.ConfigDict:
  """Mesh shape config: every device on fsdp."""
  config = ml_collections.ConfigDict()
  # Pure data parallel replicas (params replicated across them).
  config.data = 1
  # Fully sharded data parallel: batch and the weights' embed axis; -1 = the rest.
  config.fsdp = -1
  # Tensor parallel: attention heads, MLP hidden and vocabulary.
  config.tensor = 1
  # 'auto' (the partitioner propagates shardings from the constraints), 'explicit'
  # (sharding in every array's type; jax.make_mesh's default), or one per axis, e.g.
  # 'explicit,auto,auto' for (data, fsdp, tensor).
  config.axis_types = DEFAULT_AXIS_TYPES
  return config


def mesh_axis_types(mesh_config: ml_collections.ConfigDict) -> tuple[AxisType, ...]:
  """config.mesh.axis_types (absent: DEFAULT_AXIS_TYPES) as one AxisType per mesh axis.

  Raises:
    ValueError: not a string of 'explicit' / 'auto', once or once per axis.
  """
  value = mesh_config.get('axis_types', DEFAULT_AXIS_TYPES)
  names = [n.strip() for n in value.split(',')] if isinstance(value, str) else None
  if names is None or len(names) not in (1, len(MESH_AXES)) or not set(names) <= set(AXIS_TYPES):
    raise ValueError(
        f'mesh.axis_types must be one of {sorted(AXIS_TYPES)} for every axis, or one per '
        f'axis {MESH_AXES} joined by commas (e.g. "explicit,auto,auto"), got {value!r}')
  return tuple(AXIS_TYPES[n] for n in names * (len(MESH_AXES) // len(names)))


def mesh_shape(mesh_config: ml_collections.ConfigDict, device_count: int
               ) -> tuple[int, int, int]:
  """Resolves a mesh config (at most one -1 = "the rest") to (data, fsdp, tensor).

  Raises:
    ValueError: a field is missing, not a positive int or -1, more than one is
      -1, or the product does not equal `device_count`.
  """
  sizes = []
  for axis in MESH_AXES:
    if axis not in mesh_config:
      raise ValueError(f'mesh config is missing field {axis!r}; fields: {MESH_AXES}')
    size = mesh_config[axis]
    if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
      raise ValueError(f'mesh.{axis} must be a positive int or -1, got {size!r}')
    sizes.append(size)
  if sizes.count(-1) > 1:
    raise ValueError(f'at most one mesh axis may be -1, got {dict(zip(MESH_AXES, sizes))}')
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if device_count % known:
      raise ValueError(
          f'mesh {dict(zip(MESH_AXES, sizes))}: the fixed axes ({known} devices) '
          f'do not divide the {device_count} devices')
    sizes[sizes.index(-1)] = device_count // known
  if math.prod(sizes) != device_count:
    raise ValueError(
        f'mesh {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} devices but '
        f'{device_count} are available')
  return tuple(sizes)


def make_mesh(mesh_config: ml_collections.ConfigDict,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds a `Mesh` with axes ('data', 'fsdp', 'tensor') over all (or given) devices.

  Its axis types come from `mesh_config.axis_types` (`mesh_axis_types`).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_config, len(devices))
  axis_types = mesh_axis_types(mesh_config)
  device_array = mesh_utils.create_device_mesh(
      shape, devices, allow_split_physical_axes=True)
  return Mesh(device_array, MESH_AXES, axis_types=axis_types)


def check_mesh(mesh: Any, exact: bool = False) -> None:
  """Raises a ValueError unless `mesh` is a `jax.sharding.Mesh` with the axes MESH_AXES.

  With `exact`, other axes are refused too (the train loop's config describes the mesh).
  Sizes against the model and the batch: `check_model_fits_mesh`.
  """
  if not isinstance(mesh, Mesh):
    raise ValueError(f'mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh(shape, '
                     f'{MESH_AXES})), got {type(mesh).__name__}')
  missing = [a for a in MESH_AXES if a not in mesh.axis_names]
  extra = [a for a in mesh.axis_names if a not in MESH_AXES] if exact else []
  if missing or extra:
    raise ValueError(
        f'mesh has axes {tuple(mesh.axis_names)}; the model shards over exactly {MESH_AXES} '
        f'(missing: {missing}, unknown: {extra}); use size 1 for an axis you do not need')
  other = [f'{n}: {t}' for n, t in zip(mesh.axis_names, mesh.axis_types)
           if t not in AXIS_TYPES.values()]
  if other:
    raise ValueError(f'mesh axes must be AxisType.Explicit or AxisType.Auto, got {other}')


def mesh_config_of(mesh: Mesh) -> ml_collections.ConfigDict:
  """The mesh config (sizes and axis types) that describes `mesh`."""
  config = ml_collections.ConfigDict({a: int(mesh.shape[a]) for a in MESH_AXES})
  types = {t: n for n, t in AXIS_TYPES.items()}
  names = [types[mesh.axis_types[mesh.axis_names.index(a)]] for a in MESH_AXES]
  config.axis_types = names[0] if len(set(names)) == 1 else ','.join(names)
  return config


def default_logical_rules() -> LogicalRules:
  """Logical axis name -> mesh axes. Order matters: a mesh axis is used once per array.

  'batch' claims ('data', 'fsdp') first, so activations [batch, length, embed]
  leave embed unsharded while weights [embed, ...] shard it over fsdp.
  """
  return (
      ('batch', BATCH_AXES),
      ('length', None),
      ('embed', 'fsdp'),
      ('heads', 'tensor'),
      ('kv_heads', 'tensor'),
      ('head_dim', None),
      ('mlp', 'tensor'),
      ('vocab', 'tensor'),
      ('layers', None),
      ('norm', None),
  )


def check_model_fits_mesh(model_cfg: ml_collections.ConfigDict, mesh: Mesh,
                          batch_size: int, batch_field: str = 'batch_size') -> None:
  """Raises a ValueError naming the field when the model does not divide over the mesh.

  Checks batch_size % (data * fsdp) (``batch_field`` names it in the message), d_model % fsdp,
  and num_heads, num_kv_heads, ffn_dim, vocab_size % tensor (with the default rules).
  """
  validate_model_config(model_cfg)
  check_mesh(mesh)
  data, fsdp, tensor = (mesh.shape[a] for a in MESH_AXES)
  if batch_size % (data * fsdp):
    raise ValueError(
        f'{batch_field}={batch_size} must be divisible by data * fsdp = '
        f'{data} * {fsdp} = {data * fsdp}')
  problems = []
  if model_cfg.d_model % fsdp:
    problems.append(f'model.d_model={model_cfg.d_model} % fsdp={fsdp}')
  for field in ('num_heads', 'num_kv_heads', 'ffn_dim', 'vocab_size'):
    if model_cfg[field] % tensor:
      problems.append(f'model.{field}={model_cfg[field]} % tensor={tensor}')
  if problems:
    raise ValueError(
        f'model {model_cfg.get("name", "?")!r} does not divide over the mesh '
        f'(data={data}, fsdp={fsdp}, tensor={tensor}): ' + ', '.join(problems)
        + ' must be 0')


def _abstract_variables(model: nn.Module, tokens_shape: tuple[int, int]):
  tokens = jax.ShapeDtypeStruct(tokens_shape, jnp.int32)
  model = _for_init(model)
  with _rules_for_init():
    return jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)


def logical_param_specs(model: nn.Module, tokens_shape: tuple[int, int] = (1, 1)):
  """PartitionSpecs of logical axis names, mirroring p (from an abstract init)."""
  return nn.get_partition_spec(_abstract_variables(model, tokens_shape))['params']


def param_shardings(model: nn.Module, mesh: Mesh, rules: LogicalRules | None = None,
                    tokens_shape: tuple[int, int] = (1, 1)):
  """NamedShardings mirroring p (the unboxed 'params' collection)."""
  return abstract_params_and_shardings(model, mesh, rules, tokens_shape)[1]


def abstract_params_and_shardings(model: nn.Module, mesh: Mesh,
                                  rules: LogicalRules | None = None,
                                  tokens_shape: tuple[int, int] = (1, 1)):
  """(abstract p, NamedShardings mirroring p) from one abstract init: p's shapes and dtypes as
  `init_unboxed` makes them, and `param_shardings`, without tracing the model twice."""
  rules = default_logical_rules() if rules is None else rules
  boxed = _abstract_variables(model, tokens_shape)['params']
  specs = nn.get_partition_spec(boxed)
  # nn.unbox's boxes, without the sharding constraints it would apply in a mesh context
  # (these are shapes, not values)
  abstract = nn.meta.map_axis_meta(
      lambda box: box.unbox(apply_constraint=False) if isinstance(box, nn.Partitioned)
      else box.unbox(), boxed)
  return abstract, nn.logical_to_mesh_sharding(specs, mesh, rules)


def init_params(model: nn.Module, rng: jax.Array, mesh: Mesh,
                rules: LogicalRules | None = None,
                tokens_shape: tuple[int, int] = (1, 1)):
  """Initialises p directly in its sharded layout (never materialised whole)."""
  shardings = param_shardings(model, mesh, rules, tokens_shape)
  tokens = jnp.zeros(tokens_shape, jnp.int32)
  init = lambda key: init_unboxed(model, key, tokens)
  return jax.jit(init, out_shardings=shardings)(rng)


def init_unboxed(model: nn.Module, rng: jax.Array, tokens: jax.Array):
  """p = `nn.unbox(model.init(rng, tokens)['params'])`, also under explicit mesh axes.

  Flax's param creation and unbox apply the logical rules in context as
  `with_sharding_constraint`s, which
  explicit axes turn into assertions on freshly initialised (replicated) values; there the
  rules are set aside for the init and the caller's jit `out_shardings` place p.
  A gnmr_jax Transformer initialises with its layer scan rolled (`model.for_init()`): the same
  p, bit for bit, from a program that does not grow with depth.
  """
  model = _for_init(model)
  with _rules_for_init():
    return nn.unbox(model.init(rng, tokens)['params'])


def _for_init(model: nn.Module) -> nn.Module:
  """`model.for_init()` where the model has one (a gnmr_jax Transformer: the same params from its
  scan rolled, `gnmr_jax.model.for_init`), else `model`: the model prepares itself, so these
  helpers stay below it."""
  prepare = getattr(model, 'for_init', None)
  return prepare() if callable(prepare) else model


def _rules_for_init():
  """No logical rules under explicit axes (see `init_unboxed`); otherwise those in context."""
  return nn.logical_axis_rules(()) if is_explicit() else contextlib.nullcontext()


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of token batches [B, S]: batch over data x fsdp."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
  """Fully replicated sharding (scalars, recovery masks, optimizer counters)."""
  return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: LogicalRules | None = None) -> Iterator[None]:
  """Context in which the model's logical activation constraints take effect.

  Trace (jit) the model's apply inside it; outside, the constraints are no-ops.
  """
  rules = default_logical_rules() if rules is None else rules
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def opt_state_shardings(abstract_opt_state, abstract_params, param_shardings, replicated):
  """Optimizer-state leaves that mirror a param (same path suffix and shape) get its sharding;
  everything else (counters, the controller's small per-unit leaves) is replicated."""
  by_path = {}
  for (path, leaf), sh in zip(jax.tree_util.tree_flatten_with_path(abstract_params)[0],
                              jax.tree_util.tree_leaves(param_shardings)):
    by_path[path_to_str(path)] = (tuple(leaf.shape), sh)

  def pick(path, leaf):
    name = path_to_str(path)
    for pname, (shape, sh) in by_path.items():
      if (name == pname or name.endswith("/" + pname)) and tuple(leaf.shape) == shape:
        return sh
    return replicated

  return jax.tree_util.tree_map_with_path(pick, abstract_opt_state)

# Constraints the model places on its activations and weights. Under an auto-axes mesh (or
# none) they are exactly Flax's `nn.with_logical_constraint`, a hint the partitioner follows.
# Under explicit axes the sharding is part of every array's type and `with_sharding_constraint`
# only asserts it, so these reshard instead (`jax.sharding.reshard`), explicit axis by axis.


def explicit_axis_names(mesh) -> frozenset:
  """The names of `mesh`'s axes of type Explicit (none for an empty mesh)."""
  if mesh.empty:
    return frozenset()
  return frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types)
                   if t == AxisType.Explicit)


def entry_axes(entry) -> tuple:
  """A PartitionSpec entry (None, an axis name or a tuple of names) as a tuple of names."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def spec_entry(axes: tuple):
  """A tuple of axis names as a PartitionSpec entry (None, one name, or the tuple)."""
  return None if not axes else axes[0] if len(axes) == 1 else axes


def constrain(x: jax.Array, logical_axes: tuple) -> jax.Array:
  """`x` sharded by the logical axis rules in context (`activation_sharding`).

  Auto axes (or no mesh, or no rules): `nn.with_logical_constraint(x, logical_axes)`, the
  same program as before explicit-axis support. Explicit axes: x is resharded to the rules'
  spec on those axes; a dimension the axes' size does not divide stays unsharded there
  (explicit types shard evenly; `model.init` traces a 1-row batch). A mixed mesh gets both:
  the reshard for its explicit axes, the constraint for its auto ones.
  """
  mesh = jax.sharding.get_abstract_mesh()
  explicit = explicit_axis_names(mesh)
  rules = nn.get_logical_axis_rules()
  if not explicit or not rules:
    return nn.with_logical_constraint(x, logical_axes)
  spec = tuple(nn.logical_to_mesh_axes(logical_axes, rules))
  explicit_spec, auto_spec = [], []
  for size, entry in zip(x.shape, spec):
    axes = entry_axes(entry)
    on_explicit = tuple(a for a in axes if a in explicit)
    if size % math.prod(mesh.shape[a] for a in on_explicit):
      on_explicit = ()
    explicit_spec.append(spec_entry(on_explicit))
    auto_spec.append(spec_entry(tuple(a for a in axes if a not in explicit)))
  x = jax.sharding.reshard(x, PartitionSpec(*explicit_spec))
  if any(auto_spec):
    x = jax.lax.with_sharding_constraint(x, PartitionSpec(*auto_spec))
  return x


def gather_weight(weight: jax.Array, logical_axes: tuple, gathered: str = 'embed'
                  ) -> jax.Array:
  """`weight` with its `gathered` (FSDP) dimension all-gathered, before it is used.

  Under explicit axes the weight's type says how it is sharded; this reshards the
  dimensions named `gathered` to unsharded and leaves the others (tensor parallel) as
  they are; its transpose, in the backward pass, reduce-scatters the weight gradient back
  to the FSDP layout. Auto axes or no mesh: `weight` unchanged (the partitioner gathers).
  """
  if not explicit_axis_names(jax.sharding.get_abstract_mesh()):
    return weight
  spec = tuple(jax.typeof(weight).sharding.spec)
  spec += (None,) * (weight.ndim - len(spec))
  target = tuple(None if name == gathered else entry
                 for name, entry in zip(logical_axes, spec))
  if target == spec:
    return weight
  return jax.sharding.reshard(weight, PartitionSpec(*target))


def is_explicit() -> bool:
  """Whether the context mesh (`jax.set_mesh`) has explicit axes."""
  return bool(explicit_axis_names(jax.sharding.get_abstract_mesh()))
