"""gnmr_jax.lora (scenario 3): INT8 base storage, merge, and the adapter chain rule."""

import jax
import jax.numpy as jnp
import numpy as np

from gnmr_jax import lora
from gnmr_jax.control.units import path_to_str
from tests.tolerances import F32_EPS, assert_allclose, matmul_atol

U = F32_EPS / 2  # unit roundoff: one float32 rounding moves x by <= U |x|

L, K, N, R = 2, 6, 5, 3


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {'embed': {'embedding': jnp.asarray(rng.standard_normal((7, K)), jnp.float32)},
          'layers': {'attn': {'q': {'kernel': jnp.asarray(rng.standard_normal((L, K, N)),
                                                          jnp.float32)}},
                     'mlp': {'down': {'kernel': jnp.asarray(rng.standard_normal((L, N, K)),
                                                            jnp.float32)}}}}


def test_quantize_base_int8_matches_per_output_channel_reference():
  params = _params()
  out = lora.quantize_base_int8(params)
  w = np.asarray(params['layers']['attn']['q']['kernel'], np.float64)
  scale = np.max(np.abs(w), axis=1, keepdims=True) / 127.0
  # Same integer codes (no w / scale of this draw sits within rounding of a .5), so
  # only the float32 scale (absmax / 127: one rounding, two if XLA multiplies by a
  # rounded 1/127) and code * scale (one more) differ: <= 3u relative.
  assert_allclose(out['layers']['attn']['q']['kernel'], np.round(w / scale) * scale,
                  rtol=3 * U)
  assert len(np.unique(np.asarray(out['layers']['attn']['q']['kernel'])[0, :, 0])) <= 255
  np.testing.assert_array_equal(out['embed']['embedding'], params['embed']['embedding'])


def test_adapter_grads_equal_autodiff_through_merge():
  params = _params(1)
  adapters = lora.init_adapters(params, R, jax.random.key(0))
  assert set(adapters) == {'layers/attn/q/kernel', 'layers/mlp/down/kernel'}
  # Non-zero B so both chain-rule terms are exercised.
  adapters = {k: lora.Adapter(a.a, a.b + 0.1 * jnp.ones_like(a.b)) for k, a in adapters.items()}
  x = jnp.asarray(np.random.default_rng(2).standard_normal((4, K)), jnp.float32)
  scale = 2.0

  def loss(p):
    h = jnp.tanh(jnp.einsum('bk,kn->bn', x, p['layers']['attn']['q']['kernel'][0]))
    y = jnp.einsum('bn,nk->bk', h, p['layers']['mlp']['down']['kernel'][1])
    return jnp.sum(jnp.sin(y))

  want = jax.grad(lambda ad: loss(lora.merge(params, ad, scale)))(adapters)
  kernel_grads = jax.grad(loss)(lora.merge(params, adapters, scale))
  got = jax.jit(lora.adapter_grads, static_argnums=2)(kernel_grads, adapters, scale)
  flat_grads = {path_to_str(path): g
                for path, g in jax.tree_util.tree_flatten_with_path(kernel_grads)[0]}
  for name, ad in adapters.items():
    s_dw = scale * np.asarray(flat_grads[name], np.float64)  # [L, K, N]
    b_t, a_t = np.swapaxes(ad.b, -1, -2), np.swapaxes(ad.a, -1, -2)  # [L, N, r], [L, r, K]
    # Both run dW (eagerly: the same ops on the same values) through one contraction,
    # in another order: dA = s dW B^T sums N terms, dB = s A^T dW sums K. Two float32
    # orders are within 2 gamma_n of the sum of |terms|, plus the s product's rounding.
    want_a, want_b = np.asarray(want[name].a), np.asarray(want[name].b)
    assert_allclose(got[name].a, want_a,
                    atol=matmul_atol(s_dw, b_t, programs=2) + U * np.abs(want_a))
    assert_allclose(got[name].b, want_b,
                    atol=matmul_atol(a_t, s_dw, programs=2) + U * np.abs(want_b))
  # Merge: W + s A B, computed in float64. Float32: the R-term product (gamma_R of its
  # terms), the scaling and the sum (one rounding each).
  merged = lora.merge(params, adapters, scale)
  ad = adapters['layers/attn/q/kernel']
  product = scale * np.einsum('lkr,lrn->lkn', np.asarray(ad.a, np.float64),
                              np.asarray(ad.b, np.float64))
  ref = np.asarray(params['layers']['attn']['q']['kernel'], np.float64) + product
  assert_allclose(merged['layers']['attn']['q']['kernel'], ref,
                  atol=(scale * matmul_atol(ad.a, ad.b) + U * np.abs(product)
                        + U * np.abs(ref)))


