"""nnx_routing.route: the bit's path runs under nnx.jit / value_and_grad / scan / remat.

The routed policy is int8 (low-cost) / bf16 (recovery): the two differ by ~1e-2
relative, far above the float32 rounding of one path computed twice, so
"equals the bf16 path" and "equals the int8 path" cannot both hold. The
references are plain JAX functions of the same params that call the path dots
(bf16.bf16_dot, int8.int8_dot) directly, which test_precision_paths checks
against float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import gnmr_jax
from gnmr_jax import nnx_routing, precision
from gnmr_jax.precision import bf16, int8

D_IN, D_HID, D_OUT, B = 8, 16, 4, 6
L = 3  # stacked layers


def _policy(**fields):
  config = precision.default_precision_config()
  config.update({'recovery_storage': 'per_unit', **fields})
  return precision.make_policy(config)


POLICY = _policy()  # gnmr: int8, recovery bf16


def _path_dot(bit):
  return bf16.bf16_dot if bit else int8.int8_dot


class MLP(nnx.Module):

  def __init__(self, rngs):
    self.up = nnx.Linear(D_IN, D_HID, rngs=rngs)
    self.down = nnx.Linear(D_HID, D_OUT, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.relu(self.up(x)))


def _mlp_params(model):
  return {name: {'kernel': getattr(model, name).kernel[...],
                 'bias': getattr(model, name).bias[...]} for name in ('up', 'down')}


def _reference_loss(params, x, target, bits):
  """The MLP with each layer on the path its (concrete) bit names."""
  h = _path_dot(bits['up'])(x, params['up']['kernel']) + params['up']['bias']
  y = _path_dot(bits['down'])(jax.nn.relu(h), params['down']['kernel'])
  return jnp.mean((y + params['down']['bias'] - target) ** 2)


def _data(seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((B, D_IN)), jnp.float32),
          jnp.asarray(rng.standard_normal((B, D_OUT)), jnp.float32))


def _mask(up, down):
  return {'up': {'kernel': jnp.array(up)}, 'down': {'kernel': jnp.array(down)}}


def _assert_tree_close(got, want, rtol=1e-6, atol=1e-7):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def test_each_bit_runs_its_path_under_jit_and_value_and_grad_without_retracing():
  model = MLP(nnx.Rngs(0))
  x, target = _data()
  traces = []

  @nnx.jit
  def loss_and_grads(model, mask, x, target):
    traces.append(None)

    def loss_fn(model):
      with nnx_routing.route(model, POLICY, mask):
        return jnp.mean((model(x) - target) ** 2)
    return nnx.value_and_grad(loss_fn)(model)

  params = _mlp_params(model)
  results = {}
  for up in (False, True):
    for down in (False, True):
      loss, grads = loss_and_grads(model, _mask(up, down), x, target)
      bits = {'up': up, 'down': down}
      ref_loss, ref_grads = jax.value_and_grad(_reference_loss)(params, x, target, bits)
      np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
      _assert_tree_close(nnx.to_pure_dict(grads), ref_grads)
      results[up, down] = (float(loss), np.asarray(grads['up']['kernel'][...]))
  assert len(traces) == 1  # the bits are inputs: one trace serves all four masks
  # The paths really differ: each bit changes the loss and the first layer's gradient.
  assert len({loss for loss, _ in results.values()}) == 4
  assert not np.allclose(results[True, True][1], results[False, True][1], rtol=1e-3)


def test_route_leaks_no_tracer_and_restores_the_graph():
  model = MLP(nnx.Rngs(1))
  x, target = _data(1)
  graphdef = nnx.graphdef(model)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, mask, x, target):
    def loss_fn(model):
      with nnx_routing.route(model, POLICY, mask) as routed:
        assert routed == (('down',), ('up',))
        return jnp.mean((model(x) - target) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  with jax.checking_leaks():
    step(model, optimizer, _mask(True, False), x, target)
    step(model, optimizer, _mask(False, True), x, target)
  assert nnx.graphdef(model) == graphdef
  assert model.up.dot_general is jax.lax.dot_general
  assert not jax.tree.leaves(nnx.state(model, nnx_routing.RecoveryBit))
  # Eagerly too, and after an exception inside the block.
  with pytest.raises(RuntimeError, match='boom'):
    with nnx_routing.route(model, POLICY, _mask(True, True)):
      assert isinstance(model.up.dot_general, nnx_routing.RoutedDotGeneral)
      raise RuntimeError('boom')
  assert nnx.graphdef(model) == graphdef


def test_mask_from_the_gnmr_controller_in_nnx_optimizer_routes_the_next_step():
  """The controller's mask (read from nnx.Optimizer.opt_state, Variable boxes and
  all) drives the step: every step's loss is the reference loss under the mask the
  controller held before it, and a gradient spike puts a layer on bf16."""
  model = MLP(nnx.Rngs(2))
  tx = optax.chain(gnmr_jax.gnmr(alpha=2.0, beta=1.5, delta=2, max_o=1, t_lock=1),
                   optax.adamw(1e-2))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, target):
    mask = gnmr_jax.recovery_mask(optimizer.opt_state)

    def loss_fn(model):
      with nnx_routing.route(model, POLICY, mask):
        return jnp.mean((model(x) - target) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  seen = set()
  for step in range(7):
    x, target = _data(10 + step)
    if step == 3:
      x = 40.0 * x  # a gradient spike: GNMR > alpha
    mask = nnx_routing.mask_bits(gnmr_jax.recovery_mask(optimizer.opt_state))
    bits = {name: bool(mask[name, 'kernel']) for name in ('up', 'down')}
    ref_loss = _reference_loss(_mlp_params(model), x, target, bits)
    loss = train_step(model, optimizer, x, target)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    seen.add(tuple(bits.values()))
  assert (False, False) in seen and any(any(b) for b in seen), seen


class Block(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(D_HID, D_HID, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.linear(x))


class Stack(nnx.Module):
  """L blocks with stacked params [L, ...], scanned; each step rematerialized."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs)
    self.blocks = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat
    def body(x, block):
      return block(x)
    return body(x, self.blocks)


