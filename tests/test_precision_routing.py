"""Policy construction, routed execution and its jaxpr/memory properties."""

import flax.linen as nn
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from gnmr_jax import precision
from gnmr_jax.precision import bf16, int8, testing
from tests.tolerances import (assert_allclose, chain_ulps, f32_atol, mean_square_atol,
                              stack_reductions)

L, T, D, F = 4, 32, 64, 96


def _policy(**fields):
  config = precision.default_precision_config()
  config.update(fields)
  return precision.make_policy(config)


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def _stack_inputs(seed=0, dtype=jnp.bfloat16):
  params = testing.init_stack(jax.random.key(seed), L, D, F)
  x = jax.random.normal(jax.random.key(seed + 1), (T, D), dtype)
  return params, x


# --- config and policy ----------------------------------------------------------


@pytest.mark.parametrize('field,value,allowed', [
    ('mode', 'dynamic', "('static', 'gnmr')"),
    ('low_cost_path', 'int4', None),  # None: every registered path, listed at run time
    ('recovery_path', 'fp16', "'bf16', 'blockwise'"),
    ('saved_activation_bits', 1, '(2, 3, 4, 5, 6, 7, 8)'),
    ('recovery_saved_activation_bits', 12, '8, 16)'),
    ('block_bits', 9, '(2, 3, 4, 5, 6, 7, 8)'),
    ('block_size', 0, 'positive int'),
    ('routed_scan_unroll', -2, 'int >= -1'),
    ('routed_scan_unroll', True, 'int >= -1'),
])
def test_make_policy_rejects_invalid_fields_naming_them(field, value, allowed):
  config = precision.default_precision_config()
  config[field] = value
  if allowed is None:  # other test modules (experiments) may register more paths
    paths = precision.available_paths()
    assert {'bf16', 'blockwise', 'fp8', 'int8', 'saved_activation'} <= set(paths)
    allowed = ', '.join(repr(p) for p in sorted(paths))
  with pytest.raises(ValueError) as error:
    precision.make_policy(config)
  assert repr(field) in str(error.value) and allowed in str(error.value)


def test_register_path_adds_a_path_and_rejects_a_clash():
  def builder(config, role):
    del config, role
    return int8.PATH
  precision.register_path('test_int8_alias', builder)
  assert 'test_int8_alias' in precision.available_paths()
  policy = _policy(mode='static', low_cost_path='test_int8_alias')
  x, w = jnp.ones((3, 8)), jnp.linspace(-1, 1, 40).reshape(8, 5)
  np.testing.assert_array_equal(policy.dot(x, w), int8.int8_dot(x, w))
  with pytest.raises(ValueError, match='already registered'):
    precision.register_path('int8', builder)


@pytest.mark.parametrize('mode', ['static', 'gnmr'])
def test_dot_shapes_dtypes_and_scan_unroll(mode):
  policy = _policy(mode=mode, low_cost_path='int8')
  x = jax.random.normal(jax.random.key(0), (2, 5, 16), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (16, 8))
  y = policy.dot(x, w, jnp.array(True))
  assert y.shape == (2, 5, 8) and y.dtype == jnp.bfloat16
  assert policy.routed == (mode == 'gnmr')
  # Per backend by default: fully unrolled on CPU and GPU, rolled on TPU; static never unrolls.
  assert [policy.scan_unroll(12, p) for p in ('cpu', 'gpu', 'cuda', 'tpu')] == (
      [12, 12, 12, 1] if mode == 'gnmr' else [1, 1, 1, 1])
  assert _policy(mode=mode, routed_scan_unroll=4).scan_unroll(12, 'tpu') == (
      4 if mode == 'gnmr' else 1)
  with pytest.raises(ValueError, match='kernel'):
    policy.dot(x, w.T)


def test_routed_policy_rejects_a_batched_predicate():
  policy = _policy(mode='gnmr')
  with pytest.raises(ValueError, match='bool\\[\\] scalar'):
    policy.dot(jnp.ones((4, 8)), jnp.ones((8, 2)), jnp.ones((4,), bool))


