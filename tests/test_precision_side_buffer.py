"""The side buffer: routed recovery residuals in max_o shared slots (issue 3).

Checks the byte packing against a NumPy reference, that side-buffer storage
gives bit-identical values and gradients to per-unit storage (stack and model,
scanned and unrolled, sharded), the fallback when the buffer is full, and the
compiled memory: static low-cost bytes plus the buffer, no more.
"""

import flax.linen as nn
import jax
import jax.extend
import ml_collections
import jax.numpy as jnp
import numpy as np
import pytest

from gnmr_jax import precision, sharding
from gnmr_jax.model import PROJECTIONS, Transformer, unit_kernel_shapes
from gnmr_jax.model_configs import model_config
from gnmr_jax.precision import side_buffer, testing
from tests.tolerances import (BF16_EPS, assert_allclose, chain_ulps, f32_atol, mean_square_atol,
                              stack_reductions)

L, T, D = 6, 64, 96

PAIRS = {  # name -> precision config fields of a routed policy
    'sa4/sa8': dict(low_cost_path='saved_activation', recovery_path='saved_activation'),
    'sa2/sa8': dict(low_cost_path='saved_activation', recovery_path='saved_activation',
                    saved_activation_bits=2),
    'sa4/sa16': dict(low_cost_path='saved_activation', recovery_path='saved_activation',
                     recovery_saved_activation_bits=16, saved_activation_scale='tensor'),
    'sa4/bf16': dict(low_cost_path='saved_activation', recovery_path='bf16'),
}


def _policy(storage='side_buffer', units=2, **fields):
  config = precision.default_precision_config()
  config.update({'mode': 'gnmr', 'recovery_storage': storage, **fields})
  return precision.make_policy(config, max_recovered=units)


# --- packing ----------------------------------------------------------------------


def _numpy_words(byte_rows):
  """Reference: rows of bytes, zero-padded to a multiple of 3, as b0 + 2^8 b1 + 2^16 b2."""
  rows = np.asarray(byte_rows, np.int64)
  rows = np.pad(rows, ((0, 0), (0, -rows.shape[1] % 3))).reshape(rows.shape[0], -1, 3)
  return rows[..., 0] + 256 * rows[..., 1] + 65536 * rows[..., 2]


