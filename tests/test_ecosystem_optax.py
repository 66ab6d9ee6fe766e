"""gnmr inside the optax wrappers users combine optimizers with (docs/guides/works_with.md).

Each test runs the jitted path and checks masks against the plain transform or
the NumPy reference (tests/gnmr_reference.py), not just that nothing raises.
"""
import warnings

import numpy as np
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import gnmr_jax
from gnmr_jax import precision
from tests.gnmr_reference import run_reference

HP = dict(alpha=2.0, beta=1.5, delta=3, max_o=1, t_lock=1)
PARAMS = {"w": jnp.zeros((3, 4)), "v": jnp.zeros((4, 2)), "b": jnp.zeros(4)}


def grads_with_norms(norm_w, norm_v):
  """Gradients whose unit norms are exactly norm_w and norm_v (b is not a unit)."""
  return {"w": jnp.zeros((3, 4)).at[0, 0].set(norm_w), "v": jnp.zeros((4, 2)).at[1, 1].set(norm_v),
          "b": jnp.ones(4)}


# Unit w spikes at step 4, v at step 7: masks change at both.
NORMS = np.ones((9, 2), np.float32)
NORMS[3, 0] = 30.0
NORMS[6, 1] = 30.0


def run(tx, norms=NORMS, params=PARAMS, state=None):
  """Jitted updates with unit norms `norms` [steps, 2]; returns the [steps, 2] masks and state."""
  state = tx.init(params) if state is None else state
  upd = jax.jit(tx.update)
  masks = []
  for norm_w, norm_v in norms:
    _, state = upd(grads_with_norms(norm_w, norm_v), state, params)
    mask = gnmr_jax.recovery_mask(state)
    masks.append([bool(mask["w"]), bool(mask["v"])])
  return np.asarray(masks), state


def reference_masks(norms=NORMS, **hp):
  return run_reference(norms, **{**HP, **hp})["mask"]


def test_inject_hyperparams_alpha_beta_match_and_take_effect_mid_run():
  static = ("delta", "max_o", "t_lock", "warmup")
  make = optax.inject_hyperparams(gnmr_jax.gnmr, static_args=static)
  injected = make(**HP)
  plain, _ = run(gnmr_jax.gnmr(**HP))
  got, _ = run(injected)
  np.testing.assert_array_equal(got, plain)
  np.testing.assert_array_equal(got, reference_masks())
  # Raise alpha after step 5 (beta is out of play): the spike of v at step 7 no longer
  # counts. Reference: the NumPy rules with alpha as a schedule.
  high_beta = make(**{**HP, "beta": 1e4})
  first, state = run(high_beta, NORMS[:5])
  state.hyperparams["alpha"] = jnp.asarray(1e4, state.hyperparams["alpha"].dtype)
  rest, _ = run(high_beta, NORMS[5:], state=state)
  want = reference_masks(alpha=lambda count: 2.0 if count < 5 else 1e4, beta=1e4)
  np.testing.assert_array_equal(np.concatenate([first, rest]), want)
  assert want[3, 0] and not want[6:, 1].any() and reference_masks(beta=1e4)[6, 1], (
      "the change must matter for this sequence")
  # A shape-setting argument left to injection gets an error naming the fix.
  with pytest.raises(ValueError, match="static_args"):
    optax.inject_hyperparams(gnmr_jax.gnmr, static_args=("delta",))(**HP).init(PARAMS)


def test_gnmr_accepts_jax_and_numpy_scalars_and_checks_their_values():
  for alpha in (jnp.float32(2.0), np.float64(2.0), jnp.asarray(2, jnp.int32), np.asarray(2.0)):
    got, _ = run(gnmr_jax.gnmr(**{**HP, "alpha": alpha}))
    np.testing.assert_array_equal(got, reference_masks())
  for bad in (jnp.float32(0.0), np.float32(np.nan), jnp.ones(2), jnp.asarray(True)):
    with pytest.raises(ValueError, match="alpha"):
      gnmr_jax.gnmr(**{**HP, "alpha": bad})


