"""gnmr with Flax: Linen partitioning metadata, TrainState, NNX Optimizer (controller side)."""
import numpy as np
import jax
import jax.numpy as jnp
import optax
import pytest
import flax.linen as nn
from flax import nnx
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import gnmr_jax

HP = dict(alpha=2.0, beta=1.5, delta=3, max_o=1, t_lock=1)
SCALES = (1.0, 1.0, 1.0, 30.0, 1.0)  # gradient scale per step: a spike at step 4


def auto_mesh():
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


class _LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    init = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    x = nn.Dense(8, name="hidden", kernel_init=init)(x)
    return nn.Dense(2, name="out")(nn.gelu(x))


def _linen_masks(state, steps_fn, x):
  masks = []
  for scale in SCALES:
    state = steps_fn(state, x, scale)
    mask = gnmr_jax.recovery_mask(state.opt_state)
    masks.append([bool(mask["hidden"]["kernel"]), bool(mask["out"]["kernel"])])
  return np.asarray(masks), state


def _train_step(state, x, scale):
  def loss(params):
    return jnp.sum(state.apply_fn({"params": params}, x) ** 2)
  grads = jax.tree.map(lambda g: g * scale, jax.grad(loss)(state.params))
  return state.apply_gradients(grads=grads)


def test_linen_partitioned_params_sharded_init_recipe():
  model, x = _LinenMLP(), jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
  tx = optax.chain(gnmr_jax.gnmr(**HP, units=r"kernel$"), optax.adamw(1e-2))

  def init_fn(rng):
    params = model.init(rng, x)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  mesh = auto_mesh()
  abstract = jax.eval_shape(init_fn, jax.random.key(0))
  specs = nn.get_partition_spec(abstract)
  ctl_specs = gnmr_jax.controller_state(specs.opt_state)
  assert ctl_specs.mask["hidden"]["kernel"] == P() and ctl_specs.window["hidden"]["kernel"] == P()
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda s: isinstance(s, P))
  state = jax.jit(init_fn, out_shardings=shardings)(jax.random.key(0))
  assert state.opt_state[1][0].mu["hidden"]["kernel"].value.sharding.spec == P(None, "model")
  assert gnmr_jax.controller_state(state.opt_state).mask["hidden"]["kernel"].sharding.is_fully_replicated
  sharded_masks, _ = _linen_masks(state, jax.jit(_train_step, out_shardings=shardings), x)
  # Reference: the same run with the boxes stripped and nothing sharded.
  params = nn.unbox(model.init(jax.random.key(0), x)["params"])
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  plain_masks, _ = _linen_masks(plain, jax.jit(_train_step), x)
  np.testing.assert_array_equal(sharded_masks, plain_masks)
  assert plain_masks.any()


def test_flax_train_state_apply_gradients_drives_the_controller():
  model, x = _LinenMLP(), jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
  params = nn.unbox(model.init(jax.random.key(0), x)["params"])
  tx = optax.chain(gnmr_jax.gnmr(**HP, units=r"kernel$"), optax.sgd(1e-2))
  state = train_state.TrainState.create(apply_fn=model.apply, params=jax.tree.map(jnp.copy, params),
                                        tx=tx)
  masks, state = _linen_masks(state, jax.jit(_train_step, donate_argnums=0), x)
  # Reference: tx.update by hand on the same gradients.
  params, opt_state, want = params, tx.init(params), []
  for scale in SCALES:
    grads = jax.tree.map(lambda g, s=scale: g * s, jax.grad(
        lambda p: jnp.sum(model.apply({"params": p}, x) ** 2))(params))
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    mask = gnmr_jax.recovery_mask(opt_state)
    want.append([bool(mask["hidden"]["kernel"]), bool(mask["out"]["kernel"])])
  np.testing.assert_array_equal(masks, np.asarray(want))
  assert masks[3].any() and int(state.step) == len(SCALES)


class _NnxMLP(nnx.Module):
  def __init__(self, rngs, kernel_init=nnx.initializers.lecun_normal()):
    self.hidden = nnx.Linear(3, 8, kernel_init=kernel_init, rngs=rngs)
    self.out = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.gelu(self.hidden(x)))


def _nnx_loss(model, x):
  return jnp.sum(model(x) ** 2)


@nnx.jit
def _nnx_step(model, optimizer, x, scale):
  grads = nnx.grad(_nnx_loss)(model, x)
  optimizer.update(model, jax.tree.map(lambda g: g * scale, grads))


@pytest.mark.parametrize("units", [
    r"kernel$",
    lambda path, leaf: path.endswith("kernel") and leaf.ndim == 2,
], ids=["anchored_regex", "callable"])
def test_nnx_optimizer_selects_units_like_plain_optax(units):
  x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
  tx = optax.chain(gnmr_jax.gnmr(**HP, units=units), optax.adam(1e-2))
  model = _NnxMLP(nnx.Rngs(0))
  # Reference: plain optax on the same model's params as a dict of arrays.
  ref_model = _NnxMLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  ctl = gnmr_jax.controller_state(optimizer.opt_state)
  assert int(ctl.telemetry.num_units) == 2
  params = nnx.as_pure(nnx.state(ref_model, nnx.Param))
  opt_state = tx.init(params)
  for scale in SCALES:
    _nnx_step(model, optimizer, x, scale)
    grads = jax.tree.map(lambda g, s=scale: g * s, jax.grad(
        lambda p: _nnx_loss(nnx.merge(nnx.graphdef(ref_model), p), x))(params))
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    mask, want = gnmr_jax.recovery_mask(optimizer.opt_state), gnmr_jax.recovery_mask(opt_state)
    for name in ("hidden", "out"):
      leaf = mask[name]["kernel"]
      assert isinstance(leaf, jax.Array) and not isinstance(leaf, nnx.Variable)
      assert leaf.dtype == jnp.bool_ and leaf.shape == ()
      assert bool(leaf) == bool(want[name]["kernel"]), name
  assert int(gnmr_jax.controller_state(optimizer.opt_state).telemetry.active_unit_steps) > 0


def test_nnx_sharded_optimizer_recipe_gets_replicated_controller_specs():
  with jax.set_mesh(auto_mesh()):
    kernel_init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    tx = optax.chain(gnmr_jax.gnmr(**HP, units=r"kernel$"), optax.adam(1e-2))

    @nnx.jit
    def create_sharded():
      model = _NnxMLP(nnx.Rngs(0), kernel_init=kernel_init)
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      state = nnx.state(optimizer)
      nnx.update(optimizer, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
      return model, optimizer

    model, optimizer = create_sharded()
    # nnx.state turns the chain's tuple and the GNMRState into States keyed by index/field,
    # and each per-unit field (UnitValues) into one array keyed 'values'.
    specs = nnx.get_partition_spec(nnx.state(optimizer))["opt_state"]
    assert specs[0]["mask"]["values"].get_value() == P()
    assert specs[0]["window"]["values"].get_value() == P()
    assert specs[1][0]["mu"]["hidden"]["kernel"].get_value() == P(None, "model")
    x = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    for scale in SCALES:
      _nnx_step(model, optimizer, x, scale)
    mask = gnmr_jax.recovery_mask(optimizer.opt_state)
    assert bool(mask["hidden"]["kernel"]) or bool(mask["out"]["kernel"])
    assert mask["hidden"]["kernel"].sharding.is_fully_replicated