def test_pack_matches_numpy_and_round_trips_every_byte_and_special_float():
  every_byte = np.arange(256, dtype=np.uint8).reshape(2, 128)
  specials = np.array([[np.nan, -0.0, np.inf, -np.inf, 1e-45, -3e-39, 1.0]], np.float32)
  specials = np.repeat(specials, 2, axis=0)
  specials[1, 0] = np.frombuffer(np.uint32(0x7FC12345).tobytes(), np.float32)[0]  # payload
  bf16 = jnp.asarray(np.linspace(-3, 3, 10).reshape(2, 5), jnp.bfloat16)
  ints = np.array([[-2**31, 2**31 - 1, -1], [0, 7, 123456]], np.int32)
  leaves = [jnp.asarray(every_byte), jnp.asarray(specials), bf16, jnp.asarray(ints)]
  words = side_buffer.pack(leaves)
  raw = np.concatenate([np.asarray(every_byte).view(np.uint8),
                        specials.view(np.uint8).reshape(2, -1),
                        np.asarray(bf16).view(np.uint8).reshape(2, -1),
                        ints.view(np.uint8).reshape(2, -1)], axis=1)
  assert words.dtype == jnp.float32
  assert words.shape == (2, side_buffer.num_words(leaves)) == (2, -(-raw.shape[1] // 3))
  np.testing.assert_array_equal(np.asarray(words, np.int64), _numpy_words(raw))
  # Words are integers < 2^24: exact in float32, and adding zeros keeps them.
  assert float(jnp.max(words)) < 2**24 and float(jnp.min(words)) >= 0
  back = side_buffer.unpack(words + 0.0, leaves)
  for got, want in zip(back, leaves):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                  np.asarray(want).view(np.uint8))


# --- values and gradients: side buffer == per-unit storage ------------------------


def _stack_grads(policy, params, x, mask, unroll):
  return _stack_step(policy, x, unroll)(params, jnp.array(mask))


def _stack_step(policy, x, unroll):
  """The jitted (loss, grads) of the stack with the mask as an argument: one program per
  policy, so each further mask compiles nothing."""
  return jax.jit(jax.value_and_grad(
      lambda p, m: testing.stack_loss(policy, p, x, m, unroll=unroll)))


# Every pair once, and the scan both rolled and unrolled for two of them: the layer layout and
# the residuals' packing are independent (each of the 8 products compiled ~12 s cold).
@pytest.mark.parametrize('pair,unroll', [('sa4/sa8', 1), ('sa4/sa8', L), ('sa4/bf16', 1),
                                         ('sa4/bf16', L), ('sa2/sa8', L), ('sa4/sa16', 1)])
def test_side_buffer_stack_is_bit_identical_to_per_unit_storage(pair, unroll):
  params = testing.init_stack(jax.random.key(0), L, D, D)
  x = jax.random.normal(jax.random.key(1), (T, D), jnp.float32)
  side = _policy('side_buffer', units=4, **PAIRS[pair])
  per_unit = _policy('per_unit', **PAIRS[pair])
  side_step, per_unit_step = _stack_step(side, x, unroll), _stack_step(per_unit, x, unroll)
  results = set()
  # Each layer is 2 units (both matmuls share the layer's bit): up to 4 units fit.
  for mask in ([False] * L, [True] + [False] * (L - 1), [False, True, False, False, True, False]):
    loss, grads = side_step(params, jnp.array(mask))
    ref_loss, ref_grads = per_unit_step(params, jnp.array(mask))
    # Exact: the side buffer only changes where the residual bytes are kept; the same
    # bytes come back, so the same float ops run on the same values.
    assert float(loss) == float(ref_loss)
    for name in grads:
      np.testing.assert_array_equal(grads[name], ref_grads[name])
    results.add(float(jnp.sum(grads['w_in'])))
  assert len(results) == 3  # The recovered layers really change the gradients.


def test_a_full_side_buffer_runs_the_low_cost_path_for_the_rest():
  params = testing.init_stack(jax.random.key(2), L, D, D)
  x = jax.random.normal(jax.random.key(3), (T, D), jnp.float32)
  fields = PAIRS['sa4/sa8']
  side = _policy('side_buffer', units=2, **fields)  # 2 units: layer 1's two matmuls
  per_unit = _policy('per_unit', **fields)
  loss, grads = _stack_grads(side, params, x, [False, True, False, True, True, False], L)
  ref_loss, ref_grads = _stack_grads(per_unit, params, x, [False, True] + [False] * 4, L)
  # Exact: units that find the buffer full run the low-cost path, which is what the
  # per-unit reference runs for them.
  assert float(loss) == float(ref_loss)
  for name in grads:
    np.testing.assert_array_equal(grads[name], ref_grads[name])


def test_policy_needs_the_buffer_size_and_row_residuals():
  with pytest.raises(ValueError, match='its size is unset'):
    _policy(units=None, **PAIRS['sa4/sa8']).init_side((T,), [(D, D)], jnp.bfloat16)
  # int8 / bf16 both keep x: nothing to store aside, no buffer, no error.
  assert _policy(units=None).init_side((T,), [(D, D)], jnp.bfloat16) is None
  assert _policy('per_unit', **PAIRS['sa4/sa8']).init_side((T,), [(D, D)], jnp.bfloat16) is None
  config = precision.default_precision_config()
  config.recovery_storage = 'elsewhere'
  with pytest.raises(ValueError, match="'recovery_storage'.*'side_buffer', 'per_unit'"):
    precision.make_policy(config)
  with pytest.raises(ValueError, match='one row per token'):
    side_buffer.check_rows([jax.ShapeDtypeStruct((4, 4), jnp.float32)], 8, 'a path')


def test_side_buffer_words_are_max_o_of_the_largest_unit():
  policy = _policy(units=3, **PAIRS['sa4/sa8'])
  # 8-bit codes: K bytes per token plus a float32 scale, packed 3 bytes a word.
  assert policy.side_words_per_token([(64, 8), (160, 8)], jnp.bfloat16) == 3 * -(-(160 + 4) // 3)
  bf16_path = _policy(units=3, **PAIRS['sa4/bf16'])  # keeps x: its bytes per feature
  assert bf16_path.side_words_per_token([(64, 8)], jnp.bfloat16) == 3 * -(-128 // 3)
  assert bf16_path.side_words_per_token([(64, 8)], jnp.float32) == 3 * -(-256 // 3)


# --- memory -------------------------------------------------------------------------


def _residual_bytes(policy, tokens, layers=4, width=256):
  """Bytes the compiled forward keeps for the backward pass (params excluded)."""
  params = jax.eval_shape(lambda: testing.init_stack(jax.random.key(0), layers, width, width))
  x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)
  mask = jax.ShapeDtypeStruct((layers,), jnp.bool_)
  loss = lambda p, x, m: jnp.mean(
      testing.stack_apply(policy, p, x, m, activation=None).astype(jnp.float32))
  forward = jax.jit(lambda p, x, m: jax.vjp(lambda p: loss(p, x, m), p)[1])
  out = forward.lower(params, x, mask).compile().memory_analysis().output_size_in_bytes
  return out - 2 * layers * width * width * 4


def test_side_buffer_bytes_are_static_low_cost_plus_the_buffer():
  tokens, width = 512, 256
  static4 = _residual_bytes(_policy(mode='static', low_cost_path='saved_activation'), tokens)
  static8 = _residual_bytes(_policy(mode='static', low_cost_path='saved_activation',
                                    saved_activation_bits=8), tokens)
  per_unit = _residual_bytes(_policy('per_unit', **PAIRS['sa4/sa8']), tokens)
  policy = _policy('side_buffer', units=1, **PAIRS['sa4/sa8'])
  side = _residual_bytes(policy, tokens)
  buffer = tokens * policy.side_words_per_token([(width, width)], jnp.bfloat16) * 4
  assert buffer == tokens * -(-(width + 4) // 3) * 4
  assert static4 <= side <= static4 + buffer + 256, (static4, side, buffer)
  # Per-unit slots hold the 8-bit set for all 8 units; the buffer holds one unit.
  assert per_unit >= static8 - 256 and side + buffer < per_unit, (side, per_unit)


# --- the model --------------------------------------------------------------------


def _tiny_model_config(num_layers=3):
  config = model_config('tiny')
  config.num_layers, config.d_model, config.ffn_dim = num_layers, 64, 160
  config.num_heads, config.num_kv_heads = 4, 2
  return config


def _mask(units, num_layers):
  """Projection mask with the listed (group, name, layer) units recovered."""
  return {'layers': {
      group: {name: {'kernel': jnp.array([(group, name, l) in units for l in range(num_layers)])}
              for name in names}
      for group, names in PROJECTIONS.items()}}


def _model_grads(policy, config, tokens, *masks):
  """(loss, grads) for each mask: one jitted program per policy, the mask passed as an argument
  (traced, as the train step routes it), so each further mask compiles nothing."""
  model = Transformer(config, policy)
  params = nn.unbox(model.init(jax.random.key(1), tokens)['params'])

  def loss(p, mask):
    logits = model.apply({'params': p}, tokens, mask)
    targets = jnp.roll(tokens, -1, axis=1)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
  step = jax.jit(jax.value_and_grad(loss))
  return [step(params, mask) for mask in masks]


@pytest.mark.parametrize('scan_unroll,remat', [
    (1, 'none'), (3, 'none'), (1, 'everything_saveable')])  # other remats use no buffer
def test_model_side_buffer_matches_per_unit_storage(scan_unroll, remat):
  config = _tiny_model_config()
  config.scan_unroll, config.remat = scan_unroll, remat
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
  fields = PAIRS['sa2/sa8']
  units = {('mlp', 'down', 0), ('attn', 'q', 2), ('mlp', 'up', 1)}
  side_policy = _policy('side_buffer', units=3, **fields)
  words = side_policy.side_words_per_token(unit_kernel_shapes(config), jnp.float32)
  assert words == 3 * -(-(160 + 4) // 3)  # sized by the down projection (K = ffn)
  (loss, grads), (_, low_grads) = _model_grads(side_policy, config, tokens, _mask(units, 3),
                                               _mask(set(), 3))
  [(ref_loss, ref_grads)] = _model_grads(_policy('per_unit', **fields), config, tokens,
                                         _mask(units, 3))
  # Exact: where the residual bytes are kept changes no value (see the stack test).
  assert float(loss) == float(ref_loss)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_array_equal(got, want)
  # The saved activations only touch weight gradients: the recovered units' differ.
  down = lambda g: g['layers']['mlp']['down']['kernel']
  assert not np.array_equal(down(grads)[0], down(low_grads)[0])
  np.testing.assert_array_equal(down(grads)[2], down(low_grads)[2])


def test_sharded_model_gradients_with_a_side_buffer():
  """data x fsdp x tensor = 2x2x2: the side buffer shards with the tokens and gives
  the per-unit storage's gradients bit for bit (and the one-device ones up to the
  bf16 roundings that sharded sums change)."""
  config = _tiny_model_config(num_layers=2)
  config.update(dict(vocab_size=64, max_seq_len=8, init_std=0.2))
  mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(data=2, fsdp=2, tensor=2)))
  rules = sharding.default_logical_rules()
  tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, 64, jnp.int32)
  mask = _mask({('attn', 'o', 1), ('mlp', 'down', 0)}, 2)

  def grads(storage, mask, sharded=True):
    model = Transformer(config, _policy(storage, units=2, **PAIRS['sa4/sa8']))
    params = sharding.init_params(model, jax.random.key(0), mesh, rules, (4, 8))
    step = jax.jit(jax.grad(lambda p, t, m: jnp.mean(
        model.apply({'params': p}, t, m)[..., 0] ** 2)))
    if not sharded:
      return step(jax.device_put(params, jax.devices()[0]), tokens, mask)
    with sharding.activation_sharding(mesh, rules):
      return step(params, jax.device_put(tokens, sharding.batch_sharding(mesh)),
                  jax.device_put(mask, sharding.replicated(mesh)))

  sharded = grads('side_buffer', mask)
  # Exact (the claim of the side buffer): the same sharded program but for where the
  # recovered residuals live, so the same values must come back.
  for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(grads('per_unit', mask))):
    np.testing.assert_array_equal(got, want)
  one_device = grads('side_buffer', mask, sharded=False)
  # Sharded vs one device: the float32 sums split into partials differ by ulps, and
  # wherever that moves a matmul operand across a bf16 rounding boundary it moves by a
  # bf16 step (<= BF16_EPS relative; more rarely a saved 4-bit code by one step, which
  # enters dW through one token's row). Per layer, 8 bf16 operand casts lie on the
  # forward path (x and W of q/k/v, o, gate/up, down) and 8 on the backward; dW adds 2.
  # Independent flips add up like a random walk: norm-wise <= sqrt(R) BF16_EPS.
  bf16_drift = np.sqrt(16 * config.num_layers + 2) * BF16_EPS
  for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(one_device)):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) <= bf16_drift * np.linalg.norm(want)
  # The recovered unit's 8-bit copy changes its dW by far more than that drift.
  low = grads('side_buffer', _mask(set(), 2), sharded=False)
  down = lambda g: np.asarray(g['layers']['mlp']['down']['kernel'][0], np.float64)
  assert np.linalg.norm(down(one_device) - down(low)) > bf16_drift * np.linalg.norm(down(low))


