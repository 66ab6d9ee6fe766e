"""Orbax checkpoints of the whole run: train state (params, optimizer + GNMR state, RNG), the data
iterator position, and a config fingerprint that refuses a workdir from another config."""

from __future__ import annotations

import logging
from typing import Any, Optional

import jax
import ml_collections
import orbax.checkpoint as ocp

FINGERPRINT_FIELDS = {
    "model": None,  # the whole model group
    "data": ("dataset", "tokenizer", "vocab_size", "seq_len", "batch_size", "seed"),
    "gnmr": ("enabled", "units", "layer_axis", "delta"),
    "optimizer": ("nonfinite",),
}


def config_fingerprint(config: ml_collections.ConfigDict, vocab_size: int) -> dict:
  """The config fields that must match for a checkpoint to be resumable (flat dict)."""
  out = {"vocab_size_used": int(vocab_size), "grad_clip_enabled": config.optimizer.grad_clip > 0}
  for group, fields in FINGERPRINT_FIELDS.items():
    cfg = config[group]
    for field in (fields or sorted(cfg.keys())):
      value = cfg[field]
      out[f"{group}.{field}"] = value if isinstance(value, (bool, int, float, str)) else str(value)
  return out


def check_fingerprint(saved: dict, current: dict, workdir: str) -> None:
  diffs = [f"{k}: checkpoint has {saved.get(k)!r}, config has {current.get(k)!r}"
           for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
  if diffs:
    raise ValueError(f"workdir {workdir} holds a checkpoint from a different config; "
                     f"use another --workdir or the same config. Mismatches: " + "; ".join(diffs))


class Checkpointer:
  """Saves and restores {state, data iterator, fingerprint} under <workdir>/checkpoints."""

  def __init__(self, workdir: str, max_to_keep: int):
    self.workdir = workdir
    self.manager = ocp.CheckpointManager(
        f"{workdir}/checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_names=("state", "data", "meta"))

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_state: dict, meta: dict, force: bool = False):
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta)), force=force)

  def restore(self, abstract_state: Any, fingerprint: dict):
    """Restores the newest readable checkpoint.

    Returns:
      (step, state, data_state) or None when the workdir has no checkpoint.

    Raises:
      ValueError: the checkpoint comes from a different config (names the fields).
    """
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      try:
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("checkpoint at step %d is unreadable (%s); trying an older one.", step, e)
        continue
      check_fingerprint(dict(meta["meta"]["fingerprint"]), fingerprint, self.workdir)
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except
        logging.warning("checkpoint at step %d failed to restore (%s); trying an older one.",
                        step, e)
        continue
      return step, restored["state"], dict(restored["data"])
    if steps:
      raise ValueError(f"no readable checkpoint in {self.workdir}/checkpoints "
                       f"(tried steps {steps}); remove it or use another --workdir.")
    return None

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(tree, shardings=None):
  """ShapeDtypeStructs (with shardings when given) to restore into."""
  if shardings is None:
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)