def test_static_policy_program_has_no_cond():
  policy = _policy(mode='static', low_cost_path='int8')
  params, x = _stack_inputs()
  grad = jax.grad(lambda p: testing.stack_loss(policy, p, x, jnp.ones((L,), bool)))
  names = {e.primitive.name for e in _eqns(jax.make_jaxpr(grad)(params).jaxpr)}
  assert 'cond' not in names and 'dot_general' in names


def test_flax_dense_dot_general_matches_policy_dot():
  policy = _policy(mode='gnmr', low_cost_path='fp8')
  x = jax.random.normal(jax.random.key(2), (3, 4, 16))
  for recover in (jnp.array(False), jnp.array(True)):
    dense = nn.Dense(8, use_bias=False, dot_general=policy.dot_general(recover))
    variables = dense.init(jax.random.key(3), x)
    kernel = variables['params']['kernel']
    np.testing.assert_array_equal(dense.apply(variables, x), policy.dot(x, kernel, recover))


# --- routed values and gradients --------------------------------------------------


def _reference_stack_loss(params, x, mask):
  """Layer l on bf16 if mask[l] else int8, built from the static paths (Python loop)."""
  h = x
  for l in range(L):
    dot = bf16.bf16_dot if mask[l] else int8.int8_dot
    h = (h + dot(jax.nn.silu(dot(h, params['w_in'][l])), params['w_out'][l])).astype(h.dtype)
  return jnp.mean(jnp.square(h.astype(jnp.float32)))


@pytest.mark.parametrize('unroll', [1, L])
def test_routed_stack_matches_per_layer_static_paths(unroll):
  policy = _policy(mode='gnmr', low_cost_path='int8', recovery_path='bf16')
  # A float32 carry: a bf16 one leaves XLA free to drop different bf16 roundings
  # in the scanned and the unrolled programs (~1e-3 apart).
  params, x = _stack_inputs(dtype=jnp.float32)
  routed = jax.jit(jax.value_and_grad(
      lambda p, m: testing.stack_loss(policy, p, x, m, unroll=unroll)))
  outputs = jax.jit(lambda p, m: testing.stack_apply(policy, p, x, m, unroll=unroll))
  # Two programs of the same float32 math (scan + cond vs a Python loop): XLA may
  # order the float32 sums differently (the int8 legs' int32 sums are exact). The
  # loss ends the stack's chain of sums (tests/tolerances.py); the gradients run it
  # back, after the loss's mean and before the weight gradients' sum over T tokens.
  # A reordered activation could also flip an int8 or bf16 rounding (a whole step):
  # no value of this draw sits within float32 rounding of such a boundary.
  forward_ulps = chain_ulps(stack_reductions(L, D, F))
  grad_ulps = 2 * forward_ulps + chain_ulps([T * D, T])
  losses, loss_atols = {}, {}
  for bits in ([False] * L, [True, False, False, True], [True] * L):
    loss, grads = routed(params, jnp.array(bits))
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(
        lambda p, b=tuple(bits): _reference_stack_loss(p, x, b)))(params)
    loss_atol = mean_square_atol(outputs(params, jnp.array(bits)), forward_ulps)
    assert_allclose(loss, ref_loss, atol=loss_atol)
    for name in grads:
      assert_allclose(grads[name], ref_grads[name],
                      atol=f32_atol(ref_grads[name], grad_ulps))
    losses[tuple(bits)], loss_atols[tuple(bits)] = loss, loss_atol
  assert len({float(v) for v in losses.values()}) == 3  # The mask changes the result.
  # No mask: the unrouted (eager, cond-free) program, the same math as all-False.
  none_loss = testing.stack_loss(policy, params, x, None)
  assert_allclose(none_loss, losses[(False,) * L], atol=loss_atols[(False,) * L])


@pytest.mark.parametrize('low_cost_path,code_dtype', [
    ('int8', jnp.int8), ('fp8', jnp.float8_e4m3fn)])
