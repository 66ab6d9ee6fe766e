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
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gnmr_jax.control.units import path_to_str
from gnmr_jax.model_configs import validate_model_config

MESH_AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('data', 'fsdp')

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
  return config


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
  """Builds a `Mesh` with axes ('data', 'fsdp', 'tensor') over all (or given) devices."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_config, len(devices))
  device_array = mesh_utils.create_device_mesh(
      shape, devices, allow_split_physical_axes=True)
  return Mesh(device_array, MESH_AXES)


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
                          batch_size: int) -> None:
  """Raises a ValueError naming the field when the model does not divide over the mesh.

  Checks batch_size % (data * fsdp), d_model % fsdp, and num_heads, num_kv_heads,
  ffn_dim, vocab_size % tensor (with the default rules).
  """
  validate_model_config(model_cfg)
  for axis in MESH_AXES:
    if axis not in mesh.shape:
      raise ValueError(f'mesh has axes {tuple(mesh.shape)}, expected {MESH_AXES}')
  data, fsdp, tensor = (mesh.shape[a] for a in MESH_AXES)
  if batch_size % (data * fsdp):
    raise ValueError(
        f'batch_size={batch_size} must be divisible by data * fsdp = '
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
  return jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)


def logical_param_specs(model: nn.Module, tokens_shape: tuple[int, int] = (1, 1)):
  """PartitionSpecs of logical axis names, mirroring p (from an abstract init)."""
  return nn.get_partition_spec(_abstract_variables(model, tokens_shape))['params']


def param_shardings(model: nn.Module, mesh: Mesh, rules: LogicalRules | None = None,
                    tokens_shape: tuple[int, int] = (1, 1)):
  """NamedShardings mirroring p (the unboxed 'params' collection)."""
  rules = default_logical_rules() if rules is None else rules
  return nn.logical_to_mesh_sharding(
      logical_param_specs(model, tokens_shape), mesh, rules)


def init_params(model: nn.Module, rng: jax.Array, mesh: Mesh,
                rules: LogicalRules | None = None,
                tokens_shape: tuple[int, int] = (1, 1)):
  """Initialises p directly in its sharded layout (never materialised whole)."""
  shardings = param_shardings(model, mesh, rules, tokens_shape)
  tokens = jnp.zeros(tokens_shape, jnp.int32)
  init = lambda key: nn.unbox(model.init(key, tokens)['params'])
  return jax.jit(init, out_shardings=shardings)(rng)


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