def test_lora_task_in_the_library_loop_equals_the_hand_written_step_loop(tmp_path, data_dirs):
  """LoraTask through train_and_evaluate runs the steps of make_lora_step (the loop scenario 3
  used to carry): the same losses to float32 rounding, plus the loop's logs."""
  import json  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from gnmr_jax import control, metrics_log, train_loop  # pylint: disable=g-import-not-at-top
  from tests.train_helpers import small_config  # pylint: disable=g-import-not-at-top
  config = small_config(data_dirs, **{"train.steps": 3, "logging.log_every": 1,
                                      "train.eval_every": 0, "checkpoint.every_steps": 0,
                                      "gnmr.priority": "norm", "gnmr.warmup": 1})
  devices = jax.devices()[:1]
  base = train_loop.build(config, devices=devices)
  frozen = lora.quantize_base_int8(base.init_state(jax.random.key(0)).params)
  scale, optimizer = 2.0, optax.adamw(1e-2)
  controller = control.from_config(config.gnmr)
  task = lora.LoraTask(frozen, R, scale, optimizer, controller, adapter_seed=7,
                       summary_fn=lambda run, state, final: {"final": final})
  summary = train_loop.train_and_evaluate(config, str(tmp_path), task=task, devices=devices)
  assert summary["final"] is True and summary["step"] == 3
  assert summary["num_params"] == sum(a.a.size + a.b.size for a in task.init_state(
      None, spec=None).adapters.values())
  # By hand: the same step function, the same batches.
  step = jax.jit(lora.make_lora_step(base.model, frozen, controller, optimizer, scale,
                                     base.policy.routed))
  adapters = lora.init_adapters(frozen, R, jax.random.key(7))
  state = lora.LoraState(jnp.zeros((), jnp.int32), adapters, optimizer.init(adapters),
                         controller.init(frozen))
  it = base.data.train_iterator()
  losses = []
  for _ in range(3):
    state, metrics, _ = step(state, {k: jnp.asarray(v) for k, v in next(it).items()})
    losses.append(float(metrics["loss"]))
  logged = [r["loss"] for r in metrics_log.read_jsonl(
      str(tmp_path / metrics_log.METRICS_FILE))]
  # Two programs of the same steps (the loop's is jitted with its shardings and donation): XLA
  # may fuse the element-wise update differently, which moves an adapter by an ulp after a
  # step (seen: 1 ulp in mlp/down after step 1); three steps later the loss differs by a few
  # float32 ulps (2^-23 = 1.2e-7 relative), far below any real divergence.
  np.testing.assert_allclose(logged, losses, rtol=8 * 2.0 ** -23, atol=0)
  units = metrics_log.read_jsonl(str(tmp_path / metrics_log.UNITS_FILE))
  assert [sum(u["mask"]) for u in units] == [0, 0, config.gnmr.max_o]  # warmup 1, then max_o
  names = json.load(open(tmp_path / metrics_log.UNIT_NAMES_FILE))
  assert len(names) == len(units[0]["mask"]) == int(summary["num_units"])
