"""Checkpoint faults: a truncated or corrupted latest checkpoint is detected, reported and skipped
for the previous good one (and the run then ends exactly where an unbroken one does); a
checkpoint of another config or model/optimizer shape is refused naming the mismatch."""
import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest

from gnmr_jax import checkpointing, train_loop
from gnmr_jax.control import from_config
from tests.train_helpers import tiny_run_config

# Resume, refusal and fault detection: plumbing, run without XLA optimizations (conftest.py), as
# the shared run they resume was.
pytestmark = pytest.mark.plumbing


@pytest.fixture(scope="module")
def trained(tiny_run):
  """The shared 8-step run (conftest.tiny_run: checkpoints at 4, 6, 8) and its final state."""
  config, data, workdir, summary = tiny_run
  step, state, _ = restore(workdir, config, data)
  return config, data, workdir, step, state, summary


def restore(workdir, config, data, make_tx=None, fingerprint_config=None):
  run = train_loop.build(config, data=data, devices=jax.devices()[:1], make_tx=make_tx)
  ckpt = checkpointing.Checkpointer(workdir, 3)
  abstract = run.abstract_state
  try:
    out = ckpt.restore(checkpointing.abstract_like(abstract, run.state_shardings),
                       checkpointing.config_fingerprint(fingerprint_config or run.config,
                                                        data.vocab_size))
    if out is None:
      return None
    step, state, data_state = out
    return step, jax.tree.map(np.asarray, state), (data_state, ckpt.corrupted)
  finally:
    ckpt.close()


def largest_state_file(workdir, step):
  files = []
  for root, _, names in os.walk(os.path.join(workdir, "checkpoints", str(step), "state")):
    files += [os.path.join(root, n) for n in names]
  return max(files, key=os.path.getsize)


def copy_run(trained, tmp_path, name):
  dst = str(tmp_path / name)
  shutil.copytree(trained[2], dst)
  return dst


def test_truncated_latest_checkpoint_falls_back_and_resumes_exactly(trained, tmp_path, caplog,
                                                                    record_property):
  config, data, _, _, final_state, first = trained
  workdir = copy_run(trained, tmp_path, "truncated")
  path = largest_state_file(workdir, 8)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  with caplog.at_level("WARNING"):
    summary = train_loop.train_and_evaluate(config, workdir, data=data,
                                            devices=jax.devices()[:1])
  # Detected and reported (log, summary), moved aside, and the run went on from step 6.
  assert summary["resumed_from_step"] == 6 and summary["step"] == 8
  assert [s for s, _ in summary["corrupted_checkpoints"]] == [8]
  assert "step 8" in caplog.text and "corrupted" in caplog.text
  assert os.listdir(os.path.join(workdir, checkpointing.CORRUPTED_DIR))[0].startswith("8-")
  assert "corrupted checkpoint      step 8 skipped" in train_loop.format_summary(summary)
  # Redoing steps 7 and 8 from step 6 gives the unbroken run's final state and eval loss,
  # exactly: the step-6 checkpoint restores state and data position bit for bit and the
  # same compiled steps run on them.
  step, state, _ = restore(workdir, config, data)
  assert step == 8 and summary["eval_loss"] == first["eval_loss"]
  jax.tree.map(np.testing.assert_array_equal, state, final_state)
  record_property("faults_injected", 1)
  record_property("faults_detected", len(summary["corrupted_checkpoints"]))
  record_property("runs_resumed", 1)


def test_flipped_bytes_and_bad_checksums_are_detected(trained, tmp_path, record_property):
  config, data, _, _, _, _ = trained
  flipped = copy_run(trained, tmp_path, "flipped")
  path = largest_state_file(flipped, 8)
  raw = bytearray(open(path, "rb").read())
  middle = len(raw) // 2
  raw[middle:middle + 64] = bytes(b ^ 0x5A for b in raw[middle:middle + 64])
  open(path, "wb").write(bytes(raw))
  step, _, (_, corrupted) = restore(flipped, config, data)
  assert step == 6 and [s for s, _ in corrupted] == [8]
  # The bits restored fine but do not match what was saved: only the checksum can tell.
  tampered = copy_run(trained, tmp_path, "tampered")
  meta_path = os.path.join(tampered, "checkpoints", "8", "meta", "metadata")
  meta = json.load(open(meta_path))
  meta["checksum"][3] = (meta["checksum"][3] + 1) % 2**32
  json.dump(meta, open(meta_path, "w"))
  step, _, (_, corrupted) = restore(tampered, config, data)
  assert step == 6 and "do not match their checksum" in corrupted[0][1]
  # Every checkpoint broken: a clear error, not a silent fresh start.
  for s in (4, 6):
    open(os.path.join(tampered, "checkpoints", str(s), "meta", "metadata"), "w").write("{")
  with pytest.raises(ValueError, match="no intact checkpoint"):
    restore(tampered, config, data)
  record_property("faults_injected", 3)  # flipped bytes, a bad checksum, all meta broken
  record_property("faults_detected", 3)


def test_checkpoint_of_another_config_or_shape_is_refused(trained, tmp_path, record_property):
  config, data, workdir, _, _, _ = trained
  other = tiny_run_config(config.data, **{"model.num_layers": 3})
  with pytest.raises(ValueError, match=r"model.num_layers: checkpoint has 2, config has 3"):
    restore(workdir, config, data, fingerprint_config=other)
  # Same config fields, but an optimizer whose state has another structure (e.g. a baseline
  # transform from experiments/): refused naming the leaves, not read as garbage.
  sgd = lambda c: optax.chain(from_config(c.gnmr), optax.sgd(0.1, momentum=0.9))
  with pytest.raises(ValueError, match=r"another model or optimizer shape.*Mismatched leaves: "
                                       r"opt_state/.*no such leaf"):
    restore(workdir, config, data, make_tx=sgd)
  # A leaf with another shape is named with both shapes.
  saved = {"params/embed": "float32[320, 64]"}
  with pytest.raises(ValueError, match=r"params/embed: checkpoint has float32\[320, 64\], "
                                       r"model has float32\[256, 64\]"):
    checkpointing.check_leaf_specs(saved, {"params/embed": "float32[256, 64]"}, "w", 6)
  # A checkpoint of gnmr_jax before the flat controller state (per-unit fields saved as
  # params-shaped trees: '.../window/layers/attn/q/kernel' instead of '.../window/values').
  with open(os.path.join(workdir, "checkpoints", "8", "meta", "metadata"), encoding="utf-8") as f:
    current = json.load(f)["leaves"]
  assert sum(k.endswith("/window/values") for k in current) == 1, sorted(current)
  old = {k.replace("/values", "/layers/attn/q/kernel"): v for k, v in current.items()}
  with pytest.raises(ValueError, match=r"older gnmr_jax that kept the controller's per-unit "
                                       r"statistics as params-shaped trees"):
    checkpointing.check_leaf_specs(old, current, "w", 8)
  # Such a run restored with another config (the old default priority 'norm'): the layout is
  # named first, since resuming with the old config would not get past it.
  older = copy_run(trained, tmp_path, "older")
  meta_path = os.path.join(older, "checkpoints", "8", "meta", "metadata")
  meta = json.load(open(meta_path))
  meta["leaves"] = old
  json.dump(meta, open(meta_path, "w"))
  with pytest.raises(ValueError, match=r"per-unit statistics as params-shaped trees"):
    restore(older, config, data, fingerprint_config=tiny_run_config(
        config.data, **{"gnmr.priority": "norm"}))
  record_property("bad_inputs_tried", 5)
  record_property("bad_inputs_refused", 5)
