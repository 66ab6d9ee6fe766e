"""GNMR transform API: validation, pass-through, nesting, scanned trees, properties, checkpoints."""
import numpy as np
import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import given, settings, strategies as st
import flax.linen as nn

import gnmr_jax
from tests.tolerances import F32_EPS, assert_allclose, chain_ulps, gamma

HP = dict(alpha=2.0, beta=1.5, delta=3, max_o=2, t_lock=2)


@pytest.mark.parametrize("bad,match", [
    (dict(max_o=-1), "max_o"), (dict(delta=0), "delta"), (dict(t_lock=-2), "t_lock"),
    (dict(alpha=0.0), "alpha"), (dict(beta=-1.0), "beta"), (dict(alpha=float("nan")), "alpha"),
    (dict(warmup=-1), "warmup"), (dict(max_o=1.5), "max_o"), (dict(alpha="x"), "alpha"),
    (dict(units="("), "units"), (dict(units=3), "units"),
])
def test_invalid_arguments_raise_before_tracing(bad, match):
  with pytest.raises(ValueError, match=match):
    gnmr_jax.gnmr(**{**HP, **bad})


def test_regex_matching_no_leaf_raises_at_init():
  tx = gnmr_jax.gnmr(**HP, units=r"nothing_here")
  with pytest.raises(ValueError, match="matches no leaf"):
    tx.init({"w": jnp.ones((2, 2))})
  tx = gnmr_jax.gnmr(**HP, layer_axis=r"nothing_here")
  with pytest.raises(ValueError, match="layer_axis"):
    tx.init({"w": jnp.ones((2, 2))})


def test_updates_pass_through_unchanged_in_a_chain():
  params = {"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4)}
  grads = jax.tree.map(lambda p: jnp.sin(p) * 3.0, params)
  for inner in (optax.identity(), optax.adamw(1e-2)):
    ref = optax.chain(optax.clip_by_global_norm(1.0), inner)
    with_gnmr = optax.chain(gnmr_jax.gnmr(**HP), optax.clip_by_global_norm(1.0), inner)
    u_ref, _ = jax.jit(ref.update)(grads, ref.init(params), params)
    u_got, _ = jax.jit(with_gnmr.update)(grads, with_gnmr.init(params), params)
    # Exact: gnmr hands the updates on untouched (below: `out is grads`), so the rest of
    # the chain runs the same ops on the same values.
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), u_got, u_ref)
  tx = gnmr_jax.gnmr(**HP)
  out, _ = tx.update(grads, tx.init(params))
  assert out is grads


def test_recovery_mask_found_in_nested_and_masked_states():
  params = {"w": jnp.ones((3, 3)), "v": jnp.ones((3, 3)), "b": jnp.ones(3)}
  nested = optax.chain(
      optax.masked(gnmr_jax.gnmr(**HP), {"w": True, "v": False, "b": False}),
      optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3))
  state = nested.init(params)
  grads = {"w": jnp.full((3, 3), 1.0), "v": jnp.ones((3, 3)), "b": jnp.ones(3)}
  upd = jax.jit(nested.update)
  for scale in (1.0, 1.0, 50.0):
    _, state = upd(jax.tree.map(lambda g: g * scale, grads), state, params)
  mask = gnmr_jax.recovery_mask(state)
  assert bool(mask["w"]) and gnmr_jax.controller_state(state).telemetry.num_active == 1
  with pytest.raises(ValueError, match="exactly one GNMRState"):
    gnmr_jax.recovery_mask(optax.adam(1e-3).init(params))
  two = optax.chain(gnmr_jax.gnmr(**HP), gnmr_jax.gnmr(**HP)).init(params)
  with pytest.raises(ValueError, match="found 2"):
    gnmr_jax.controller_state(two)


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return nn.Dense(8, name="proj")(x), None


class _Stack(nn.Module):
  @nn.compact
  def __call__(self, x):
    stack = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=4)
    x, _ = stack(name="layers")(x, None)
    return nn.Dense(2, name="head")(x)


