"""The controller package: its unit layout codec, the static recipes and their config checks, and
its boundaries."""
import ast
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gnmr_jax
from gnmr_jax import control
from gnmr_jax.config import base_config, gnmr_config, validate_config
from gnmr_jax.control import units as units_lib
from tests.tolerances import F32_EPS

REPO = pathlib.Path(__file__).resolve().parents[1]
PARAMS = {"layers": {"mlp": {"down": {"kernel": jnp.zeros((3, 4, 2))},
                             "up": {"kernel": jnp.zeros((3, 2, 4))}}},
          "head": jnp.zeros((4, 5)), "norm": jnp.zeros(4)}
NAMES = ["head", "layers/mlp/down/kernel[0]", "layers/mlp/down/kernel[1]",
         "layers/mlp/down/kernel[2]", "layers/mlp/up/kernel[0]", "layers/mlp/up/kernel[1]",
         "layers/mlp/up/kernel[2]"]


def test_unit_layout_flattens_unflattens_names_and_norms_like_numpy():
  layout = control.layout_of(PARAMS, layer_axis=r"^layers/")
  assert layout.num_units == 7 and layout.names() == NAMES
  assert layout.leaf_flags == [True, True, True, False]  # tree order: head, down, up, norm
  vec = np.arange(7, dtype=np.float32) + 1
  tree = layout.unflat(jnp.asarray(vec), jnp.float32)
  assert float(tree["head"]) == 1.0 and tree["norm"].shape == ()
  np.testing.assert_array_equal(tree["layers"]["mlp"]["down"]["kernel"], [2, 3, 4])
  np.testing.assert_array_equal(tree["layers"]["mlp"]["up"]["kernel"], [5, 6, 7])
  np.testing.assert_array_equal(layout.flat(tree), vec)
  # trailing axes (the GNMR window): [N, delta] round trip
  window = layout.unflat(jnp.asarray(np.arange(14, dtype=np.float32).reshape(7, 2)),
                         jnp.float32, (2,))
  assert window["layers"]["mlp"]["up"]["kernel"].shape == (3, 2)
  np.testing.assert_array_equal(layout.flat(window, trailing=1), np.arange(14).reshape(7, 2))
  # per-unit gradient norms against float64 NumPy (one unit: a sum of <= 16 squares)
  grads = jax.tree_util.tree_map(
      lambda x: jax.random.normal(jax.random.key(x.size), x.shape), PARAMS)
  g = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), grads)
  want = np.concatenate([[np.linalg.norm(g["head"])],
                         np.linalg.norm(g["layers"]["mlp"]["down"]["kernel"], axis=(1, 2)),
                         np.linalg.norm(g["layers"]["mlp"]["up"]["kernel"], axis=(1, 2))])
  np.testing.assert_allclose(jax.jit(layout.norms)(grads), want, rtol=32 * F32_EPS)
  full = layout.full(True, jnp.bool_)
  assert layout.flat(full).tolist() == [True] * 7 and full["norm"].dtype == jnp.bool_


def _fixed_run(grad_scales, recipe=gnmr_jax.fixed_set, *args, warmup=2, max_o=3):
  tx = optax.chain(recipe(*args, max_o=max_o, warmup=warmup, layer_axis=r"^layers/"),
                   optax.adamw(1e-3))
  state = tx.init(PARAMS)
  update = jax.jit(tx.update)
  layout = control.layout_of(PARAMS, layer_axis=r"^layers/")
  masks = [np.asarray(layout.flat(gnmr_jax.recovery_mask(state)))]
  for scale in grad_scales:
    grads = jax.tree_util.tree_map(lambda x, s=scale: jnp.full(x.shape, s, jnp.float32), PARAMS)
    _, state = update(grads, state, PARAMS)
    masks.append(np.asarray(layout.flat(gnmr_jax.recovery_mask(state))))
  return np.asarray(masks), state


def test_fixed_priority_recovers_its_set_after_warmup_whatever_the_gradients():
  # Scales include a spike and a NaN step: a static set does not react to either.
  masks, state = _fixed_run([1.0, 1.0, 50.0, np.nan, 1.0], gnmr_jax.fixed_set,
                            r"down/kernel\[[02]\]|^head$")
  want = np.array([n in ("head", "layers/mlp/down/kernel[0]", "layers/mlp/down/kernel[2]")
                   for n in NAMES])
  np.testing.assert_array_equal(masks[:3], False)  # initial mask and warmup steps 1, 2
  np.testing.assert_array_equal(masks[3:], np.tile(want, (3, 1)))
  ctl = gnmr_jax.controller_state(state)
  assert int(ctl.telemetry.active_unit_steps) == 3 * 3 and int(ctl.telemetry.num_locked) == 0
  value = control.layout_of(PARAMS, layer_axis=r"^layers/").flat(
      control.state.find_states(state, control.PriorityState)[0].value)
  np.testing.assert_array_equal(value, want.astype(np.float32))