def _reference_stack_loss(params, x, bits):
  for layer, bit in enumerate(bits):
    h = _path_dot(bit)(x, params['kernel'][layer]) + params['bias'][layer]
    x = x + jnp.tanh(h)
  return jnp.mean(x ** 2)


def test_scanned_remat_layers_each_take_their_own_bit():
  model = Stack(nnx.Rngs(3))
  x = jnp.asarray(np.random.default_rng(3).standard_normal((B, D_HID)), jnp.float32)

  @nnx.jit
  def loss_and_grads(model, layer_bits, x):
    mask = {'blocks': {'linear': {'kernel': layer_bits}}}  # bool[L], sliced by the scan

    def loss_fn(model):
      with nnx_routing.route(model, POLICY, mask):
        return jnp.mean(model(x) ** 2)
    return nnx.value_and_grad(loss_fn)(model)

  params = {'kernel': model.blocks.linear.kernel[...], 'bias': model.blocks.linear.bias[...]}
  losses = set()
  with jax.checking_leaks():
    for bits in ([False] * L, [False, True, False], [True, False, True]):
      loss, grads = loss_and_grads(model, jnp.array(bits), x)
      ref_loss, ref_grads = jax.value_and_grad(_reference_stack_loss)(params, x, bits)
      np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
      _assert_tree_close(nnx.to_pure_dict(grads)['blocks']['linear'], ref_grads)
      losses.add(float(loss))
  assert len(losses) == 3
  assert model.blocks.linear.dot_general is jax.lax.dot_general