def _spike_v(scale):
  return {"w": jnp.ones((3, 4)), "v": jnp.full((4, 2), scale), "b": jnp.ones(4)}


@pytest.mark.parametrize("wrapper", ["masked", "multi_transform", "partition"])
def test_masked_branches_give_false_scalars_the_policy_accepts(wrapper):
  labels = {"w": "other", "v": "ctl", "b": "other"}
  branch = optax.chain(gnmr_jax.gnmr(**HP), optax.sgd(0.1))
  if wrapper == "masked":
    tx = optax.chain(optax.masked(branch, {"w": False, "v": True, "b": False}),
                     optax.masked(optax.sgd(0.1), {"w": True, "v": False, "b": True}))
  else:
    tx = getattr(optax, wrapper)({"ctl": branch, "other": optax.sgd(0.1)}, labels)
  state = tx.init(PARAMS)
  upd = jax.jit(tx.update)
  for scale in (1.0, 1.0, 50.0):
    _, state = upd(_spike_v(scale), state, PARAMS)
  mask = gnmr_jax.recovery_mask(state)
  assert jax.tree.structure(mask) == jax.tree.structure(PARAMS)
  for name, leaf in mask.items():
    assert isinstance(leaf, jax.Array) and leaf.shape == () and leaf.dtype == jnp.bool_, name
  assert bool(mask["v"]) and not bool(mask["w"]) and not bool(mask["b"])
  ctl = gnmr_jax.controller_state(state)
  assert ctl.lock["w"].dtype == jnp.int32 and int(ctl.lock["w"]) == 0 and int(ctl.lock["v"]) == 1
  assert ctl.gnmr["w"].dtype == jnp.float32 and float(ctl.gnmr["v"]) == 50.0
  # The recipe of docs/guides/controller.md: hand every unit's bit to the routed policy.
  policy = precision.make_policy(precision.default_precision_config())
  x = jnp.ones((2, 3))
  out = policy.dot(x, jnp.ones((3, 4)), mask["w"])
  np.testing.assert_allclose(out, 3.0, rtol=1e-2)


def test_multisteps_inside_keeps_the_mask_per_window_and_dilutes_a_spike():
  k = 4
  norms = np.ones((8, 2), np.float32)
  norms[4, 0] = 40.0  # one micro-batch spike of w, in the second window
  inside = optax.MultiSteps(optax.chain(gnmr_jax.gnmr(**HP), optax.sgd(0.1)), k)
  outside = optax.chain(gnmr_jax.gnmr(**HP), optax.MultiSteps(optax.sgd(0.1), k))
  inside_masks, inside_state = run(inside, norms)
  outside_masks, _ = run(outside, norms)
  # Outside: the controller sees every micro-batch, so the mask flips at micro-step 5,
  # in the middle of an accumulation window.
  np.testing.assert_array_equal(outside_masks[:, 0], reference_masks(norms)[:, 0])
  assert outside_masks[4, 0] and not outside_masks[3, 0]
  # Inside: it sees the window's mean gradient once per window (micro-steps 4 and 8),
  # so the mask changes only at window ends; the spike arrives diluted k times:
  # mean norm (40 + 3) / 4 = 10.75 against 1 (instead of 40 against 1).
  assert (inside_masks[0:3] == inside_masks[0]).all() and (inside_masks[4:7] == inside_masks[3]).all()
  ctl = gnmr_jax.controller_state(inside_state)
  assert int(ctl.count) == 2
  np.testing.assert_allclose(float(ctl.norm["w"]), (40.0 + 3.0) / k, rtol=1e-6)
  np.testing.assert_array_equal(inside_masks[[3, 7]], reference_masks(
      np.array([[1.0, 1.0], [(40.0 + 3.0) / k, 1.0]], np.float32)))


