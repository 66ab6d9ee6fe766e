"""Orbax checkpoints of the whole run: train state (params, optimizer + GNMR state, RNG), the data
iterator position, and a config fingerprint that refuses a workdir from another config.

Integrity: each checkpoint's meta holds the shape and dtype of every state leaf and a checksum
of its bits (a wrapping uint32 sum, computed on device). Restoring refuses a checkpoint whose
leaves do not match the model being built (naming the leaves), and treats one that cannot be
read or whose bits do not match their checksum as corrupted: it is reported, moved to
<workdir>/checkpoints_corrupted/ and the next older one is tried.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from gnmr_jax.control.units import path_to_str

CORRUPTED_DIR = "checkpoints_corrupted"

FINGERPRINT_FIELDS = {
    "model": None,  # the whole model group
    "data": ("dataset", "tokenizer", "vocab_size", "seq_len", "batch_size", "seed"),
    "gnmr": ("enabled", "units", "layer_axis", "delta", "priority"),  # priority: state type
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


def leaf_specs(tree) -> dict:
  """{'/'-joined leaf path: 'dtype[shape]'} of a state (arrays or ShapeDtypeStructs)."""
  return {path_to_str(p): f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _per_unit_trees(leaves: dict) -> bool:
  """Whether a state's leaves hold the controller's per-unit fields as params-shaped trees
  (gnmr_jax before 2026-12-02) rather than one array per field (key path '.../window/values')."""
  return (any("/window/" in k for k in leaves)
          and not any(k.endswith("/window/values") for k in leaves))


def check_state_layout(saved: dict, current: dict, workdir: str, step: int) -> None:
  """Raises ValueError if the checkpoint holds the controller's per-unit fields as params-shaped
  trees (gnmr_jax before 2026-12-02), which this version does not convert. Checked before the
  config fingerprint: resuming with the old run's config would not help."""
  if _per_unit_trees(saved) and not _per_unit_trees(current):
    raise ValueError(
        f"workdir {workdir} holds a checkpoint (step {step}) written by an older gnmr_jax "
        f"that kept the controller's per-unit statistics as params-shaped trees; this version "
        f"keeps one array per field (UnitValues) and does not convert them. Resume it with the "
        f"gnmr_jax that wrote it, or start a new run in another --workdir.")


def check_leaf_specs(saved: dict, current: dict, workdir: str, step: int) -> None:
  """Raises ValueError naming every leaf whose shape/dtype (or presence) differs."""
  check_state_layout(saved, current, workdir, step)
  diffs = [f"{k}: checkpoint has {saved.get(k, 'no such leaf')}, model has "
           f"{current.get(k, 'no such leaf')}"
           for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
  if diffs:
    shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
    raise ValueError(f"workdir {workdir} holds a checkpoint (step {step}) of another model or "
                     f"optimizer shape; use another --workdir or the same config. "
                     f"Mismatched leaves: {shown}")


def _leaf_bits_sum(x):
  x = jnp.asarray(x)
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  elif jnp.dtype(x.dtype).itemsize == 4:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  elif jnp.dtype(x.dtype).itemsize == 2:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
  elif jnp.dtype(x.dtype).itemsize == 1:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
  else:  # 8-byte leaves (x64 runs): fold the two halves
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  # Weighting by position catches swapped elements; uint32 arithmetic wraps, so the sum is
  # exact in any order (any sharding, any number of processes).
  weights = (jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + 1).reshape(
      bits.shape) if bits.ndim else jnp.uint32(1)
  return jnp.sum(bits * weights, dtype=jnp.uint32)


_checksum = jax.jit(lambda tree: jnp.stack(
    [_leaf_bits_sum(x) for x in jax.tree_util.tree_leaves(tree)] or [jnp.uint32(0)]))


def state_checksum(state) -> list:
  """Per-leaf uint32 checksums of a state's bits (as Python ints), computed on device."""
  return [int(v) for v in np.asarray(jax.device_get(_checksum(state)))]


class Checkpointer:
  """Saves and restores {state, data iterator, fingerprint} under <workdir>/checkpoints."""

  def __init__(self, workdir: str, max_to_keep: int):
    self.workdir = workdir
    self.corrupted = []
    self.manager = ocp.CheckpointManager(
        f"{workdir}/checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_names=("state", "data", "meta"))

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, data_state: dict, meta: dict, force: bool = False):
    meta = dict(meta, leaves=leaf_specs(state), checksum=state_checksum(state))
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta)), force=force)

  def restore(self, abstract_state: Any, fingerprint: dict):
    """Restores the newest intact checkpoint.

    A checkpoint that cannot be read, or whose restored bits do not match the checksum saved
    with it, is reported (logging.warning and `self.corrupted`), moved to
    <workdir>/checkpoints_corrupted/ and the next older one is tried.

    Returns:
      (step, state, data_state) or None when the workdir has no checkpoint.

    Raises:
      ValueError: the checkpoint comes from a different config or model/optimizer shape (names
        the fields or leaves), or no checkpoint in the workdir is intact.
    """
    self.corrupted = []  # [(step, reason)] found by this call
    steps = sorted(self.manager.all_steps(), reverse=True)
    expected = leaf_specs(abstract_state)
    for step in steps:
      try:
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        meta = dict(meta["meta"])
        saved_fingerprint = dict(meta["fingerprint"])
      except Exception as e:  # pylint: disable=broad-except
        self._corrupted(step, f"its meta is unreadable ({type(e).__name__}: {e})")
        continue
      if "leaves" in meta:
        check_state_layout(dict(meta["leaves"]), expected, self.workdir, step)
      check_fingerprint(saved_fingerprint, fingerprint, self.workdir)
      if "leaves" in meta:
        check_leaf_specs(dict(meta["leaves"]), expected, self.workdir, step)
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except
        self._corrupted(step, f"it failed to restore ({type(e).__name__}: {e})")
        continue
      if "checksum" in meta:
        actual = state_checksum(restored["state"])
        bad = [name for name, a, b in zip(expected, actual, meta["checksum"]) if a != b]
        if bad or len(actual) != len(meta["checksum"]):
          self._corrupted(step, f"the bits of {len(bad)} leaves do not match their checksum "
                                f"(e.g. {bad[:3]})")
          continue
      return step, restored["state"], dict(restored["data"])
    if steps:
      raise ValueError(f"no intact checkpoint in {self.workdir}/checkpoints (tried steps "
                       f"{steps}: {self.corrupted}); remove it or use another --workdir.")
    return None

  def _corrupted(self, step: int, reason: str):
    """Reports a corrupted checkpoint and moves it aside so the run can save that step again."""
    self.corrupted.append((step, reason))
    moved = os.path.join(self.workdir, CORRUPTED_DIR, f"{step}-{int(time.time())}")
    logging.warning("checkpoint at step %d in %s is corrupted: %s; moved to %s, falling back to "
                    "an older one.", step, self.workdir, reason, moved)
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(moved), exist_ok=True)
      shutil.move(os.path.join(self.workdir, "checkpoints", str(step)), moved)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      multihost_utils.sync_global_devices(f"gnmr_jax_quarantine_{step}")
    self.manager.reload()

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