def _eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      yield from _eqns(sub)


def test_side_buffer_routing_is_a_real_branch_under_scan():
  """Unbatched cond predicates, no select_n over path outputs; the recovery
  branches write (forward) and read (backward) the buffer, the low-cost ones don't."""
  policy = _policy('side_buffer', units=2, **PAIRS['sa4/sa8'])
  params = testing.init_stack(jax.random.key(0), L, D, 2 * D)
  x = jnp.ones((T, D), jnp.bfloat16)
  step = jax.value_and_grad(lambda p, m: testing.stack_loss(policy, p, x, m))
  eqns = list(_eqns(jax.make_jaxpr(step)(params, jnp.zeros((L,), bool)).jaxpr))
  assert 'scan' in {e.primitive.name for e in eqns}
  selects = {e.outvars[0].aval.shape for e in eqns if e.primitive.name == 'select_n'}
  assert not {(T, D), (T, 2 * D), (D, 2 * D), (2 * D, D)} & selects, selects
  conds = [e for e in eqns if e.primitive.name == 'cond']
  assert len(conds) == 4  # 2 matmuls x (forward, backward)
  for cond in conds:
    assert cond.invars[0].aval.shape == ()
    low_cost, recovery = cond.params['branches']
    low_names = {e.primitive.name for e in _eqns(low_cost.jaxpr)}
    rec_names = {e.primitive.name for e in _eqns(recovery.jaxpr)}
    assert rec_names & {'dynamic_update_slice', 'dynamic_slice'}
    assert not low_names & {'dynamic_update_slice', 'dynamic_slice'}