def test_apply_if_finite_outside_hides_nan_steps_from_the_controller():
  nan_grads = {"w": jnp.full((3, 4), jnp.nan), "v": jnp.ones((4, 2)), "b": jnp.ones(4)}
  sees = optax.chain(gnmr_jax.gnmr(**HP), optax.apply_if_finite(optax.sgd(0.1), 5))
  hides = optax.apply_if_finite(optax.chain(gnmr_jax.gnmr(**HP), optax.sgd(0.1)), 5)
  results = {}
  for name, tx in (("sees", sees), ("hides", hides)):
    state = tx.init(PARAMS)
    upd = jax.jit(tx.update)
    for g in (_spike_v(1.0), _spike_v(1.0), nan_grads):
      updates, state = upd(g, state, PARAMS)
    assert not np.isnan(np.asarray(updates["w"])).any()  # both keep NaN out of the params
    results[name] = gnmr_jax.controller_state(state)
  # chain(gnmr, apply_if_finite(...)): the controller counts the step, flags w
  # non-finite and recovers it first.
  assert int(results["sees"].count) == 3 and int(results["sees"].telemetry.num_nonfinite) == 1
  assert bool(results["sees"].mask["w"])
  # apply_if_finite(chain(gnmr, ...)): the NaN step never reaches the controller.
  assert int(results["hides"].count) == 2 and int(results["hides"].telemetry.num_nonfinite) == 0
  assert not bool(results["hides"].mask["w"])


def test_contrib_optimizers_and_extra_args_pass_through():
  params = {"w": jnp.ones((4, 4)), "v": jnp.ones((4, 2))}
  grads = {"w": jnp.arange(16.0).reshape(4, 4) / 10, "v": jnp.ones((4, 2))}
  for inner in (optax.contrib.muon(1e-2), optax.contrib.schedule_free_adamw(1e-2),
                optax.contrib.reduce_on_plateau()):
    ref = optax.chain(inner)
    ref_updates, _ = jax.jit(ref.update)(grads, ref.init(params), params, value=jnp.ones(()))
    tx = optax.chain(gnmr_jax.gnmr(**HP), inner)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params, value=jnp.ones(()))
    jax.tree.map(np.testing.assert_array_equal, updates, ref_updates)
    assert int(gnmr_jax.controller_state(state).count) == 1


def test_lookahead_wrapping_the_controller_matches_the_reference():
  tx = optax.lookahead(optax.chain(gnmr_jax.gnmr(**HP), optax.sgd(0.1)), sync_period=2,
                       slow_step_size=0.5)
  params = optax.LookaheadParams.init_synced(PARAMS)
  state = tx.init(params)
  upd = jax.jit(tx.update)
  masks = []
  for norm_w, norm_v in NORMS:
    updates, state = upd(grads_with_norms(norm_w, norm_v), state, params)
    params = optax.apply_updates(params, updates)
    mask = gnmr_jax.recovery_mask(state)
    masks.append([bool(mask["w"]), bool(mask["v"])])
  np.testing.assert_array_equal(np.asarray(masks), reference_masks())


@pytest.mark.parametrize("units", [r"^(w|v)$", None])
def test_tree_map_params_gives_param_specs_to_moments_only(units):
  specs = {"w": P(None, "model"), "v": P("model", None), "b": P()}
  tx = optax.chain(gnmr_jax.gnmr(**HP, units=units), optax.adam(1e-3))
  state = tx.init(PARAMS)
  opt_specs = optax.tree_utils.tree_map_params(
      tx, lambda _, spec: spec, state, specs, transform_non_params=lambda _: P(),
      is_leaf=lambda x: isinstance(x, P))
  ctl_specs, adam_specs = opt_specs[0], opt_specs[1][0]
  assert adam_specs.mu == specs and adam_specs.nu == specs
  assert ctl_specs.mask == P() and ctl_specs.window == P() and ctl_specs.count == P()
  # The specs are usable as out_shardings of a sharded init (a prefix of the state).
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), opt_specs,
                           is_leaf=lambda x: isinstance(x, P))
  sharded = jax.jit(tx.init, out_shardings=shardings)(PARAMS)
  assert sharded[1][0].mu["w"].sharding.spec == P(None, "model")
  assert sharded[0].mask["w"].sharding.is_fully_replicated


