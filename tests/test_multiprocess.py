"""Two processes on one machine (jax.distributed on localhost, gloo CPU collectives, one device
each) train the tiny config through train.py and reach the same losses, eval loss and
checkpointed state as one process with two devices."""
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from gnmr_jax import checkpointing, metrics_log, train_loop
from gnmr_jax.data import make_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "configs"))
import tiny  # noqa: E402  pylint: disable=g-import-not-at-top

# Two processes against one: plumbing (the same numbers exactly, in one setting), run without XLA
# optimizations, train.py included (conftest.py).
pytestmark = pytest.mark.plumbing

STEPS = 6


def config_for(data_dirs):
  config = tiny.get_config("runlocal")
  config.data.data_dir, config.data.sdist_path = data_dirs
  config.train.steps = STEPS
  config.train.eval_every = 0
  config.checkpoint.every_steps = 4
  config.logging.log_every = 1
  config.logging.plots = False
  config.logging.tensorboard = False
  config.mesh.fsdp, config.mesh.data = 1, -1
  return config


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_one_process_with_two_devices(tmp_path, data_dirs, record_property):
  config = config_for(data_dirs)
  data = make_data(config.data)
  # Prepare the data once before the two processes read it concurrently.
  workdir = str(tmp_path / "two_processes")
  port = free_port()
  flags = [f"--config.train.steps={STEPS}", "--config.train.eval_every=0",
           "--config.checkpoint.every_steps=4", "--config.logging.log_every=1",
           "--config.logging.plots=False", "--config.logging.tensorboard=False",
           "--config.mesh.fsdp=1", "--config.mesh.data=-1",
           f"--config.data.data_dir={data_dirs[0]}", f"--config.data.sdist_path={data_dirs[1]}"]
  procs = []
  for i in range(2):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": str(i)}
    procs.append(subprocess.Popen(
        [sys.executable, os.path.join(REPO, "train.py"), "--config",
         os.path.join(REPO, "configs/tiny.py") + ":runlocal", f"--workdir={workdir}", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO))
  try:
    outs = [p.communicate(timeout=500) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
    assert f"steps                     {STEPS}" in out

  reference = str(tmp_path / "one_process")
  ref_summary = train_loop.train_and_evaluate(config, reference, data=data,
                                              devices=jax.devices()[:2])
  summary = json.load(open(os.path.join(workdir, metrics_log.SUMMARY_FILE)))
  losses = lambda w: [r["loss"] for r in metrics_log.read_jsonl(
      os.path.join(w, metrics_log.METRICS_FILE))]
  assert len(losses(workdir)) == STEPS
  # Same global batch, split by process instead of by device: the same numbers exactly
  # (each device runs the same program on the same shard, and a 2-way all-reduce adds
  # two numbers, which does not depend on their order).
  assert losses(workdir) == losses(reference)
  assert summary["eval_loss"] == ref_summary["eval_loss"]
  # Both processes saved one checkpoint together (orbax coordinates them); it restores here.
  states = []
  for w in (workdir, reference):
    run = train_loop.build(config, data=data, devices=jax.devices()[:1])
    ckpt = checkpointing.Checkpointer(w, 2)
    assert sorted(ckpt.manager.all_steps()) == [4, STEPS]
    abstract = run.abstract_state
    step, state, _ = ckpt.restore(checkpointing.abstract_like(abstract, run.state_shardings),
                                  checkpointing.config_fingerprint(run.config, data.vocab_size))
    ckpt.close()
    states.append(jax.tree.map(np.asarray, state))
  jax.tree.map(np.testing.assert_array_equal, *states)
  record_property("processes", 2)
