"""Fault injection for reliability tests: gradient spikes, NaN/Inf gradients, a corrupted
low-cost path and NaN losses, at chosen steps and units, inside the jitted train step.

Off by default (``config.faults.enabled = False`` emits no code). A schedule is a
';'-separated list of faults ``STEP:UNIT:KIND[:FACTOR[:DURATION]]``:

  STEP      first train step hit (1-based, the step number logged in metrics.jsonl)
  UNIT      a unit index (0 .. num_units - 1, in the order of unit_names.json) or a regex
            searched in the unit names (e.g. ``mlp/up/kernel\\[1\\]``); ``*`` = every unit;
            ignored by ``nan_loss`` (write ``-``)
  KIND      ``scale``           multiply the unit's gradient by FACTOR
            ``nan`` / ``inf``   set every element of the unit's gradient to NaN / +Inf
            ``corrupt_output``  multiply the unit's low-cost path output by FACTOR while the
                                unit is not on the recovery path (a transient instability
                                that recovery cures); forward and backward both see it
            ``nan_loss``        make the loss (and so every gradient) NaN
  FACTOR    for ``scale`` / ``corrupt_output`` (finite, > 0); default 10
  DURATION  number of consecutive steps hit; default 1

Example: ``'30:3:scale:10;40:mlp/up/kernel\\[1\\]:nan;50:-:nan_loss::2'``.

Faults are selected with ``jnp.where`` on the traced step counter: one program for the whole
run, no retrace and no host sync. ``corrupt_output`` scales the kernel the model sees for that
unit; for a linear projection ``x @ (f W) = f (x @ W)``, i.e. the path's output scaled by f,
and the gradient reaching W is scaled by f too (chain rule), exactly as a faulty kernel would.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from gnmr_jax.control import units as units_lib

KINDS = ("scale", "nan", "inf", "corrupt_output", "nan_loss")
GRADIENT_KINDS = ("scale", "nan", "inf")
DEFAULT_FACTOR = 10.0


def default_faults_config() -> ml_collections.ConfigDict:
  """The `faults` config group (off)."""
  c = ml_collections.ConfigDict()
  # Inject the faults of `schedule` into the train step (reliability tests only).
  c.enabled = False
  # ';'-separated 'STEP:UNIT:KIND[:FACTOR[:DURATION]]' (see gnmr_jax/faults.py), e.g.
  # '30:3:scale:10;40:mlp/up/kernel\[1\]:nan'.
  c.schedule = ""
  return c


@dataclasses.dataclass(frozen=True)
class FaultSpec:
  """One parsed fault, before its unit selector is resolved against the model's units."""
  step: int
  unit: str
  kind: str
  factor: float
  duration: int


@dataclasses.dataclass(frozen=True)
class Fault:
  """One fault with its units resolved (indices into the flat unit vector)."""
  step: int
  units: tuple
  kind: str
  factor: float
  duration: int

  def active_at(self, step: int) -> bool:
    return self.step <= step < self.step + self.duration


def _err(msg: str) -> ValueError:
  return ValueError(f"config.faults.schedule: {msg}; the format is "
                    f"'STEP:UNIT:KIND[:FACTOR[:DURATION]]' separated by ';', KIND one of "
                    f"{list(KINDS)}.")


def parse_schedule(schedule: str) -> list[FaultSpec]:
  """Parses a schedule string (syntax only). Raises ValueError naming config.faults.schedule."""
  if not isinstance(schedule, str):
    raise _err(f"must be a string, got {schedule!r}")
  specs = []
  for item in filter(None, (s.strip() for s in schedule.split(";"))):
    parts = item.split(":")
    if not 3 <= len(parts) <= 5:
      raise _err(f"{item!r} has {len(parts)} ':'-separated fields, not 3 to 5")
    step_s, unit, kind = parts[0].strip(), parts[1].strip(), parts[2].strip()
    factor_s = parts[3].strip() if len(parts) > 3 else ""
    duration_s = parts[4].strip() if len(parts) > 4 else ""
    if not step_s.isdigit() or int(step_s) < 1:
      raise _err(f"STEP of {item!r} must be an integer >= 1, got {step_s!r}")
    if kind not in KINDS:
      raise _err(f"KIND of {item!r} must be one of {list(KINDS)}, got {kind!r}")
    try:
      factor = float(factor_s) if factor_s else DEFAULT_FACTOR
    except ValueError:
      raise _err(f"FACTOR of {item!r} must be a number, got {factor_s!r}") from None
    if not (math.isfinite(factor) and factor > 0):
      raise _err(f"FACTOR of {item!r} must be finite and > 0, got {factor_s!r}")
    if duration_s and (not duration_s.isdigit() or int(duration_s) < 1):
      raise _err(f"DURATION of {item!r} must be an integer >= 1, got {duration_s!r}")
    if kind != "nan_loss":
      if not unit:
        raise _err(f"UNIT of {item!r} is empty")
      if unit != "*" and not unit.isdigit():
        try:
          re.compile(unit)
        except re.error as e:
          raise _err(f"UNIT of {item!r} is not an index or a valid regex ({e})") from None
    specs.append(FaultSpec(int(step_s), unit, kind, factor, int(duration_s or 1)))
  return specs


