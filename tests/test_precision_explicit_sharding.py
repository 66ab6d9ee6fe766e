"""Every precision path under explicit-axis meshes (jax.make_mesh's default).

A custom backward contracts x^T g over the sharded batch axis, which explicit
sharding types reject unless told the output's sharding. Each path, statically
(low-cost and recovery roles) and routed (per-unit slots and side buffer), must
give what the same computation gives on one device, with jnp.dot's gradient
shardings: dx like x, dW like W.

Tolerance: sharding changes only the order of float32 sums (partial sums per
shard, then a cross-shard sum); quantization scales are maxima, which no order
changes, so every path quantizes to the same codes as on one device. Two
orders of an n-term sum differ by at most ~ n eps sum|a_i b_i|; the quantized
operands are at most 2x the originals in magnitude (round-to-grid), hence
4 n eps (|A| |B|) elementwise. int8 accumulates in int32, exact in any order:
it must match bit for bit.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from gnmr_jax import nnx_routing, precision
from gnmr_jax.precision import path as path_lib
from gnmr_jax.precision import registry

M, K, N = 16, 8, 8
EPS = float(np.finfo(np.float32).eps)
PATHS = ('bf16', 'int8', 'fp8', 'saved_activation', 'blockwise')
VARIANTS = ('low_cost', 'recovery', 'routed_per_unit', 'routed_side_buffer')
# mesh shape, axis names, x spec, kernel spec
LAYOUTS = {
    'data8': ((8,), ('data',), P('data', None), P(None, None)),
    'data2_model4': ((2, 4), ('data', 'model'), P('data', None), P(None, 'model')),
    # A row-parallel kernel: x and W both shard the contraction (policy.dot gathers x's K).
    'data2_model4_rows': ((2, 4), ('data', 'model'), P('data', 'model'), P('model', None)),
}


def _config(path, **fields):
  config = precision.default_precision_config()
  # Tiles of 4 straddle the 2-row shards of an 8-way batch split.
  config.update(dict(low_cost_path=path, block_size=4,
                     recovery_path='saved_activation' if path == 'saved_activation' else 'bf16'))
  config.update(fields)
  return config


def _dot_fn(path, variant):
  """``dot(x, kernel, bit) -> y`` of one variant of ``path``."""
  if variant in ('low_cost', 'recovery'):
    policy = precision.make_policy(_config(path, mode='static'))
    if variant == 'recovery':  # the path as built for the recovery role, run statically
      policy = dataclasses.replace(
          policy, low_cost=registry.get_path(path)(_config(path), 'recovery'))
    return lambda x, kernel, bit: policy.dot(x, kernel)
  storage = variant.removeprefix('routed_')
  policy = precision.make_policy(_config(path, recovery_storage=storage), max_recovered=1)

  def dot(x, kernel, bit):
    side = policy.init_side(x.shape[:-1], [(K, N)], x.dtype)
    y, side = policy.dot_side(x, kernel, bit, side)
    return precision.side_buffer.attach(y, side)
  return dot


@functools.lru_cache(maxsize=None)
def _vjp_fn(path, variant):
  dot = _dot_fn(path, variant)

  def run(x, kernel, cotangent, bit):
    y, vjp = jax.vjp(lambda a, b: dot(a, b, bit), x, kernel)
    return (y,) + vjp(cotangent)
  return jax.jit(run)


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((M, K)).astype(np.float32),
          (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32),
          rng.standard_normal((M, N)).astype(np.float32))


def _bound(n, a, b):
  """4 n eps (|a| @ |b|): how far two float32 summation orders can be apart."""
  return 4 * n * EPS * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64))


def _explicit_mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape))


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
@pytest.mark.parametrize('path', PATHS)
def test_path_gradients_under_explicit_mesh_match_one_device(path, layout):
  shape, names, x_spec, kernel_spec = LAYOUTS[layout]
  mesh = _explicit_mesh(shape, names)
  x, kernel, cotangent = _inputs()
  bounds = (_bound(K, x, kernel), _bound(N, cotangent, kernel.T), _bound(M, x.T, cotangent))
  for variant in VARIANTS:
    fn = _vjp_fn(path, variant)
    for bit in (False, True):
      want = fn(x, kernel, cotangent, jnp.array(bit))
      with jax.set_mesh(mesh):
        x_s = jax.device_put(x, NamedSharding(mesh, x_spec))
        kernel_s = jax.device_put(kernel, NamedSharding(mesh, kernel_spec))
        y_sharding = NamedSharding(mesh, P(x_spec[0], kernel_spec[1]))  # y's, as jnp.dot's
        got = fn(x_s, kernel_s, jax.device_put(cotangent, y_sharding),
                 jax.device_put(jnp.array(bit), NamedSharding(mesh, P())))
      y, dx, dkernel = got
      where = f'{path} {variant} bit={bit} {layout}'
      assert dkernel.sharding.is_equivalent_to(kernel_s.sharding, 2), where
      assert dx.sharding.is_equivalent_to(x_s.sharding, 2), where
      for name, g, w, bound in zip(('y', 'dx', 'dkernel'), got, want, bounds):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if path == 'int8' and not (bit and variant.startswith('routed')):
          np.testing.assert_array_equal(g, w, err_msg=f'{where} {name}')
        else:
          assert np.all(np.abs(g - w) <= bound), (where, name, np.max(np.abs(g - w) - bound))


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def test_programs_without_explicit_axes_are_unchanged():
  """No mesh or an auto-axes mesh: no reshard and no out_sharding in the program
  (so their jaxprs and numerics are what they were before explicit-mesh support);
  the same program under explicit axes does carry them (the check can fail)."""
  policy = precision.make_policy(_config('blockwise', recovery_storage='per_unit'))
  grad = jax.grad(lambda x, k, bit: policy.dot(x, k, bit).sum(), (0, 1))
  x, kernel, _ = _inputs()

  def collect(mesh):
    if mesh is None:
      jaxpr = jax.make_jaxpr(grad)(x, kernel, jnp.array(True))
    else:
      with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(grad)(
            jax.device_put(x, NamedSharding(mesh, P('data'))),
            jax.device_put(kernel, NamedSharding(mesh, P(None, 'model'))), jnp.array(True))
    eqns = list(_eqns(jaxpr.jaxpr))
    return ({e.primitive.name for e in eqns},
            [e.params['out_sharding'] for e in eqns if e.primitive.name == 'dot_general'])

  auto = jax.make_mesh((2, 4), ('data', 'model'), axis_types=(AxisType.Auto,) * 2)
  for mesh in (None, auto):
    primitives, out_shardings = collect(mesh)
    assert 'reshard' not in primitives and set(out_shardings) == {None}
  primitives, out_shardings = collect(_explicit_mesh((2, 4), ('data', 'model')))
  assert 'reshard' in primitives and any(s is not None for s in out_shardings)


def test_a_leg_without_out_sharding_runs_under_auto_axes():
  """A three_leg_path leg written as (a, b, out_dtype), before explicit meshes."""
  def f32_matmul(a, b, out_dtype):
    return jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)).astype(out_dtype)
  dot = path_lib.path_dot(path_lib.three_leg_path(f32_matmul, f32_matmul, f32_matmul))
  grad = jax.jit(jax.grad(lambda x, k, c: jnp.sum(dot(x, k) * c), (0, 1)))
  x, kernel, cotangent = _inputs(1)
  want = grad(x, kernel, cotangent)
  mesh = _explicit_mesh((2, 4), ('data', 'model'))
  with jax.set_mesh(mesh):
    kernel_s = jax.device_put(kernel, NamedSharding(mesh, P(None, 'model')))
    got = grad(jax.device_put(x, NamedSharding(mesh, P('data'))), kernel_s,
               jax.device_put(cotangent, NamedSharding(mesh, P('data', 'model'))))
  assert got[1].sharding.is_equivalent_to(kernel_s.sharding, 2)
  for g, w, bound in zip(got, want, (_bound(N, cotangent, kernel.T), _bound(M, x.T, cotangent))):
    assert np.all(np.abs(np.asarray(g, np.float64) - w) <= bound)


def test_flax_hooks_under_explicit_mesh():
  """linen Dense(dot_general=policy.dot_general(bit)) and an nnx.Linear routed by
  nnx_routing.route: gradients as on one device, sharded like the kernel, and the
  nnx call's out_sharding request honoured."""
  policy = precision.make_policy(_config('int8', recovery_storage='per_unit'))
  mesh = _explicit_mesh((2, 4), ('data', 'model'))
  x, _, _ = _inputs(2)
  kernel_sharding = NamedSharding(mesh, P(None, 'model'))

  def linen_grads(params, x, bit):
    layer = nn.Dense(N, dot_general=policy.dot_general(bit))
    return jax.grad(lambda p: jnp.sum(layer.apply({'params': p}, x) ** 2))(params)

  linear = nnx.Linear(K, N, rngs=nnx.Rngs(0))
  params = {'kernel': linear.kernel[...], 'bias': linear.bias[...]}

  @nnx.jit
  def nnx_grads(linear, x, bit):
    def loss(linear):
      with nnx_routing.route(linear, policy, {'kernel': bit}):
        # out_sharding, like lax.dot_general's, needs a mesh (the sharded calls).
        explicit = not jax.sharding.get_abstract_mesh().empty
        y = linear(x, out_sharding=P('data', 'model') if explicit else None)
      return jnp.sum(y ** 2), y
    return nnx.grad(loss, has_aux=True)(linear)

  for bit in (False, True):
    want = jax.jit(linen_grads)(params, x, jnp.array(bit))
    want_nnx, y_want = nnx_grads(linear, x, jnp.array(bit))
    np.testing.assert_array_equal(want_nnx['kernel'][...], want['kernel'])
    with jax.set_mesh(mesh):
      sharded = {'kernel': jax.device_put(params['kernel'], kernel_sharding),
                 'bias': jax.device_put(params['bias'], NamedSharding(mesh, P('model')))}
      x_s = jax.device_put(x, NamedSharding(mesh, P('data')))
      got = jax.jit(linen_grads)(sharded, x_s, jnp.array(bit))
      sharded_linear = nnx.Linear(K, N, rngs=nnx.Rngs(0))
      sharded_linear.kernel.set_value(sharded['kernel'])
      sharded_linear.bias.set_value(sharded['bias'])
      got_nnx, y = nnx_grads(sharded_linear, x_s, jnp.array(bit))
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P('data', 'model')), 2)
    for grads in (got, nnx.to_pure_dict(got_nnx)):
      assert grads['kernel'].sharding.is_equivalent_to(kernel_sharding, 2)
      # d sum(y^2)/dW = x^T (2y): the sharded sums reorder its M terms.
      bound = _bound(M, x.T, 2 * np.asarray(y_want))
      assert np.all(np.abs(np.asarray(grads['kernel'], np.float64) - want['kernel']) <= bound)