def test_einsum_layer_is_routed_per_head():
  layer = nnx.Einsum('nta,hab->nthb', (3, D_IN, 5), (3, 5), rngs=nnx.Rngs(4))
  x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 7, D_IN)), jnp.float32)

  @nnx.jit
  def apply(layer, bit, x):
    with nnx_routing.route(layer, POLICY, {'kernel': bit}):
      return layer(x)

  kernel, bias = layer.kernel[...], layer.bias[...]
  for bit in (False, True):
    heads = [_path_dot(bit)(x.reshape(-1, D_IN), kernel[h]).reshape(2, 7, 5)
             for h in range(3)]
    want = jnp.stack(heads, axis=2) + bias
    np.testing.assert_allclose(apply(layer, jnp.array(bit), x), want, rtol=1e-6, atol=1e-7)
  assert not np.allclose(apply(layer, jnp.array(True), x), apply(layer, jnp.array(False), x),
                         rtol=1e-3)
  assert layer.einsum_op is jnp.einsum


def test_linear_general_layer_is_routed():
  layer = nnx.LinearGeneral(D_IN, (3, 5), rngs=nnx.Rngs(5))
  x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 7, D_IN)), jnp.float32)

  @nnx.jit
  def apply(layer, bit, x):
    with nnx_routing.route(layer, POLICY, {'kernel': bit}) as routed:
      assert routed == ((),)
      return layer(x)

  kernel, bias = layer.kernel[...], layer.bias[...]
  for bit in (False, True):
    want = _path_dot(bit)(x.reshape(-1, D_IN), kernel.reshape(D_IN, 15)).reshape(2, 7, 3, 5)
    np.testing.assert_allclose(apply(layer, jnp.array(bit), x), want + bias, rtol=1e-6,
                               atol=1e-7)
  assert not np.allclose(apply(layer, jnp.array(True), x), apply(layer, jnp.array(False), x),
                         rtol=1e-3)
  assert layer.dot_general is None  # its own (lax.dot_general) again


def test_routed_einsum_matches_einsum_for_transposed_and_batched_equations():
  """bf16 static policy: each equation equals jnp.einsum of the bf16-rounded operands."""
  policy = _policy(mode='static', low_cost_path='bf16')
  rng = np.random.default_rng(5)
  cases = [('...a,ab->...b', (2, 3, 4), (4, 5)),
           ('ab,bc->ca', (3, 4), (4, 6)),          # output transposed
           ('bhk,hkn->bhn', (2, 3, 4), (3, 4, 5)),  # batch axis h
           ('xy,zyw->xzw', (3, 4), (2, 4, 5))]
  for subscripts, lhs_shape, rhs_shape in cases:
    lhs = jnp.asarray(rng.standard_normal(lhs_shape), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)
    got = nnx_routing.routed_einsum(policy, None, subscripts, lhs, rhs)
    round_bf16 = lambda a: np.asarray(a.astype(jnp.bfloat16), np.float64)
    want = np.einsum(subscripts, round_bf16(lhs), round_bf16(rhs))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=subscripts)
  with pytest.raises(ValueError, match='summed within one operand'):
    nnx_routing.routed_einsum(policy, None, 'ab,bc->c', jnp.ones((2, 3)), jnp.ones((3, 4)))


def test_route_rejects_bad_arguments_naming_them():
  model = MLP(nnx.Rngs(0))
  with pytest.raises(ValueError, match='policy must be'):
    with nnx_routing.route(model, object(), _mask(True, True)):
      pass
  with pytest.raises(ValueError, match='up/kernel must be bool'):
    with nnx_routing.route(model, POLICY, {'up': {'kernel': jnp.array(1.0)}}):
      pass
  with pytest.raises(ValueError, match="no nnx.Linear/nnx.Einsum kernel.*'up'"):
    with nnx_routing.route(model, POLICY, {'params': _mask(True, True)}):
      pass
  with nnx_routing.route(model, POLICY, _mask(True, True)):
    with pytest.raises(ValueError, match='already routed'):
      with nnx_routing.route(model, POLICY, _mask(True, True)):
        pass
  assert model.up.dot_general is jax.lax.dot_general