def validate_faults_config(c: ml_collections.ConfigDict) -> None:
  """Checks config.faults (fields, types, schedule syntax); raises ValueError naming the field."""
  extra = sorted(set(c.keys()) - {"enabled", "schedule"})
  if extra:
    raise ValueError(f"config.faults has unknown fields {extra}; valid fields: "
                     f"['enabled', 'schedule'].")
  if not isinstance(c.enabled, bool):
    raise ValueError(f"config.faults.enabled must be True or False, got {c.enabled!r}.")
  parse_schedule(c.schedule)


def resolve(specs: Sequence[FaultSpec], unit_names: Sequence[str]) -> list[Fault]:
  """Resolves each fault's UNIT against the model's unit names. Raises ValueError."""
  faults = []
  for spec in specs:
    if spec.kind == "nan_loss":
      units = ()
    elif spec.unit == "*":
      units = tuple(range(len(unit_names)))
    elif spec.unit.isdigit():
      if int(spec.unit) >= len(unit_names):
        raise _err(f"unit index {spec.unit} is out of range: the model has "
                   f"{len(unit_names)} units (0 .. {len(unit_names) - 1})")
      units = (int(spec.unit),)
    else:
      pattern = re.compile(spec.unit)
      units = tuple(i for i, n in enumerate(unit_names) if pattern.search(n))
      if not units:
        raise _err(f"unit regex {spec.unit!r} matches no unit; units are e.g. "
                   f"{list(unit_names[:3])}")
    if spec.kind != "nan_loss" and not units:
      raise _err(f"the model has no recoverable units to inject {spec.kind!r} into")
    faults.append(Fault(spec.step, units, spec.kind, spec.factor, spec.duration))
  return faults


def unit_names_of(layout) -> list[str]:
  """Unit names in controller order ('path[l]' for layer-stacked leaves), from a unit layout
  (a :class:`gnmr_jax.control.UnitLayout`, or a sequence of its LeafUnits)."""
  return units_lib.UnitLayout(tuple(layout), None).names()