@pytest.mark.parametrize('path', ['bf16', 'int8'])
def test_path_dot_with_a_row_parallel_kernel(path):
  """path_dot(x, W) with x and W both sharding the contraction (jnp.dot would refuse it):
  x's shards are gathered, so the result and gradients are those of one device."""
  dot = path_lib.path_dot(registry.get_path(path)(_config(path), 'low_cost'))
  fn = jax.jit(lambda x, k, c: jax.vjp(dot, x, k)[1](c) + (dot(x, k),))
  x, kernel, cotangent = _inputs(3)
  want = fn(x, kernel, cotangent)
  mesh = _explicit_mesh((2, 4), ('data', 'model'))
  with jax.set_mesh(mesh):
    x_s = jax.device_put(x, NamedSharding(mesh, P('data', 'model')))
    kernel_s = jax.device_put(kernel, NamedSharding(mesh, P('model', None)))
    got = fn(x_s, kernel_s, jax.device_put(cotangent, NamedSharding(mesh, P('data'))))
  assert got[0].sharding.is_equivalent_to(x_s.sharding, 2)
  assert got[1].sharding.is_equivalent_to(kernel_s.sharding, 2)
  bounds = (_bound(N, cotangent, kernel.T), _bound(M, x.T, cotangent), _bound(K, x, kernel))
  for g, w, bound in zip(got, want, bounds):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    if path == 'int8':  # int32 accumulation, scales are maxima: exact in any order
      np.testing.assert_array_equal(g, w)
    else:
      assert np.all(np.abs(g - w) <= bound)