def test_scanned_layer_tree_gives_one_unit_per_layer():
  model = _Stack()
  params = model.init(jax.random.key(0), jnp.ones((2, 8)))
  assert params["params"]["layers"]["proj"]["kernel"].shape == (4, 8, 8)
  tx = gnmr_jax.gnmr(**HP, units=r"kernel", layer_axis=r"layers/")
  state = tx.init(params)
  assert state.mask["params"]["layers"]["proj"]["kernel"].shape == (4,)
  assert state.mask["params"]["layers"]["proj"]["bias"].shape == ()
  assert state.mask["params"]["head"]["kernel"].shape == ()
  assert int(state.telemetry.num_units) == 5

  def loss(p, x):
    return jnp.sum(model.apply(p, x) ** 2)

  upd = jax.jit(tx.update)
  x = jnp.ones((2, 8))
  for _ in range(4):
    _, state = upd(jax.grad(loss)(params, x), state)
  g = jax.grad(loss)(params, x)
  g["params"]["layers"]["proj"]["kernel"] = g["params"]["layers"]["proj"]["kernel"].at[2].mul(100.0)
  _, state = upd(g, state)
  np.testing.assert_array_equal(state.mask["params"]["layers"]["proj"]["kernel"],
                                [False, False, True, False])
  norms = np.sqrt((np.asarray(g["params"]["layers"]["proj"]["kernel"], np.float64) ** 2).sum((1, 2)))
  # Float32 sum of n = 64 squares: <= gamma_n relative (positive terms); sqrt halves
  # that and rounds once more (u = eps / 2).
  n = g["params"]["layers"]["proj"]["kernel"][0].size
  assert_allclose(state.norm["params"]["layers"]["proj"]["kernel"], norms,
                  rtol=gamma(n) / 2 + F32_EPS / 2)


def _run_norms(tx, norms):
  """Runs the transform on a 6-unit tree [6, 1] whose unit norms are `norms` [steps, 6]."""
  params = {"w": jnp.zeros((6, 1, 1))}
  state = tx.init(params)
  upd = jax.jit(tx.update)
  history = []
  for row in norms:
    _, state = upd({"w": jnp.asarray(row, jnp.float32).reshape(6, 1, 1)}, state)
    history.append(state)
  return history


norm_rows = st.lists(
    st.lists(st.one_of(st.floats(0.001, 1000.0).map(np.float32), st.sampled_from([0.0, np.nan, np.inf])),
             min_size=6, max_size=6), min_size=1, max_size=25)


@settings(max_examples=25, deadline=None)
@given(rows=norm_rows, max_o=st.integers(0, 6), t_lock=st.integers(0, 4))
def test_property_cap_and_no_poisoning(rows, max_o, t_lock):
  tx = gnmr_jax.gnmr(alpha=1.5, beta=1.5, delta=3, max_o=max_o, t_lock=t_lock, layer_axis="w")
  for state in _run_norms(tx, rows):
    assert int(np.sum(state.mask["w"])) <= max_o
    assert int(state.telemetry.num_active) == int(np.sum(state.mask["w"]))
    assert np.isfinite(np.asarray(state.norm_sum["w"])).all()
    assert np.isfinite(np.asarray(state.window["w"])).all()
    assert (np.asarray(state.lock["w"]) <= t_lock).all() and (np.asarray(state.lock["w"]) >= 0).all()


@settings(max_examples=15, deadline=None)
@given(t_lock=st.integers(0, 5), spike_at=st.integers(2, 8), unit=st.integers(0, 5),
       size=st.floats(10.0, 1e4))
def test_property_isolated_spike_lock_length(t_lock, spike_at, unit, size):
  rows = np.ones((spike_at + t_lock + 4, 6), np.float32)
  rows[spike_at - 1, unit] = size
  tx = gnmr_jax.gnmr(alpha=3.0, beta=3.0, delta=2, max_o=1, t_lock=t_lock, layer_axis="w")
  on = [t + 1 for t, s in enumerate(_run_norms(tx, rows)) if bool(s.mask["w"][unit])]
  assert on == list(range(spike_at, spike_at + t_lock + 1))