def test_the_model_reports_recoveries_the_full_buffer_dropped():
  config = _tiny_model_config()
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 256)
  model = Transformer(config, _policy('side_buffer', units=2, **PAIRS['sa4/sa8']))
  params = nn.unbox(model.init(jax.random.key(1), tokens)['params'])
  # The buffer holds 2 x 55 words (2 down projections, K=160: ceil(164/3)); a K=64 unit
  # takes 23, so smaller units pack tighter: q, k, up (69 words) leave too little for down.
  downs = {('mlp', 'down', l) for l in range(3)}
  mixed = {('attn', 'q', 0), ('attn', 'k', 1), ('mlp', 'up', 2), ('mlp', 'down', 2)}
  for recovered, dropped in ((set(), 0), (set(list(downs)[:2]), 0), (downs, 1), (mixed, 1)):
    _, state = model.apply({'params': params}, tokens, _mask(recovered, 3),
                           mutable=['intermediates'])
    assert int(state['intermediates']['side_buffer_dropped'][0]) == dropped


def test_pipeline_config_refuses_a_buffer_smaller_than_max_o():
  from gnmr_jax.config import base_config, validate_config  # pylint: disable=g-import-not-at-top
  config = base_config('tiny')
  config.gnmr.max_o = 4
  config.precision.side_buffer_units = 2
  with pytest.raises(ValueError, match='side_buffer_units=2 < config.gnmr.max_o=4'):
    validate_config(config, device_count=1)
  config.precision.side_buffer_units = 0  # = max_o
  validate_config(config, device_count=1)


