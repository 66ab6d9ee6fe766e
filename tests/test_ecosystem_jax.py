"""gnmr under JAX transforms and meshes: explicit/auto axes, shard_map, donation, remat, vmap.

The sharded runs use integer-valued gradients (scaled by powers of two), so
every sum of squares is exact in float32 whatever the reduction order, and the
whole controller state can be compared to an unsharded run bit for bit.
"""
import collections

import numpy as np
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import gnmr_jax
from gnmr_jax import precision

TX_ARGS = dict(alpha=1.5, beta=1.3, delta=3, max_o=2, t_lock=1, layer_axis=r"^stack$")


def integer_grads(shapes, steps, seed=0):
  """[steps] gradient trees with small integer entries times 2**k, and a few spikes."""
  rng = np.random.default_rng(seed)
  out = []
  for t in range(steps):
    tree = {}
    for name, shape in shapes.items():
      g = rng.integers(-4, 5, size=shape).astype(np.float32) * 2.0 ** rng.integers(-2, 3)
      if name == "stack" and t in (3, 6):
        g[t % shape[0]] *= 64.0  # one layer spikes
      tree[name] = g
    out.append(tree)
  return out


def assert_states_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("mesh_shape,specs", [
    ((8,), {"stack": P("data", None, None), "head": P(None, "data")}),
    ((2, 4), {"stack": P("data", None, "model"), "head": P("model", None)}),
])
def test_explicit_mesh_layer_sharded_update_is_bitwise_unsharded(mesh_shape, specs):
  names = ("data", "model")[:len(mesh_shape)]
  mesh = jax.make_mesh(mesh_shape, names)
  assert all(t == AxisType.Explicit for t in mesh.axis_types), "jax.make_mesh's default"
  shapes = {"stack": (8, 4, 8), "head": (8, 8), "b": (8,)}
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  grads_seq = integer_grads(shapes, steps=8)
  tx = gnmr_jax.gnmr(**TX_ARGS)
  upd = jax.jit(tx.update)
  plain = tx.init(params)
  plain_states = []
  for g in grads_seq:
    _, plain = upd(g, plain)
    plain_states.append(plain)
  assert np.asarray(plain.telemetry.active_unit_steps) > 0, "masks must not be trivially False"
  with jax.set_mesh(mesh):
    shardings = {k: NamedSharding(mesh, specs.get(k, P())) for k in shapes}
    state = jax.jit(tx.init)(jax.device_put(params, shardings))
    # The per-unit fields are one array each over the 9 units (8 layers of 'stack', 'head'),
    # whatever the params' sharding: no per-layer leaf that a user could shard along layers.
    assert state.window.values.shape == (9, 3) and state.mask.values.shape == (9,)
    assert state.window.values.sharding.is_fully_replicated
    if len(mesh_shape) == 1:
      # A state a user put on the mesh by hand (explicit replicated NamedShardings).
      state = jax.device_put(state, NamedSharding(mesh, P()))
    upd = jax.jit(tx.update)
    for g, want in zip(grads_seq, plain_states):
      _, state = upd(jax.device_put(g, shardings), state)
      assert_states_equal(state, want)
  for leaf in jax.tree.leaves(state):
    assert leaf.sharding.is_fully_replicated


def test_explicit_mesh_state_a_user_sharded_along_units_updates_bitwise_unsharded():
  """8 units (the 8 layers of 'stack') on 8 devices: a user who device_puts the state's
  [8, ...] per-unit arrays sharded along the unit axis gets the unsharded run's states (the
  update reshards its per-unit vectors to replicated, as it does the norms)."""
  mesh = jax.make_mesh((8,), ("data",))
  shapes = {"stack": (8, 4, 8)}
  params = {"stack": jnp.zeros(shapes["stack"])}
  grads_seq = integer_grads(shapes, steps=8)
  tx = gnmr_jax.gnmr(**TX_ARGS)
  plain, plain_states = tx.init(params), []
  for g in grads_seq:
    _, plain = jax.jit(tx.update)(g, plain)
    plain_states.append(plain)
  assert np.asarray(plain.telemetry.active_unit_steps) > 0, "masks must not be trivially False"
  with jax.set_mesh(mesh):
    state = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P("data") if np.ndim(x) and
                                                  np.shape(x)[0] == 8 else P())),
        jax.jit(tx.init)(params))
    assert not state.window.values.sharding.is_fully_replicated
    upd = jax.jit(tx.update)
    for g, want in zip(grads_seq, plain_states):
      _, state = upd(g, state)
      assert_states_equal(state, want)