def test_orbax_round_trip_continues_bitwise(tmp_path):
  import orbax.checkpoint as ocp
  rng = np.random.default_rng(0)
  rows = rng.lognormal(0, 0.5, size=(20, 6)).astype(np.float32)
  rows[rng.random(rows.shape) < 0.05] *= 50
  tx = gnmr_jax.gnmr(alpha=1.8, beta=1.4, delta=3, max_o=2, t_lock=2, layer_axis="w")
  upd = jax.jit(tx.update)
  state = tx.init({"w": jnp.zeros((6, 1, 1))})
  def feed(state, rs):
    out = []
    for row in rs:
      _, state = upd({"w": jnp.asarray(row).reshape(6, 1, 1)}, state)
      out.append(state)
    return state, out
  mid, _ = feed(state, rows[:10])
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "ckpt", mid)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "ckpt", jax.tree.map(ocp.utils.to_shape_dtype_struct, mid))
  assert isinstance(restored, gnmr_jax.GNMRState)
  _, straight = feed(mid, rows[10:])
  _, resumed = feed(restored, rows[10:])
  # Exact: a checkpoint stores the float32 state bit for bit and the same jitted update
  # runs on it, so any difference is a lost or altered field.
  for a, b in zip(straight, resumed):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_sharded_update_matches_single_device_and_state_is_replicated():
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  assert jax.device_count() == 8, "tests/conftest.py sets 8 host devices"
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  params = {"stack": jnp.zeros((4, 16, 32)), "head": jnp.zeros((32, 8)), "b": jnp.zeros(8)}
  specs = {"stack": P(None, "data", "model"), "head": P("model", None), "b": P()}
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  delta = 3
  tx = gnmr_jax.gnmr(alpha=1.5, beta=1.3, delta=delta, max_o=2, t_lock=1, layer_axis="stack")
  rng = np.random.default_rng(1)
  grads_seq = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * rng.lognormal(0, 1),
                                                  jnp.float32), params) for _ in range(6)]
  single = tx.init(params)
  sharded = jax.jit(tx.init)(jax.device_put(params, shardings))
  upd = jax.jit(tx.update)
  for g in grads_seq:
    _, single = upd(g, single)
    _, sharded = upd(jax.device_put(g, shardings), sharded)
  for leaf in jax.tree_util.tree_leaves(sharded):
    assert leaf.sharding.is_fully_replicated
  # Not bit for bit: a sharded unit norm adds per-device partial sums in another order.
  # Two orders of an n-term sum of squares differ by ~sqrt(n) eps (tests/tolerances.py);
  # sqrt halves that and rounds once more. Every later division or addition of
  # differing inputs may round differently (<= eps each): the history sum over the
  # steps, GNMR = norm / mean (two divisions), the dGNMR window of delta GNMR values,
  # then the score's division.
  steps = len(grads_seq)
  num_terms = max(np.prod(p.shape[1:]) if name == "stack" else p.size
                  for name, p in params.items())
  norm = (chain_ulps([num_terms]) / 2 + 1) * F32_EPS
  norm_sum = norm + steps * F32_EPS
  ratio = norm + norm_sum + 2 * F32_EPS
  delta_ratio = 2 * ratio + (delta + 2) * F32_EPS
  rtols = dict(norm=norm, norm_sum=norm_sum, gnmr=ratio, window=ratio,
               delta_gnmr=delta_ratio, score=delta_ratio + F32_EPS)
  for field in single._fields:
    if field in rtols:
      jax.tree.map(lambda a, b, f=field: assert_allclose(a, b, rtol=rtols[f], err_msg=f),
                   getattr(single, field), getattr(sharded, field))
    else:
      # Exact: masks, locks, counts and telemetry are decisions on the values above,
      # and no value of these draws lies within rounding of a threshold.
      jax.tree.map(lambda a, b, f=field: np.testing.assert_array_equal(
          np.asarray(a), np.asarray(b), err_msg=f), getattr(single, field),
                   getattr(sharded, field))


def test_no_retrace_between_steps():
  traces = []
  tx = gnmr_jax.gnmr(**HP)
  def update(g, s):
    traces.append(1)
    return tx.update(g, s)
  upd = jax.jit(update)
  params = {"w": jnp.ones((3, 3))}
  state = tx.init(params)
  for i in range(5):
    _, state = upd({"w": jnp.full((3, 3), float(i + 1))}, state)
  assert len(traces) == 1
