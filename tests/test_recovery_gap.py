"""gnmr_jax.control.recovery_gap: per-unit gaps against float64 NumPy, a user's model, and the train step
(the logged gap against an independent recovery-path gradient; exact resume with priority 'gap')."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gnmr_jax import metrics_log, train_loop
from gnmr_jax.control import recovery_gap, research
from gnmr_jax.data import make_data
from gnmr_jax.model import Transformer
from gnmr_jax.precision import default_precision_config, make_policy
from tests.train_helpers import small_config

EPS = float(np.finfo(np.float32).eps)


def _norm_rtol(num_terms):
  # A float32 sum of num_terms squares is off by at most ~num_terms * eps relative (sequential
  # worst case; XLA's tree reductions do better), the square root halves that, and the float32
  # difference and the square add a few eps.
  return num_terms * EPS / 2 + 4 * EPS


def test_unit_gaps_match_float64_numpy_per_unit_and_layer():
  rng = np.random.default_rng(0)
  used = {"stack": rng.normal(size=(3, 8, 5)).astype(np.float32),
          "w": rng.normal(size=(4, 6)).astype(np.float32), "b": np.ones(6, np.float32)}
  rec = jax.tree.map(lambda g: (g + 0.1 * rng.normal(size=g.shape)).astype(np.float32), used)
  mask = {"stack": np.array([False, True, False]), "w": np.array(True), "b": np.array(False)}
  # `rec` as every unit recovered (swapped=False): units in the mask show a residual only.
  gap = recovery_gap.unit_gaps(used, rec, mask, layer_axis="stack", swapped=False)
  d = {k: used[k].astype(np.float64) - rec[k].astype(np.float64) for k in used}
  want_stack = np.sqrt((d["stack"] ** 2).sum(axis=(1, 2)))
  np.testing.assert_allclose(gap.gap["stack"], want_stack, rtol=_norm_rtol(40))
  np.testing.assert_allclose(gap.gap["w"], np.sqrt((d["w"] ** 2).sum()), rtol=_norm_rtol(24))
  np.testing.assert_allclose(gap.rec_norm["stack"],
                             np.sqrt((rec["stack"].astype(np.float64) ** 2).sum(axis=(1, 2))),
                             rtol=_norm_rtol(40))
  assert gap.gap["b"].shape == () and float(gap.gap["b"]) == 0.0  # not a unit (1-D)
  # Valid: measured and on the low-cost path at that step.
  np.testing.assert_array_equal(gap.valid["stack"], [True, False, True])
  assert not bool(gap.valid["w"]) and not bool(gap.valid["b"])
  none = recovery_gap.unit_gaps(used, rec, mask, layer_axis="stack", measured=False)
  assert not np.any(np.asarray(none.valid["stack"]))
  # `rec` as the swapped pass (the default): every unit is measured, and a masked unit's
  # recovery gradient is the one the step used.
  swapped = recovery_gap.unit_gaps(used, rec, mask, layer_axis="stack", swapped=True)
  np.testing.assert_array_equal(swapped.valid["stack"], [True, True, True])
  assert bool(swapped.valid["w"]) and not bool(swapped.valid["b"])
  np.testing.assert_array_equal(swapped.gap["stack"], gap.gap["stack"])
  used_stack = np.sqrt((used["stack"].astype(np.float64) ** 2).sum(axis=(1, 2)))
  np.testing.assert_allclose(swapped.rec_norm["stack"][1], used_stack[1], rtol=_norm_rtol(40))
  np.testing.assert_allclose(swapped.rec_norm["w"], np.sqrt((used["w"].astype(np.float64) ** 2
                                                             ).sum()), rtol=_norm_rtol(24))
  sw = recovery_gap.swapped_mask(mask, used, layer_axis="stack")
  np.testing.assert_array_equal(sw["stack"], [True, False, True])
  assert not bool(sw["w"]) and not bool(sw["b"])
  skipped = recovery_gap.not_measured(used, layer_axis="stack")
  assert jax.tree.structure(skipped) == jax.tree.structure(gap)
  jax.tree.map(lambda a, b: a.shape == b.shape and a.dtype == b.dtype or (_ for _ in ()).throw(
      AssertionError((a.shape, b.shape))), skipped, gap)


def _two_layer_setup():
  """Static int8 and bf16 policies, one batch and the params of a two-matmul model."""
  static = {}
  for name in ("int8", "bf16"):
    c = default_precision_config()
    c.mode, c.low_cost_path = "static", name
    static[name] = make_policy(c)
  x = jax.random.normal(jax.random.key(0), (16, 32))
  params = {"w1": 0.2 * jax.random.normal(jax.random.key(1), (32, 32)),
            "w2": 0.2 * jax.random.normal(jax.random.key(2), (32, 8))}
  return static, x, params


@pytest.mark.xla_optimized
def test_measure_on_a_users_routed_model_equals_two_static_gradients():
  config = default_precision_config()  # mode 'gnmr': int8 low-cost, bf16 recovery
  policy = make_policy(config)
  static, x, params = _two_layer_setup()

  def loss_with(pol, mask):
    def loss(p, batch, m=None):
      del m
      h = jnp.tanh(pol.dot(batch, p["w1"], None if mask is None else mask["w1"]))
      return jnp.mean(pol.dot(h, p["w2"], None if mask is None else mask["w2"]) ** 2)
    return loss

  def routed_loss(p, batch, mask):
    return loss_with(policy, mask)(p, batch)

  gap = jax.jit(lambda p: recovery_gap.measure(routed_loss, p, x))(params)
  g_low = jax.grad(loss_with(static["int8"], None))(params, x)
  g_rec = jax.grad(loss_with(static["bf16"], None))(params, x)
  for k in params:
    diff = np.asarray(g_low[k], np.float64) - np.asarray(g_rec[k], np.float64)
    want = np.sqrt((diff ** 2).sum())
    rec = np.sqrt((np.asarray(g_rec[k], np.float64) ** 2).sum())
    assert want > 1e-3 * rec  # int8 really differs from bf16 here
    # Routed and static programs may round differently inside XLA fusions: a few eps of the
    # gradient's own size per element, summed over its elements.
    np.testing.assert_allclose(float(gap.gap[k]), want, rtol=_norm_rtol(g_rec[k].size),
                               atol=8 * EPS * rec)
    np.testing.assert_allclose(float(gap.rec_norm[k]), rec, rtol=_norm_rtol(g_rec[k].size))
    assert bool(gap.valid[k])


def _gap_config(data_dirs, **overrides):
  return small_config(data_dirs, **{"precision.mode": "static", "diagnostics.recovery_gap_every": 2,
                                    "diagnostics.recovery_gap_start": 1,
                                    "train.eval_every": 0, "checkpoint.every_steps": 0,
                                    "logging.unit_log_every": 1, **overrides})


def test_train_step_logs_the_gap_against_an_independent_recovery_gradient(tmp_path, data_dirs):
  config = _gap_config(data_dirs, **{"train.steps": 3})
  data = make_data(config.data)
  workdir = str(tmp_path / "run")
  train_loop.train_and_evaluate(config, workdir, data=data, devices=jax.devices()[:1])
  rows = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.GAP_FILE))
  assert [r["step"] for r in rows] == [1, 3]  # steps 1, 1 + K, 1 + 2K
  names = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.UNITS_FILE))
  assert len(rows[0]["gap"]) == len(names[0]["mask"]) == 2 * 7
  # Step 1 from the initial params, recomputed with two static models built here.
  run = train_loop.build(config, data=data, devices=jax.devices()[:1])
  state = run.init_state(jax.random.key(config.train.seed))
  batch = next(data.train_iterator())
  rec_cfg = default_precision_config()
  rec_cfg.mode, rec_cfg.low_cost_path = "static", config.precision.recovery_path
  rec_model = Transformer(run.model_config, make_policy(rec_cfg))

  def grads(model):
    def loss(p):
      targets = jnp.asarray(batch["targets"])  # the step's fused loss (gnmr_jax/loss.py)
      return model.apply({"params": p}, jnp.asarray(batch["inputs"]),
                         targets=targets) / targets.size
    return jax.jit(jax.grad(loss))(state.params)

  g_low, g_rec = grads(run.model), grads(rec_model)
  want = []
  for leaf_low, leaf_rec, path in zip(
      jax.tree.leaves(g_low), jax.tree.leaves(g_rec),
      [p for p, _ in jax.tree_util.tree_flatten_with_path(g_low)[0]]):
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    if name.endswith("kernel") and name.startswith("layers/"):
      d = np.asarray(leaf_low, np.float64) - np.asarray(leaf_rec, np.float64)
      want.append((name, np.sqrt((d ** 2).reshape(d.shape[0], -1).sum(axis=1)),
                   np.sqrt((np.asarray(leaf_rec, np.float64) ** 2).reshape(d.shape[0], -1).sum(1)),
                   leaf_rec[0].size))
  got = np.array(rows[0]["gap"])
  offset = 0
  for name, gap_l, rec_l, unit_size in want:
    n = len(gap_l)
    # The logged value is float32 rounded to 7 significant digits (5e-7 relative); the norm of
    # a unit's unit_size elements (_norm_rtol); and XLA may fuse the train step and these
    # programs differently, which moves each gradient element by a few eps of its own size:
    # e_u is then off by up to ~16 eps x ||g_rec,u|| of that unit.
    assert np.all(np.abs(got[offset:offset + n] - gap_l) <= (5e-7 + _norm_rtol(unit_size)) * gap_l
                  + 16 * EPS * rec_l), name
    offset += n
  assert offset == len(got) and got.max() > 0
  assert 0 < rows[0]["concentration"] <= 1 and 0 <= rows[0]["coverage"] <= 1


@pytest.mark.plumbing  # exact resume: all three runs without XLA optimizations
def test_gap_priority_run_resumes_bit_for_bit(tmp_path, data_dirs):
  config = _gap_config(data_dirs, **{"precision.mode": "gnmr", "gnmr.priority": "gap",
                                     "diagnostics.recovery_gap_pass": "swapped",
                                     "diagnostics.recovery_gap_start": 0,  # warmup + 1
                                     "gnmr.max_o": 2, "gnmr.warmup": 1, "train.steps": 4,
                                     "logging.log_every": 1})
  data = make_data(config.data)
  one = train_loop.train_and_evaluate(config, str(tmp_path / "a"), data=data,
                                      devices=jax.devices()[:1])
  train_loop.train_and_evaluate(config, str(tmp_path / "b"), data=data,
                                devices=jax.devices()[:1], stop_at=2)
  two = train_loop.train_and_evaluate(config, str(tmp_path / "b"), data=data,
                                      devices=jax.devices()[:1])
  # Resume restores the params, the optimizer and the gap estimate exactly, and the data
  # position: the same float32 program on the same values, so the same bits.
  assert one["eval_loss"] == two["eval_loss"]
  read = lambda w, f: metrics_log.read_jsonl(os.path.join(w, f))
  for f in (metrics_log.METRICS_FILE, metrics_log.UNITS_FILE, metrics_log.GAP_FILE):
    a, b = read(tmp_path / "a", f), read(tmp_path / "b", f)
    assert [{k: v for k, v in r.items() if k not in ("steps_per_s", "tokens_per_s")} for r in a] \
        == [{k: v for k, v in r.items() if k not in ("steps_per_s", "tokens_per_s")} for r in b]
  # recovery_gap_start 0: from the first selecting step, warmup + 1 = 2, then every K = 2.
  rows = read(tmp_path / "a", metrics_log.GAP_FILE)
  assert [r["step"] for r in rows] == [2, 4] and sum(rows[0]["mask"]) == 0
  # The swapped pass measures the units recovered on that step too (the int8 gap is > 0).
  row = rows[-1]
  assert row["step"] == 4 and sum(row["mask"]) == 2
  assert all(g > 0 for g, m in zip(row["gap"], row["mask"]) if m)
  masks = [r["mask"] for r in read(tmp_path / "a", metrics_log.UNITS_FILE)]
  # Selected after step 2 (warmup 1), so used at steps 3 and 4: max_o units each.
  assert sum(map(sum, masks)) == 2 * 2


@pytest.mark.xla_optimized
def test_uniform_pass_measures_every_unit_against_all_low_and_all_recovered():
  """'uniform': e_u = ||g_low,u - g_rec,u|| with every unit on one path on each side, whatever
  the mask; so the units in the mask are measured too (the 'recovery' pass marks them invalid)."""
  policy = make_policy(default_precision_config())  # routed int8 / bf16
  static, x, params = _two_layer_setup()

  def loss_with(pol, mask):
    h = lambda p, batch: jnp.tanh(pol.dot(batch, p["w1"], None if mask is None else mask["w1"]))
    return lambda p, batch: jnp.mean(
        pol.dot(h(p, batch), p["w2"], None if mask is None else mask["w2"]) ** 2)

  def routed_loss(p, batch, mask):
    return loss_with(policy, mask)(p, batch)

  mask = {"w1": jnp.array(True), "w2": jnp.array(False)}
  grads_used = jax.grad(routed_loss)(params, x, mask)
  uniform = jax.jit(lambda p, g: recovery_gap.measure(
      routed_loss, p, x, mask, g, measuring_pass="uniform"))(params, grads_used)
  rec_pass = recovery_gap.measure(routed_loss, params, x, mask, grads_used)
  g_low = jax.grad(loss_with(static["int8"], None))(params, x)
  g_rec = jax.grad(loss_with(static["bf16"], None))(params, x)
  for k in params:
    diff = np.asarray(g_low[k], np.float64) - np.asarray(g_rec[k], np.float64)
    rec = np.sqrt((np.asarray(g_rec[k], np.float64) ** 2).sum())
    # As in the test above: routed and static programs round differently inside fusions.
    np.testing.assert_allclose(float(uniform.gap[k]), np.sqrt((diff ** 2).sum()),
                               rtol=_norm_rtol(g_rec[k].size), atol=8 * EPS * rec)
    np.testing.assert_allclose(float(uniform.rec_norm[k]), rec, rtol=_norm_rtol(g_rec[k].size))
    assert bool(uniform.valid[k])
  # The 'recovery' pass: w1 ran the recovery path at this step, so it is not measured.
  assert not bool(rec_pass.valid["w1"]) and bool(rec_pass.valid["w2"])
  with np.testing.assert_raises_regex(ValueError, "measuring_pass"):
    recovery_gap.measure(routed_loss, params, x, measuring_pass="both")


def test_a_gap_measured_with_another_unit_layout_is_a_clear_error():
  params = {"layers": {"w": jnp.ones((3, 4, 4))}, "head": jnp.ones((4, 2))}
  grads = jax.tree.map(lambda p: 0.5 * p, params)
  tx = research.gap(max_o=1, t_lock=0, units=r"layers/w|head", layer_axis=r"^layers/")
  state = tx.init(params)
  good = recovery_gap.unit_gaps(grads, params, units=r"layers/w|head", layer_axis=r"^layers/")
  tx.update(grads, state, params, recovery_gap=good)  # the same layout: accepted
  # Measured without layer_axis: one unit for the whole stack instead of one per layer.
  bad = recovery_gap.unit_gaps(grads, params, units=r"layers/w|head")
  with np.testing.assert_raises_regex(ValueError, r"layers/w: RecoveryGap \(\), controller \(3,\)"):
    tx.update(grads, state, params, recovery_gap=bad)