def test_selectors_that_select_nothing_raise_like_a_regex():
  with pytest.raises(ValueError, match="selects no leaf"):
    gnmr_jax.gnmr(**HP, units=lambda path, leaf: False).init(PARAMS)
  with pytest.raises(ValueError, match="selects no leaf"):
    gnmr_jax.gnmr(**HP).init({"b": jnp.zeros(4), "scale": jnp.zeros(())})
  with pytest.raises(ValueError, match="matches no leaf"):
    gnmr_jax.gnmr(**HP, units=r"nothing_here").init(PARAMS)


def test_update_with_another_unit_layout_than_init_raises():
  tx = gnmr_jax.gnmr(**HP)
  state = tx.init(PARAMS)
  other = {"w": jnp.ones((3, 4)), "v": jnp.ones((4, 2)), "b": jnp.ones((4, 4))}  # b a unit now
  with pytest.raises(ValueError, match="unit layout differs"):
    jax.jit(tx.update)(other, state)
  stacked = gnmr_jax.gnmr(**HP, layer_axis=r"^w$")
  with pytest.raises(ValueError, match="unit layout differs"):
    stacked.update(grads_with_norms(1.0, 1.0), tx.init(PARAMS))


def test_complex_gradients_use_the_modulus():
  tx = gnmr_jax.gnmr(**HP, units=r"^c$")
  params = {"c": jnp.zeros((2, 2), jnp.complex64), "d": jnp.zeros((2, 2))}
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # JAX's "discards the imaginary part" ComplexWarning
    _, state = jax.jit(tx.update)({"c": 1j * jnp.ones((2, 2), jnp.complex64),
                                   "d": jnp.ones((2, 2))}, tx.init(params))
    _, state = jax.jit(tx.update)({"c": jnp.full((2, 2), 3 + 4j, jnp.complex64),
                                   "d": jnp.ones((2, 2))}, state)
  np.testing.assert_allclose(float(state.norm_sum["c"]), 2.0 + 10.0, rtol=1e-6)
  np.testing.assert_allclose(float(state.norm["c"]), 10.0, rtol=1e-6)


def test_skip_nonfinite_is_apply_if_finite_bit_for_bit_without_its_cond():
  from gnmr_jax.optim import skip_nonfinite  # pylint: disable=g-import-not-at-top
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
  ours, theirs = skip_nonfinite(inner, 2), optax.apply_if_finite(inner, 2)
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.ones(4)}
  good = {"w": jnp.full((3, 4), 0.5), "b": jnp.arange(4.0)}
  nan = {"w": good["w"].at[1, 2].set(jnp.nan), "b": good["b"]}
  inf = {"w": good["w"], "b": good["b"].at[0].set(jnp.inf)}
  # finite, NaN, Inf, NaN (the third in a row passes max_consecutive_errors=2), finite
  sequence = [good, nan, inf, nan, good]
  states = [tx.init(params) for tx in (ours, theirs)]
  for grads in sequence:
    out = [jax.jit(tx.update)(grads, s, params) for tx, s in zip((ours, theirs), states)]
    (u1, s1), (u2, s2) = out
    jax.tree.map(np.testing.assert_array_equal, u1, u2)
    jax.tree.map(np.testing.assert_array_equal, s1, s2)
    states = [s1, s2]
  assert int(states[0].total_notfinite) == 3 and int(states[0].notfinite_count) == 0
  # ... and its program has no conditional (what costs apply_if_finite the state's copies)
  hlo = jax.jit(ours.update).lower(good, states[0], params).compile().as_text()
  assert "conditional" not in hlo