class FaultInjector:
  """Applies a resolved schedule inside a jitted step (all selection by jnp.where on `step`).

  Args:
    faults: resolved faults (see :func:`resolve`).
    layout: the unit layout of the params (``units.resolve_units``), the order of the flat
      unit vector.
  """

  def __init__(self, faults: Sequence[Fault], layout):
    self.faults = tuple(faults)
    self.layout = list(layout)
    self.num_units = sum(info.num_units for info in self.layout)

  def _unit_bits(self, fault: Fault) -> np.ndarray:
    bits = np.zeros((self.num_units,), bool)
    bits[list(fault.units)] = True
    return bits

  def _active(self, fault: Fault, step: jax.Array) -> jax.Array:
    return (step >= fault.step) & (step < fault.step + fault.duration)

  def _per_leaf(self, tree, unit_values: jax.Array, apply):
    """apply(leaf, value) on each unit leaf with its per-unit value broadcast to the leaf."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out, offset = [], 0
    for leaf, info in zip(leaves, self.layout):
      if not info.is_unit:
        out.append(leaf)
        continue
      part = unit_values[offset:offset + info.num_units]
      offset += info.num_units
      if info.layer_axis is None:
        value = part[0]
      else:
        shape = [1] * leaf.ndim
        shape[info.layer_axis] = info.num_units
        value = part.reshape(shape)
      out.append(apply(leaf, value))
    return jax.tree_util.tree_unflatten(treedef, out)

  def corrupt_grads(self, grads, step: jax.Array):
    """scale / nan / inf faults active at `step` (int32 [], 1-based) applied to the gradients."""
    gradient_faults = [f for f in self.faults if f.kind in GRADIENT_KINDS]
    if not gradient_faults:
      return grads
    scale = jnp.ones((self.num_units,), jnp.float32)
    override = jnp.zeros((self.num_units,), jnp.float32)  # 0: keep, else the value to set
    for f in gradient_faults:
      hit = jnp.asarray(self._unit_bits(f)) & self._active(f, step)
      if f.kind == "scale":
        scale = jnp.where(hit, scale * f.factor, scale)
      else:
        override = jnp.where(hit, jnp.nan if f.kind == "nan" else jnp.inf, override)

    scaled = self._per_leaf(grads, scale, lambda leaf, s: leaf * s.astype(leaf.dtype))
    return self._per_leaf(scaled, override,
                          lambda leaf, o: jnp.where(o != 0, o.astype(leaf.dtype), leaf))

  def corrupt_params(self, params, step: jax.Array, recovering: Optional[jax.Array]):
    """Kernels the model sees: corrupt_output faults scale a unit's kernel by FACTOR at `step`
    unless `recovering` (bool [num_units], the mask used this step) has the unit on the recovery
    path. `recovering=None`: no recovery path, every hit unit is corrupted."""
    corrupt = [f for f in self.faults if f.kind == "corrupt_output"]
    if not corrupt:
      return params
    scale = jnp.ones((self.num_units,), jnp.float32)
    for f in corrupt:
      hit = jnp.asarray(self._unit_bits(f)) & self._active(f, step)
      scale = jnp.where(hit, scale * f.factor, scale)
    if recovering is not None:
      scale = jnp.where(recovering, 1.0, scale)
    return self._per_leaf(params, scale, lambda leaf, s: leaf * s.astype(leaf.dtype))

  def corrupt_loss(self, loss: jax.Array, step: jax.Array) -> jax.Array:
    """nan_loss faults: the loss times NaN, so its gradients are NaN too, as with a real one."""
    factor = jnp.float32(1.0)
    for f in self.faults:
      if f.kind == "nan_loss":
        factor = jnp.where(self._active(f, step), jnp.nan, factor)
    return loss * factor.astype(loss.dtype)


def make_injector(config: ml_collections.ConfigDict, layout) -> Optional[FaultInjector]:
  """The injector for config.faults, or None when fault injection is off (no code emitted)."""
  c = config.get("faults")
  if c is None or not c.enabled:
    return None
  faults = resolve(parse_schedule(c.schedule), unit_names_of(layout))
  return FaultInjector(faults, layout) if faults else None


# --- Measuring detection (host side, from per-step masks) -------------------------------------

def detection_report(faults: Sequence[Fault], mask_next: np.ndarray, warmup: int,
                     window: int = 1) -> dict:
  """How the controller answered each injected unit fault.

  Args:
    faults: the resolved schedule (nan_loss faults are skipped: they hit no unit).
    mask_next: bool [T, N]; row s - 1 is the mask the controller chose at step s (for s + 1).
    warmup: the controller's warmup (faults at or before it cannot be detected by design).
    window: a fault at step s is detected if its unit is in the mask chosen at steps
      s .. s + window ("enters the mask within one step" for window=1).

  Returns:
    {'faults': [per (fault, unit) dicts with step, unit, kind, factor, detected,
    latency (steps from the faulty step to the first step run on the recovery path, or None),
    already_in_mask], 'injected', 'detected', 'false_recoveries', 'unit_steps'}.
    A false recovery is a unit entering the mask (False -> True) after warmup at a step that no
    injected fault on that unit explains (its fault window s .. s + duration - 1 + window).
  """
  mask_next = np.asarray(mask_next, bool)
  steps, num_units = mask_next.shape
  explained = np.zeros_like(mask_next)
  rows = []
  for f in faults:
    if f.kind == "nan_loss":
      continue
    for u in f.units:
      lo, hi = f.step - 1, min(f.step - 1 + f.duration + window, steps)
      explained[lo:hi, u] = True
      if f.step > steps:
        continue
      hits = np.nonzero(mask_next[f.step - 1:, u])[0]
      latency = int(hits[0]) + 1 if hits.size else None
      rows.append({"step": f.step, "unit": int(u), "kind": f.kind, "factor": f.factor,
                   "after_warmup": f.step > warmup,
                   "detected": bool(mask_next[f.step - 1:hi, u].any()),
                   "latency": latency,
                   "already_in_mask": bool(f.step >= 2 and mask_next[f.step - 2, u])})
  previous = np.vstack([np.zeros((1, num_units), bool), mask_next[:-1]])
  entries = mask_next & ~previous
  entries[:warmup] = False
  false_recoveries = int(np.sum(entries & ~explained))
  return {"faults": rows, "injected": len(rows),
          "detected": sum(r["detected"] for r in rows),
          "false_recoveries": false_recoveries,
          "unit_steps": int(max(steps - warmup, 0) * num_units)}