def test_a_zero_budget_runs_the_low_cost_path_with_no_cond():
  """max_o = 0 (an ablation): no room at all, so the program is the static low-cost one."""
  params = testing.init_stack(jax.random.key(4), L, D, D)
  x = jax.random.normal(jax.random.key(5), (T, D), jnp.float32)
  zero = _policy('side_buffer', units=0, **PAIRS['sa4/sa8'])
  loss, grads = _stack_grads(zero, params, x, [True] * L, L)
  static = _policy(mode='static', low_cost_path='saved_activation')
  ref_loss, ref_grads = _stack_grads(static, params, x, [True] * L, L)
  # The same math up to XLA's fusion choices, which may reorder the float32 sums: the
  # stack's chain of sums (tests/tolerances.py), run back for the gradients after the
  # loss's mean and before the weight gradients' sum over T tokens. (A reordered
  # activation at a bf16 or 4-bit rounding boundary would flip it: none of this draw is.)
  forward_ulps = chain_ulps(stack_reductions(L, D, D))
  out = jax.jit(lambda p: testing.stack_apply(static, p, x, jnp.ones((L,), bool), L))(params)
  assert_allclose(loss, ref_loss, atol=mean_square_atol(out, forward_ulps))
  grad_ulps = 2 * forward_ulps + chain_ulps([T * D, T])
  for name in grads:
    assert_allclose(grads[name], ref_grads[name], atol=f32_atol(ref_grads[name], grad_ulps))
  step = jax.grad(lambda p: testing.stack_loss(zero, p, x, jnp.ones((L,), bool)))
  assert 'cond' not in {e.primitive.name for e in _eqns(jax.make_jaxpr(step)(params).jaxpr)}
  config = _tiny_model_config()
  tokens = jnp.zeros((1, 8), jnp.int32)
  model = Transformer(config, zero)
  variables = model.init(jax.random.key(0), tokens)
  units = {('attn', 'q', 0), ('mlp', 'down', 1)}
  _, sown = model.apply(variables, tokens, _mask(units, 3), mutable=['intermediates'])
  assert int(sown['intermediates']['side_buffer_dropped'][0]) == 2