def test_shard_map_data_parallel_update_is_bitwise_unsharded():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  shapes = {"stack": (8, 4, 8), "head": (8, 8)}
  params = {k: jnp.zeros(s) for k, s in shapes.items()}
  per_device = [integer_grads(shapes, steps=6, seed=d) for d in range(8)]
  tx = optax.chain(gnmr_jax.gnmr(**TX_ARGS), optax.sgd(0.5))

  # Each device holds its batch shard's gradient; psum gives the full-batch sum (exact here).
  def step(local_grads, state):
    grads = jax.lax.psum(jax.tree.map(lambda g: g[0], local_grads), "data")
    _, state = tx.update(grads, state, params)
    return state

  sharded_step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P()),
                                       out_specs=P()))
  plain_step = jax.jit(lambda g, s: tx.update(g, s, params)[1])
  sharded = plain = tx.init(params)
  for t in range(6):
    stacked = jax.tree.map(lambda *gs: np.stack(gs), *[per_device[d][t] for d in range(8)])
    sharded = sharded_step(stacked, sharded)
    plain = plain_step(jax.tree.map(lambda g: g.sum(0), stacked), plain)
    assert_states_equal(sharded, plain)
  assert int(gnmr_jax.controller_state(plain).telemetry.active_unit_steps) > 0


def test_donated_state_and_remat_grads_give_the_same_masks():
  def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w["a"]) @ w["b"])

  params = {"a": jnp.full((4, 8), 0.1), "b": jnp.full((8, 2), 0.1)}
  tx = optax.chain(gnmr_jax.gnmr(alpha=2.0, beta=1.5, delta=3, max_o=1, t_lock=1),
                   optax.adam(1e-2))

  def make_step(grad_fn):
    def step(params, opt_state, x):
      updates, opt_state = tx.update(grad_fn(params, x), opt_state, params)
      return optax.apply_updates(params, updates), opt_state
    return step

  plain = jax.jit(make_step(jax.grad(loss)))
  donated_remat = jax.jit(make_step(jax.grad(jax.checkpoint(loss))), donate_argnums=(0, 1))
  xs = [jnp.full((3, 4), v) for v in (1.0, 1.0, 1.0, 40.0, 1.0)]
  p1, s1 = params, tx.init(params)
  p2, s2 = jax.tree.map(jnp.copy, params), tx.init(params)
  for x in xs:
    p1, s1 = plain(p1, s1, x)
    old = s2
    p2, s2 = donated_remat(p2, s2, x)
    # XLA reuses the donated buffers that an output can alias: the history, the moments.
    assert old[0].window.values.is_deleted() and old[1][0].mu["a"].is_deleted()
    assert_states_equal(s2, s1)
  assert int(gnmr_jax.controller_state(s1).telemetry.active_unit_steps) > 0


def test_vmap_over_independent_controllers_matches_each_run():
  tx = gnmr_jax.gnmr(**TX_ARGS)
  shapes = {"stack": (4, 2, 3), "head": (3, 3)}
  runs = [integer_grads(shapes, steps=7, seed=s) for s in range(3)]
  params = {k: jnp.zeros((3,) + s) for k, s in shapes.items()}
  batched = jax.vmap(tx.init)(params)
  upd = jax.jit(jax.vmap(tx.update))
  singles = [tx.init({k: v[0] for k, v in params.items()}) for _ in runs]
  for t in range(7):
    g = jax.tree.map(lambda *gs: np.stack(gs), *[r[t] for r in runs])
    _, batched = upd(g, batched)
    singles = [jax.jit(tx.update)(r[t], s)[1] for r, s in zip(runs, singles)]
  for i, single in enumerate(singles):
    assert_states_equal(jax.tree.map(lambda x: x[i], batched), single)
  # The readers of a batched state: each leaf with the batch axis first, the runs in order.
  for read in (gnmr_jax.recovery_mask, lambda s: gnmr_jax.controller_state(s).window):
    got = read(batched)
    assert got["stack"].shape[:2] == (3, 4) and got["head"].shape[:1] == (3,)
    want = jax.tree.map(lambda *xs: np.stack(xs), *[read(s) for s in singles])
    assert_states_equal(got, want)
  assert any(np.any(np.asarray(m)) for m in jax.tree.leaves(gnmr_jax.recovery_mask(batched)))


def primitive_counts(closed_jaxpr):
  """How often each primitive occurs, nested jaxprs (cond branches, custom_vjp) included."""
  counts = collections.Counter()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      counts[eqn.primitive.name] += 1
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(closed_jaxpr.jaxpr)
  return counts


def test_vmap_with_a_batched_recover_bit_turns_cond_into_select():
  policy = precision.make_policy(precision.default_precision_config())  # int8 / bf16
  kernel = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)
  xs = jnp.linspace(-2.0, 2.0, 3 * 2 * 8).reshape(3, 2, 8)
  recover = jnp.array([True, False, True])

  def routed(x, bit):
    return policy.dot(x, kernel, bit)

  one = primitive_counts(jax.make_jaxpr(routed)(xs[0], recover[0]))
  batched = primitive_counts(jax.make_jaxpr(jax.vmap(routed))(xs, recover))
  # The quantizer has selects of its own; the cond adds more when it becomes a select.
  assert one["cond"] == 1 and batched["cond"] == 0
  assert batched["select_n"] > one["select_n"]
  # So both paths run for every example (no saving from routing), with the right result.
  got = jax.vmap(routed)(xs, recover)
  for i in range(3):
    np.testing.assert_array_equal(got[i], routed(xs[i], recover[i]))
  # One unbatched bit for the whole vmapped batch keeps the cond.
  shared = primitive_counts(jax.make_jaxpr(jax.vmap(routed, in_axes=(0, None)))(xs, recover[0]))
  assert shared["cond"] == 1
