"""Preemption: SIGTERM saves a checkpoint and exits 0; SIGKILL at a random step, then a restart in
the same workdir, ends bit for bit where an uninterrupted train.py run does (params, optimizer
and GNMR state, data position, every logged loss, the eval loss)."""
import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from gnmr_jax import checkpointing, metrics_log, train_loop
from gnmr_jax.data import make_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "configs"))
import tiny  # noqa: E402  pylint: disable=g-import-not-at-top

# SIGTERM, SIGKILL, restart and exact resume: plumbing, run without XLA optimizations, train.py
# included (conftest.py).
pytestmark = pytest.mark.plumbing

STEPS = 120  # long enough (a few seconds) to be interrupted mid-run
FLAGS = (f"--config.train.steps={STEPS}", "--config.train.eval_every=0",
         "--config.checkpoint.every_steps=10", "--config.logging.log_every=1",
         "--config.logging.unit_log_every=0", "--config.logging.plots=False",
         "--config.logging.tensorboard=False")


def start_train_py(workdir, data_dirs):
  cmd = [sys.executable, os.path.join(REPO, "train.py"), "--config",
         os.path.join(REPO, "configs/tiny.py") + ":runlocal", f"--workdir={workdir}",
         f"--config.data.data_dir={data_dirs[0]}", f"--config.data.sdist_path={data_dirs[1]}",
         *FLAGS]
  env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=REPO)


def logged_steps(workdir):
  path = os.path.join(workdir, metrics_log.METRICS_FILE)
  if not os.path.exists(path):
    return 0
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  return len(lines)


def interrupt_at(proc, workdir, lines, sig):
  """Sends `sig` once the run has logged `lines` metrics lines (steps are logged one late)."""
  deadline = time.time() + 300
  while logged_steps(workdir) < lines:
    assert proc.poll() is None, f"run ended before step {lines}: {proc.communicate()[1][-2000:]}"
    assert time.time() < deadline
    time.sleep(0.01)
  proc.send_signal(sig)
  out, err = proc.communicate(timeout=300)
  return proc.returncode, out, err


def final_state(workdir, data_dirs):
  config = tiny.get_config("runlocal")
  config.data.data_dir, config.data.sdist_path = data_dirs
  config.train.steps = STEPS
  config.mesh.fsdp, config.mesh.data = 1, -1
  data = make_data(config.data)
  run = train_loop.build(config, data=data, devices=jax.devices()[:1])
  ckpt = checkpointing.Checkpointer(workdir, 2)
  abstract = run.abstract_state
  step, state, data_state = ckpt.restore(
      checkpointing.abstract_like(abstract, run.state_shardings),
      checkpointing.config_fingerprint(run.config, data.vocab_size))
  ckpt.close()
  return step, jax.tree.map(np.asarray, state), data_state


def test_sigterm_then_sigkill_then_restart_matches_uninterrupted_run(tmp_path, data_dirs,
                                                                    record_property):
  reference = str(tmp_path / "reference")
  proc = start_train_py(reference, data_dirs)
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]

  workdir = str(tmp_path / "interrupted")
  # SIGTERM: the step in flight finishes, a checkpoint is saved, train.py exits 0.
  rc, out, err = interrupt_at(start_train_py(workdir, data_dirs), workdir, 5, signal.SIGTERM)
  assert rc == 0, err[-3000:]
  assert "(preempted: checkpoint saved)" in out
  summary = json.load(open(os.path.join(workdir, metrics_log.SUMMARY_FILE)))
  term_step = summary["step"]
  assert summary["preempted"] and 5 <= term_step < STEPS
  assert checkpointing.Checkpointer(workdir, 2).latest_step() == term_step

  # SIGKILL at a random later step: no handler runs, the run loses what followed its last
  # periodic checkpoint, possibly mid-save or mid-line in metrics.jsonl.
  kill_lines = random.Random(6).randint(term_step + 15, STEPS - 30)
  proc = start_train_py(workdir, data_dirs)
  rc, _, _ = interrupt_at(proc, workdir, kill_lines, signal.SIGKILL)
  assert rc == -signal.SIGKILL
  killed_at = logged_steps(workdir)
  assert killed_at < STEPS

  proc = start_train_py(workdir, data_dirs)
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  summary = json.load(open(os.path.join(workdir, metrics_log.SUMMARY_FILE)))
  assert summary["step"] == STEPS and not summary["preempted"]
  assert term_step < summary["resumed_from_step"] <= killed_at
  assert summary["resumed_from_step"] % 10 == 0  # the last periodic checkpoint before the kill
  ref_summary = json.load(open(os.path.join(reference, metrics_log.SUMMARY_FILE)))
  assert summary["eval_loss"] == ref_summary["eval_loss"]

  # The logs read as one run: one row per step, every loss equal to the uninterrupted run's
  # (exactly: resuming restores state and data position bit for bit, then runs the same
  # compiled step).
  losses = lambda w: [(r["step"], r["loss"]) for r in metrics_log.read_jsonl(
      os.path.join(w, metrics_log.METRICS_FILE))]
  with open(os.path.join(workdir, metrics_log.METRICS_FILE)) as f:
    assert len(f.read().splitlines()) == STEPS
  assert losses(workdir) == losses(reference) and len(losses(reference)) == STEPS
  sa, a, da = final_state(reference, data_dirs)
  sb, b, db = final_state(workdir, data_dirs)
  assert sa == sb == STEPS and da == db
  jax.tree.map(np.testing.assert_array_equal, a, b)
  record_property("faults_injected", 2)  # SIGTERM, SIGKILL
  record_property("faults_detected", 2)
  record_property("runs_resumed", 2)
  record_property("sigterm_step", term_step)
  record_property("sigkill_resumed_from", summary["resumed_from_step"])