def test_static_recipes_last_blocks_and_late_switch():
  # NVIDIA's recipe: the last layer's units of every stacked leaf, for the whole run.
  masks, _ = _fixed_run([1.0, 50.0, 1.0], gnmr_jax.last_blocks, 1, warmup=0)
  want = np.array([n.endswith("[2]") for n in NAMES])  # down[2], up[2]; not head
  np.testing.assert_array_equal(masks[0], False)
  np.testing.assert_array_equal(masks[1:], np.tile(want, (3, 1)))
  # A global late switch: every unit from step 3 on (the mask after step 2 is used at step 3).
  masks, state = _fixed_run([1.0] * 5, gnmr_jax.late_switch, 3, warmup=0, max_o=7)
  np.testing.assert_array_equal(masks.all(axis=1), [False, False, True, True, True, True])
  np.testing.assert_array_equal(masks.any(axis=1), masks.all(axis=1))
  assert int(gnmr_jax.controller_state(state).telemetry.active_unit_steps) == 4 * 7
  with pytest.raises(ValueError, match="selects 7 units"):
    _fixed_run([1.0], gnmr_jax.late_switch, 3, max_o=6)
  with pytest.raises(ValueError, match="selects 6 units"):
    _fixed_run([1.0], gnmr_jax.last_blocks, 3, max_o=5)
  with pytest.raises(ValueError, match="`num_blocks` must be an integer >= 1"):
    gnmr_jax.last_blocks(0, max_o=3)
  with pytest.raises(ValueError, match="`switch_step` must be an integer >= 1"):
    gnmr_jax.late_switch(0, max_o=3)
  # A config field that only another priority reads is refused, not ignored.
  g = gnmr_config()
  g.update(priority="norm", switch_step=4)
  with pytest.raises(ValueError, match="switch_step=4 is read by priority 'late_switch' only"):
    control.from_config(g)


@pytest.mark.parametrize("regex, message", [
    (r"attn", "selects 0 units"), (r"mlp", "selects 6 units")])
def test_fixed_priority_refuses_a_set_it_cannot_hold(regex, message):
  tx = gnmr_jax.fixed_set(regex, max_o=3, layer_axis=r"^layers/")
  with pytest.raises(ValueError, match=message):
    tx.init(PARAMS)
  with pytest.raises(ValueError, match="`pattern` must be a regex"):
    gnmr_jax.fixed_set("", max_o=3)
  with pytest.raises(ValueError, match="`pattern` is not a valid regular expression"):
    gnmr_jax.fixed_set("(", max_o=3)
  g = gnmr_config()
  g.update(priority="norm", fixed_units="head")
  with pytest.raises(ValueError, match="read by priority 'fixed' only"):
    control.from_config(g)


def test_fixed_priority_from_config_and_its_config_checks():
  config = base_config("tiny")
  config.gnmr.priority = "fixed"
  with pytest.raises(ValueError, match="config.gnmr.fixed_units"):
    validate_config(config, 1)
  config.gnmr.fixed_units = "("
  with pytest.raises(ValueError, match="not a valid regex"):
    validate_config(config, 1)
  config.gnmr.fixed_units = r"mlp/down"
  validate_config(config, 1)
  tx = control.from_config(config.gnmr)
  params = {"layers": {"mlp": {"down": {"kernel": jnp.zeros((2, 4, 4))},
                               "up": {"kernel": jnp.zeros((2, 4, 4))}}}}
  state = tx.init(params)
  assert isinstance(state, control.PriorityState)
  config.gnmr.priority = "norm"
  with pytest.raises(ValueError, match="read by priority 'fixed' only"):
    validate_config(config, 1)
  config.gnmr.fixed_units, config.gnmr.priority = "", "last_blocks"
  with pytest.raises(ValueError, match="config.gnmr.last_blocks must be an integer >= 1"):
    validate_config(config, 1)
  config.gnmr.priority, config.gnmr.switch_step = "norm", 10
  with pytest.raises(ValueError, match="config.gnmr.switch_step=10 is read by priority"):
    validate_config(config, 1)
  config.gnmr.switch_step = 0
  config.diagnostics.update(recovery_gap_every=50, recovery_gap_pass="uniform")
  # (field, a non-default value, its default): each read by priority 'noise' only.
  for field, value, default in (("noise_rank", "norm", "pi"), ("noise_gate", "any", "unit"),
                                ("noise_upper", 0.5, 1 / 3), ("noise_lower", 0.1, 1 / 6)):
    config.gnmr[field] = value
    with pytest.raises(ValueError, match=f"config.gnmr.{field}={value!r} is read by priority "
                                         f"'noise' only; config.gnmr.priority is 'norm'"):
      validate_config(config, 1)
    config.gnmr.priority = "noise"
    validate_config(config, 1)
    config.gnmr.priority, config.gnmr[field] = "norm", default


def _imports_of(path):
  tree = ast.parse(path.read_text())
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      yield node.module, [a.name for a in node.names]
    elif isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, []


def test_control_imports_jax_optax_and_itself_only_and_no_protected_access_remains():
  allowed = re.compile(r"^(__future__|dataclasses|numbers|re|sys|typing|jax(\..*)?|numpy|optax"
                       r"|gnmr_jax\.control(\..*)?)$")
  for path in sorted((REPO / "gnmr_jax" / "control").glob("*.py")):
    for module, names in _imports_of(path):
      assert allowed.match(module), f"{path.name} imports {module}"
      if module == "gnmr_jax.control":
        assert not any(n.startswith("_") for n in names), f"{path.name}: private {names}"
  disables = [str(p.relative_to(REPO)) for p in (REPO / "gnmr_jax").rglob("*.py")
              if "protected-access" in p.read_text()]
  assert not disables