def test_second_order_derivatives_refuse_the_side_buffer():
  params = testing.init_stack(jax.random.key(6), 2, 16, 16)
  x = jax.random.normal(jax.random.key(7), (8, 16), jnp.float32)
  mask = jnp.array([True, False])

  def penalty(policy):
    grad = lambda p: jax.grad(lambda p: testing.stack_loss(policy, p, x, mask))(p)
    return jax.grad(lambda p: sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grad(p))))(params)

  with pytest.raises(NotImplementedError, match="recovery_storage='per_unit'"):
    penalty(_policy('side_buffer', **PAIRS['sa4/sa8']))
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(
      penalty(_policy('per_unit', **PAIRS['sa4/sa8']))))


@pytest.mark.parametrize('remat,uses_buffer', [('full', False), ('dots_saveable', False),
                                               ('everything_saveable', True)])
def test_remat_recomputes_instead_of_keeping_a_buffer(remat, uses_buffer):
  config = _tiny_model_config()
  config.remat = remat
  tokens = jnp.zeros((1, 8), jnp.int32)
  model = Transformer(config, _policy('side_buffer', **PAIRS['sa4/sa8']))
  variables = model.init(jax.random.key(0), tokens)
  _, sown = model.apply(variables, tokens, _mask({('attn', 'q', 0)}, 3),
                        mutable=['intermediates'])
  assert ('side_buffer_dropped' in sown.get('intermediates', {})) == uses_buffer


def test_attach_returns_its_input_bit_for_bit():
  y = jnp.array([-0.0, 1.5, jnp.nan, -jnp.inf], jnp.float32)
  state = side_buffer.init((4,), 3)
  np.testing.assert_array_equal(np.asarray(side_buffer.attach(y, state)).view(np.uint32),
                                np.asarray(y).view(np.uint32))


@pytest.mark.plumbing  # counts dropped recoveries; no XLA optimizations
def test_the_pipeline_reports_recoveries_beyond_the_buffer(tmp_path, data_dirs):
  """A chain whose controller recovers more units than the config's buffer holds (a
  make_tx override): the run summary counts the recoveries that ran low-cost."""
  from gnmr_jax import optim, train_loop  # pylint: disable=g-import-not-at-top
  from train_helpers import small_config  # pylint: disable=g-import-not-at-top
  config = small_config(data_dirs, **{
      'train.steps': 6, 'data.batch_size': 8, 'gnmr.max_o': 1, 'gnmr.warmup': 0,
      'gnmr.alpha': 1e-3, 'gnmr.beta': 1e-3,  # every unit is risky
      'precision.low_cost_path': 'saved_activation',
      'precision.recovery_path': 'saved_activation'})

  def make_tx(cfg):
    wide = ml_collections.ConfigDict(cfg.to_dict())
    wide.gnmr.max_o = 6  # recovers 6 units; the buffer (gnmr.max_o=1) holds one
    return optim.make_optimizer(wide)

  summary = train_loop.train_and_evaluate(config, str(tmp_path), make_tx=make_tx)
  assert summary['side_buffer_dropped'] > 0
  assert 'side buffer full' in train_loop.format_summary(summary)
  config.train.steps = 4
  summary = train_loop.train_and_evaluate(config, str(tmp_path / 'fits'))
  assert summary['side_buffer_dropped'] == 0
