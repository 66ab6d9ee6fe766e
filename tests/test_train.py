"""Training pipeline end to end: train.py, exact resume, sharded step, config errors."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from gnmr_jax import config as config_lib
from gnmr_jax import metrics_log, optim, train_loop
from gnmr_jax.data import make_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "configs"))
import tiny  # noqa: E402  pylint: disable=g-import-not-at-top
from tests.train_helpers import small_config  # noqa: E402
from tests.tolerances import chain_ulps, f32_atol, transformer_reductions  # noqa: E402


def run_train_py(workdir, data_dirs, *flags):
  cmd = [sys.executable, os.path.join(REPO, "train.py"), "--config",
         os.path.join(REPO, "configs/tiny.py") + ":runlocal", f"--workdir={workdir}",
         f"--config.data.data_dir={data_dirs[0]}", f"--config.data.sdist_path={data_dirs[1]}",
         *flags]
  env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
  return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)


@pytest.mark.plumbing  # train.py's logs, resume and refusals; no XLA optimizations
def test_train_py_end_to_end_resume_and_refusal(tmp_path, data_dirs):
  workdir = str(tmp_path / "run")
  out = run_train_py(workdir, data_dirs, "--config.train.steps=6", "--config.gnmr.max_o=3")
  assert out.returncode == 0, out.stderr[-3000:]
  assert "validation perplexity" in out.stdout and "recovered unit-steps" in out.stdout
  assert "of 14 units x 6 steps" in out.stdout
  rows = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.METRICS_FILE))
  assert [r["step"] for r in rows] == [2, 4, 6]
  assert all(np.isfinite(r["loss"]) and r["num_active"] <= 3 for r in rows)
  units = metrics_log.read_jsonl(os.path.join(workdir, metrics_log.UNITS_FILE))
  assert len(units) == 6 and all(len(u["mask"]) == 14 and sum(u["mask"]) <= 3 for u in units)
  names = json.load(open(os.path.join(workdir, metrics_log.UNIT_NAMES_FILE)))
  assert names[0] == "layers/attn/k/kernel[0]" and len(names) == 14
  for f in ("loss.png", "recovery_heatmap.png", "score_heatmap.png"):
    assert os.path.getsize(os.path.join(workdir, "plots", f)) > 1000
  summary = json.load(open(os.path.join(workdir, metrics_log.SUMMARY_FILE)))
  assert summary["step"] == 6 and summary["eval_perplexity"] > 1.0
  # Same workdir, more steps: resumes at 6 and goes on to 8.
  out = run_train_py(workdir, data_dirs, "--config.train.steps=8", "--config.gnmr.max_o=3")
  assert out.returncode == 0, out.stderr[-3000:]
  assert [r["step"] for r in metrics_log.read_jsonl(
      os.path.join(workdir, metrics_log.METRICS_FILE))] == [2, 4, 6, 8]
  # A different model in the same workdir is refused, naming the field.
  out = run_train_py(workdir, data_dirs, "--config.model.d_model=32")
  assert out.returncode == 2 and "model.d_model" in out.stderr
  assert "different config" in out.stderr
  # Unknown precision names are refused before tracing, listing the valid ones.
  out = run_train_py(str(tmp_path / "bad"), data_dirs, "--config.precision.low_cost_path=int3")
  assert out.returncode == 2 and "int3" in out.stderr and "int8" in out.stderr
  assert "Traceback" not in out.stderr
  out = run_train_py(str(tmp_path / "bad"), data_dirs, "--config.train.stpes=3")
  assert out.returncode == 2 and "stpes" in out.stderr and "Traceback" not in out.stderr


def _state_arrays(workdir, config, data):
  run = train_loop.build(config, data=data, devices=jax.devices()[:1])
  ckpt = train_loop.checkpointing.Checkpointer(workdir, 2)
  abstract = run.abstract_state
  fp = train_loop.checkpointing.config_fingerprint(run.config, data.vocab_size)
  step, state, data_state = ckpt.restore(
      train_loop.checkpointing.abstract_like(abstract, run.state_shardings), fp)
  ckpt.close()
  return step, jax.tree.map(np.asarray, state), data_state


@pytest.mark.plumbing  # both runs without XLA optimizations
def test_resume_continues_bit_for_bit(tmp_path, tiny_run):
  # The uninterrupted run "a" is the shared 8-step run (conftest.tiny_run, every step logged);
  # "b" is the same config stopped after step 3 and resumed.
  config, data, workdir_a, one = tiny_run
  first = train_loop.train_and_evaluate(config, str(tmp_path / "b"), data=data,
                                        devices=jax.devices()[:1], stop_at=3)
  assert first["preempted"] and first["step"] == 3
  two = train_loop.train_and_evaluate(config, str(tmp_path / "b"), data=data,
                                      devices=jax.devices()[:1])
  # Exact: the checkpoint holds the state and the data iterator bit for bit, and the
  # resumed run executes the same compiled step on them, so nothing may differ.
  assert two["step"] == 8 and one["eval_loss"] == two["eval_loss"]
  losses = lambda w: [r["loss"] for r in metrics_log.read_jsonl(
      os.path.join(w, metrics_log.METRICS_FILE))]
  assert losses(workdir_a) == losses(tmp_path / "b") and len(losses(workdir_a)) == 8
  sa, a, da = _state_arrays(workdir_a, config, data)
  sb, b, db = _state_arrays(str(tmp_path / "b"), config, data)
  assert sa == sb == 8 and da == db
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_sharded_step_matches_single_device(data_dirs):
  config = small_config(data_dirs, **{"data.batch_size": 8})
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  data = make_data(config.data)
  sharded = train_loop.build(config, data=data)
  single_cfg = small_config(data_dirs, **{"data.batch_size": 8})
  single_cfg.mesh.data, single_cfg.mesh.fsdp, single_cfg.mesh.tensor = 1, 1, 1
  single = train_loop.build(single_cfg, data=data, devices=jax.devices()[:1])
  batches = [next(it) for it in [data.train_iterator()] for _ in range(3)]
  results = []
  for run in (single, sharded):
    with train_loop.sharding.activation_sharding(run.mesh):
      state = run.init_state(jax.random.key(0))
      losses, grad_norms, params = [], [], [jax.tree.map(np.asarray, state.params)]
      for batch in batches:
        state, metrics = run.train_step(state, train_loop.device_batch(run, batch))
        losses.append(float(metrics["loss"]))
        grad_norms.append(float(metrics["grad_norm"]))
        params.append(jax.tree.map(np.asarray, state.params))
    results.append((losses, grad_norms, params, state))
  (l1, g1, p1, _), (l2, g2, p2, s2) = results
  # Step k's loss is taken at the params after step k - 1 (the same init for k = 1).
  # Its two values differ by (a) float32 rounding: the sharded sums reorder the
  # forward's chain of sums, which moves the logits z by <= forward_atol and the mean
  # cross entropy by <= 2 max|dz| (log-sum-exp and z_target move by <= max|dz| each),
  # plus the sums over the vocabulary and the tokens; and (b) the params' difference
  # (a reordered float32 sum can flip an int8 rounding, which Adam passes on): first
  # order, |dL| <= |grad L| |d params| (Cauchy-Schwarz), with the larger grad norm.
  apply = jax.jit(single.model.apply)
  tokens = batches[0]["inputs"].size
  forward_ulps = chain_ulps(transformer_reductions(config.model, config.data.seq_len))
  for k, batch in enumerate(batches):
    logits = apply({"params": p1[k]}, batch["inputs"])
    rounding = (2 * f32_atol(logits, forward_ulps)
                + f32_atol(l1[k], chain_ulps([config.model.vocab_size, tokens])))
    params_diff = np.sqrt(sum(np.sum((a.astype(np.float64) - b) ** 2)
                              for a, b in zip(jax.tree.leaves(p1[k]), jax.tree.leaves(p2[k]))))
    assert abs(l1[k] - l2[k]) <= rounding + max(g1[k], g2[k]) * params_diff, (k, l1, l2)
  # Adam moves an entry by <= lr_t a step (Kingma and Ba 2015, sec. 2.1: 1 - b1 <=
  # sqrt(1 - b2)), so two runs part by <= 2 sum_t lr_t. They only part where an update
  # really differs (an int8 rounding flipped by a reordered sum, or the sign of a ~0
  # gradient): < 1% of the entries move apart by more than lr / 30.
  assert 1 - config.optimizer.b1 <= np.sqrt(1 - config.optimizer.b2)
  schedule = optim.learning_rate_schedule(config.optimizer, config.train.steps)
  max_apart = 2 * sum(float(schedule(t)) for t in range(len(batches)))
  lr = config.optimizer.learning_rate
  for a, b in zip(jax.tree_util.tree_leaves(p1[-1]), jax.tree_util.tree_leaves(p2[-1])):
    diff = np.abs(a - b)
    assert diff.max() <= max_apart and np.mean(diff > lr / 30) < 0.01, (
        diff.max(), np.mean(diff > lr / 30))
  q = s2.params["layers"]["attn"]["q"]["kernel"]
  assert not q.sharding.is_fully_replicated and q.sharding.mesh.shape["tensor"] == 2


@pytest.mark.parametrize("group,field,value,match", [
    ("train", "steps", 0, "config.train.steps"),
    ("optimizer", "nonfinite", "ignore", "config.optimizer.nonfinite"),
    ("gnmr", "max_o", -1, "config.gnmr.max_o"),
    ("gnmr", "alpha", 0.0, "config.gnmr.alpha"),
    ("logging", "log_every", 0, "config.logging.log_every"),
    ("mesh", "tensor", 3, "mesh"),
])
def test_invalid_config_fields_are_named(group, field, value, match):
  config = tiny.get_config("runlocal")
  config[group][field] = value
  with pytest.raises(ValueError, match=match):
    config_lib.validate_config(config, device_count=8)


def test_config_structure_errors():
  config = tiny.get_config()
  config.gnmr.enabled = False
  with pytest.raises(ValueError, match="gnmr.enabled"):
    config_lib.validate_config(config, device_count=1)
  config = tiny.get_config()
  config.unknown_group = {"a": 1}
  with pytest.raises(ValueError, match="unknown groups"):
    config_lib.validate_config(config, device_count=1)
  config = tiny.get_config()
  config.train.stpes = 3
  with pytest.raises(ValueError, match="stpes"):
    config_lib.validate_config(config, device_count=1)


def test_model_that_does_not_divide_over_the_mesh_is_refused(data_dirs):
  config = small_config(data_dirs)
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 8
  with pytest.raises(ValueError, match="num_heads"):
    train_loop.build(config, data=make_data(config.data))


@pytest.mark.parametrize("axis_types, mesh, perturbation, routed", [
    ("auto", (1, 1, 1), 0.0, False),          # one device, static
    ("auto", (1, 1, 1), 1e-7, True),          # the noise floor's perturbed init, routed
    ("explicit", (2, 2, 2), 0.0, True),       # data x fsdp x tensor, explicit axes
])
def test_run_abstract_state_is_the_init_states_shapes_with_the_state_shardings(
    axis_types, mesh, perturbation, routed):
  # build() takes the params' shapes and shardings from one abstract init of the model: they
  # must be what the jitted init_state makes, leaf for leaf, and carry run.state_shardings.
  import types  # pylint: disable=g-import-not-at-top
  config = tiny.get_config("runlocal")
  config.mesh.axis_types = axis_types
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
  config.data.batch_size = 8
  config.train.init_perturbation = perturbation
  config.precision.mode = "gnmr" if routed else "static"
  run = train_loop.build(config, data=types.SimpleNamespace(vocab_size=256),
                         devices=jax.devices()[:int(np.prod(mesh))])
  with train_loop.sharding.activation_sharding(run.mesh):
    traced = jax.eval_shape(run.init_state, jax.random.key(0))
  want, structure = jax.tree_util.tree_flatten(traced)
  got, got_structure = jax.tree_util.tree_flatten(run.abstract_state)
  assert got_structure == structure
  assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]
  shardings = jax.tree_util.tree_leaves(run.state_shardings)
  assert [g.sharding for g in got] == shardings and len(shardings) == len(got)