def test_scanned_routing_is_a_real_branch(low_cost_path, code_dtype):
  """Under scan + grad: unbatched cond predicates, no select_n, and the low-cost
  branches run low-precision dot_generals while the recovery branches run bf16."""
  policy = _policy(mode='gnmr', low_cost_path=low_cost_path, recovery_path='bf16')
  params, x = _stack_inputs()
  step = jax.value_and_grad(lambda p, m: testing.stack_loss(policy, p, x, m))
  jaxpr = jax.make_jaxpr(step)(params, jnp.zeros((L,), bool)).jaxpr
  eqns = list(_eqns(jaxpr))
  assert 'scan' in {e.primitive.name for e in eqns}
  # A batched predicate would turn cond into select_n over whole path outputs
  # (activations [T, D], [T, F] or weight gradients); scale guards are [T, 1]/[1, N].
  path_shapes = {(T, D), (T, F), (D, F), (F, D)}
  selects = [e.outvars[0].aval.shape for e in eqns if e.primitive.name == 'select_n']
  assert not path_shapes & set(selects), selects
  conds = [e for e in eqns if e.primitive.name == 'cond']
  assert len(conds) == 4  # 2 matmuls x (forward, backward)
  code_dtype, bf = jnp.dtype(code_dtype), jnp.dtype(jnp.bfloat16)
  for cond in conds:
    assert cond.invars[0].aval.shape == ()  # pred (bool->int32 index), unbatched
    low_cost, recovery = cond.params['branches']  # branches[0] runs when pred is False
    low_ops = [(e.invars[0].aval.dtype, e.invars[1].aval.dtype)
               for e in _eqns(low_cost.jaxpr) if e.primitive.name == 'dot_general']
    rec_ops = [(e.invars[0].aval.dtype, e.invars[1].aval.dtype)
               for e in _eqns(recovery.jaxpr) if e.primitive.name == 'dot_general']
    assert low_ops and all(code_dtype in ops for ops in low_ops), low_ops
    assert rec_ops and all(ops == (bf, bf) for ops in rec_ops), rec_ops


# --- memory of routed saved activations ------------------------------------------


def _temp_bytes(policy, tokens=512, width=256, layers=4):
  params = testing.init_stack(jax.random.key(0), layers, width, width)
  x = jnp.ones((tokens, width), jnp.bfloat16)
  step = jax.jit(jax.value_and_grad(
      lambda p, m: testing.stack_loss(policy, p, x, m, activation=None)))
  compiled = step.lower(params, jnp.zeros((layers,), bool)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def _temp_bytes_per_token(policy):
  return (_temp_bytes(policy, tokens=1024) - _temp_bytes(policy, tokens=512)) / 512


def test_per_unit_routed_saved_activation_shares_residual_slots():
  static4 = _temp_bytes_per_token(_policy(mode='static', low_cost_path='saved_activation'))
  static8 = _temp_bytes_per_token(_policy(mode='static', low_cost_path='saved_activation',
                                          saved_activation_bits=8))
  routed = _temp_bytes_per_token(_policy(mode='gnmr', low_cost_path='saved_activation',
                                         recovery_path='saved_activation',
                                         recovery_storage='per_unit'))
  bf16_bytes = _temp_bytes_per_token(_policy(mode='static', low_cost_path='bf16'))
  # 4 more bits for 4 layers x 2 matmuls x 256 features = 1024 bytes per token. Each
  # slope over 512 tokens cancels fixed bytes; XLA:CPU's 64-byte alignment of the 16
  # token-sized residuals (plane and scale per matmul) leaves <= 16 * 64 / 512 in each.
  np.testing.assert_allclose(static8 - static4, 1024, rtol=0, atol=2 * 16 * 64 / 512)
  # Merged 4-bit/8-bit slots cost the 8-bit set (plus the two f32 scales' slots
  # when they are not merged), never the 4-bit + 8-bit sum (static4 + 1024 + 512).
  assert routed <= static8 + 64, (static4, static8, routed)
  assert static4 < static8 < bf16_bytes
