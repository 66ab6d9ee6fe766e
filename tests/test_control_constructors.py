"""One constructor per controller: each gives, step for step and bit for bit, the state (and so
the mask) of the `control.from_config` string dispatch it stands for, jitted, over random
gradients with a spike, a non-finite step and measured recovery gaps."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gnmr_jax
from gnmr_jax import control
from gnmr_jax.config import gnmr_config
from gnmr_jax.control import recovery_gap, research

# Two layer-stacked leaves (3 units each), one plain matrix, one leaf that is no unit: 7 units.
PARAMS = {"layers": {"attn": {"q": {"kernel": jnp.zeros((3, 4, 4))}},
                     "mlp": {"down": {"kernel": jnp.zeros((3, 4, 4))}}},
          "head": {"kernel": jnp.zeros((4, 5))}, "norm": jnp.zeros(4)}
SELECT = dict(units=r"kernel", layer_axis=r"^layers/")
# Values off every default, so an argument that does not reach the controller shows; the same
# names in the constructors and in config.gnmr.
SHARED = dict(max_o=3, warmup=2, alpha=2.5, beta=1.75, delta=3, **SELECT)
STATIC_SET = r"down/kernel\[[02]\]|^head"

# (id, the constructor's controller, config.gnmr overrides for from_config, from_config's seed)
CASES = [
    ("gnmr", lambda: control.gnmr(t_lock=1, **SHARED), dict(priority="gnmr", t_lock=1, **SHARED), 0),
    ("transient_alarm", lambda: control.transient_alarm(max_o=3, warmup=2, **SELECT),
     dict(priority="gnmr", t_lock=None, max_o=3, warmup=2, **SELECT), 0),
    ("norm_level", lambda: control.norm_level(t_lock=1, **SHARED),
     dict(priority="norm", t_lock=1, **SHARED), 0),
    ("norm_level_default_t_lock", lambda: control.norm_level(**SHARED),
     dict(priority="norm", t_lock=None, **SHARED), 0),
    ("fixed_set", lambda: control.fixed_set(STATIC_SET, **SHARED),
     dict(priority="fixed", fixed_units=STATIC_SET, t_lock=4, **SHARED), 0),
    ("last_blocks", lambda: control.last_blocks(1, **SHARED),
     dict(priority="last_blocks", last_blocks=1, **SHARED), 0),
    ("late_switch", lambda: control.late_switch(5, **{**SHARED, "max_o": 7}),
     dict(priority="late_switch", switch_step=5, **{**SHARED, "max_o": 7}), 0),
    ("research.gap", lambda: research.gap(t_lock=1, gap_decay=0.5, **SHARED),
     dict(priority="gap", t_lock=1, gap_decay=0.5, **SHARED), 0),
    ("research.relgap", lambda: research.relgap(t_lock=2, gap_decay=0.25, **SHARED),
     dict(priority="relgap", t_lock=2, gap_decay=0.25, **SHARED), 0),
    # The config's gap_decay does not reach the oracle (the last measurement alone).
    ("research.oracle", lambda: research.oracle(t_lock=1, **SHARED),
     dict(priority="oracle", t_lock=1, gap_decay=0.5, **SHARED), 0),
    ("research.hybrid", lambda: research.hybrid(t_lock=2, **SHARED),
     dict(priority="hybrid", t_lock=2, **SHARED), 0),
    ("research.random", lambda: research.random(t_lock=1, seed=3, **SHARED),
     dict(priority="random", t_lock=1, **SHARED), 3),
    ("research.random_no_lock", lambda: research.random(t_lock=0, **SHARED),
     dict(priority="random", t_lock=0, **SHARED), 0),
    ("research.noise", lambda: research.noise(**SHARED),
     dict(priority="noise", t_lock=None, **SHARED), 0),
    ("research.noise_options", lambda: research.noise(
        t_lock=1, gap_decay=0.5, noise_upper=0.2, noise_lower=0.05, noise_rank="norm",
        noise_gate="any", **SHARED),
     dict(priority="noise", t_lock=1, gap_decay=0.5, noise_upper=0.2, noise_lower=0.05,
          noise_rank="norm", noise_gate="any", **SHARED), 0),
    # alpha and beta do not reach it (the norms never alarm): the saturated units alone.
    ("research.saturation", lambda: research.saturation(
        t_lock=1, max_o=3, warmup=2, delta=3, **SELECT),
     dict(priority="saturation", t_lock=1, **SHARED), 0),
]
# Units whose delayed-scaling codes saturated (``overflow=``), by step: (leaf, layer or None).
SATURATED = {3: [("down", 1)], 4: [("head", None), ("q", 0)], 6: [("down", 2)]}
STEPS = 9


def _config(overrides):
  g = gnmr_config()
  g.update(overrides)
  return g


def _gradients(step):
  """Random gradients whose units differ in size; a x20 spike of head at step 5, a NaN in one
  layer of q at step 7; the recovery-path gradients differ from them by up to their own size."""
  keys = jax.random.split(jax.random.key(step), 2)
  leaves, treedef = jax.tree_util.tree_flatten(PARAMS)
  scales = [1.0, 0.5, 2.0, 3.0]  # head, q, down, norm (tree order: sorted keys)
  grads = treedef.unflatten([s * jax.random.normal(jax.random.fold_in(keys[0], i), x.shape)
                             for i, (s, x) in enumerate(zip(scales, leaves))])
  noise = treedef.unflatten([(i + 1) / 4 * s * jax.random.normal(jax.random.fold_in(keys[1], i),
                                                                  x.shape)
                             for i, (s, x) in enumerate(zip(scales, leaves))])
  if step == 5:
    grads["head"]["kernel"] = 20 * grads["head"]["kernel"]
  if step == 7:
    grads["layers"]["attn"]["q"]["kernel"] = grads["layers"]["attn"]["q"]["kernel"].at[1, 0, 0].set(
        jnp.nan)
  return grads, jax.tree.map(jnp.add, grads, noise)


def _overflow(step):
  """The params-shaped bool tree of the units that saturated at ``step`` (SATURATED)."""
  flags = {"q": np.zeros(3, bool), "down": np.zeros(3, bool), "head": np.bool_(False)}
  for leaf, layer in SATURATED.get(step, ()):
    if layer is None:
      flags[leaf] = np.bool_(True)
    else:
      flags[leaf][layer] = True
  return {"layers": {"attn": {"q": {"kernel": flags["q"]}},
                     "mlp": {"down": {"kernel": flags["down"]}}},
          "head": {"kernel": flags["head"]}, "norm": np.bool_(False)}


def _states(tx):
  """The initial state and the state after each of STEPS jitted updates, with a recovery gap
  measured on every other step and the saturated units of SATURATED (the controllers that do
  not read them ignore them)."""
  update = jax.jit(tx.update)
  state = tx.init(PARAMS)
  states = [state]
  for step in range(1, STEPS + 1):
    grads, rec = _gradients(step)
    gap = recovery_gap.unit_gaps(grads, rec, gnmr_jax.recovery_mask(state),
                                 measured=step % 2 == 1, **SELECT)
    _, state = update(grads, state, PARAMS, recovery_gap=gap, overflow=_overflow(step))
    states.append(state)
  return states


def _assert_bitwise_equal(got, want, what):
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, (what, path)
    assert x.tobytes() == y.tobytes(), (what, jax.tree_util.keystr(path), x, y)


@pytest.mark.parametrize("name, make, overrides, seed", CASES, ids=[c[0] for c in CASES])
def test_constructor_gives_the_state_and_mask_of_from_config(name, make, overrides, seed):
  got, want = _states(make()), _states(control.from_config(_config(overrides), seed))
  assert type(got[0]) is type(want[0])
  for step, (a, b) in enumerate(zip(got, want)):
    _assert_bitwise_equal(a, b, f"{name}, state after step {step}")
  # The run has teeth: the controller recovered something, and not the same set every step
  # but for the static recipes.
  masks = np.array([np.asarray(control.layout_of(PARAMS, **SELECT).flat(
      gnmr_jax.recovery_mask(s))) for s in got])
  assert masks.any(), name
  if name not in ("fixed_set", "last_blocks", "late_switch"):
    assert len({m.tobytes() for m in masks[SHARED["warmup"] + 1:]}) > 1, name
  if name == "research.saturation":  # the saturated units of step t in the masks made at t and
    # t + 1 (t_lock 1: used at t + 1 and t + 2) after the warmup (2); the non-finite unit (q[1],
    # step 7) alike
    names = control.layout_of(PARAMS, **SELECT).names()
    for step in range(SHARED["warmup"] + 1, STEPS + 1):
      want = {f"layers/attn/q/kernel[{l}]" if leaf == "q" else f"layers/mlp/down/kernel[{l}]"
              if leaf == "down" else "head/kernel"
              for t in (step - 1, step) if t > SHARED["warmup"]
              for leaf, l in SATURATED.get(t, ())}
      if step in (7, 8):
        want.add("layers/attn/q/kernel[1]")
      got_units = {n for n, m in zip(names, masks[step]) if m}
      assert got_units == want, (step, got_units, want)
