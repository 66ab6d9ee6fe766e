"""A controller replayed on logged per-unit signals: the one replay scripts and experiments use.

The threshold sweep (scripts/threshold_sweep.py) replays a run's gradient norms under many
settings; the selection study (experiments/selection.py) replays norms and measured recovery
gaps under each priority. Both feed the library's own transform, jitted and scanned over the
steps, so a replay is what training would have decided.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from gnmr_jax.control import config as control_config
from gnmr_jax.control import priorities
from gnmr_jax.control import recovery_gap as recovery_gap_lib
from gnmr_jax.control import state as state_lib

UNIT_LEAF = "u"  # the one leaf the replayed units are slices of
# Fields of the controller's GNMRState (per unit) and of a budgeted PriorityState a replay returns.
CONTROLLER_FIELDS = ("mask", "lock", "risky", "score", "gnmr", "delta_gnmr", "norm")
BUDGETED_FIELDS = ("value", "gap", "gap_count")


def replay(g, norms, *, gaps=None, rec_norms=None, measured=None, overflow=None, seed: int = 0,
           fields: Sequence[str] = ("mask",)) -> dict:
  """The state fields after each step of the controller of ``g`` fed ``norms``.

  Each step feeds one gradient leaf [N, 1] whose slice u is n_t of unit u, so the controller's
  own norm of it is n_t (``g.units`` and ``g.layer_axis`` are replaced to select that leaf and
  split it into N units).

  Args:
    g: a ``config.gnmr`` ConfigDict (or dict of its fields).
    norms: [..., T, N] per-unit gradient norms; leading axes are independent sequences.
    gaps, rec_norms: [..., T, N] measured recovery gaps e_u and recovery-gradient norms
      (``rec_norms`` default: ``gaps``); None: no measurement is passed.
    measured: [..., T, N] bool, which of ``gaps`` are measurements (default: every one).
    overflow: [..., T, N] bool, a saturated low-cost step per unit (``update(overflow=)``).
    seed: the controller's seed (priority 'random').
    fields: which state fields to return: :data:`CONTROLLER_FIELDS`, and for a budgeted
      priority :data:`BUDGETED_FIELDS`.

  Returns:
    {field: numpy array [..., T, N]}: the field after step t (the mask chosen at step t is
    used at step t + 1).

  Raises:
    ValueError: a field the controller does not keep, norms without a step and a unit axis,
      or `measured` / `rec_norms` without `gaps`.
  """
  g = ml_collections.ConfigDict(dict(g))
  g.update(units=f"^{UNIT_LEAF}$", layer_axis=f"^{UNIT_LEAF}$")
  tx = control_config.from_config(g, seed=seed)
  norms = np.asarray(norms, np.float32)
  if norms.ndim < 2:
    raise ValueError(f"replay: norms must be [..., T, N], got shape {norms.shape}.")
  if gaps is None and (measured is not None or rec_norms is not None):
    raise ValueError("replay: `measured` and `rec_norms` describe `gaps`: pass the gaps too.")
  num_units = norms.shape[-1]
  params = {UNIT_LEAF: jnp.zeros((num_units, 1), jnp.float32)}
  unknown = [f for f in fields if f not in CONTROLLER_FIELDS + BUDGETED_FIELDS]
  if unknown:
    raise ValueError(f"replay: no state field {unknown}; fields: "
                     f"{CONTROLLER_FIELDS + BUDGETED_FIELDS}.")
  inputs = {"norm": norms}
  if gaps is not None:
    inputs["gap"] = np.asarray(gaps, np.float32)
    inputs["rec_norm"] = np.asarray(gaps if rec_norms is None else rec_norms, np.float32)
    inputs["valid"] = np.broadcast_to(True if measured is None else measured, norms.shape)
  if overflow is not None:
    inputs["overflow"] = np.asarray(overflow, bool)

  def step(state, x):
    extra = {}
    if "gap" in x:
      extra["recovery_gap"] = recovery_gap_lib.RecoveryGap(
          {UNIT_LEAF: x["gap"]}, {UNIT_LEAF: x["rec_norm"]}, {UNIT_LEAF: x["valid"]})
    if "overflow" in x:
      extra["overflow"] = {UNIT_LEAF: x["overflow"]}
    _, state = tx.update({UNIT_LEAF: x["norm"][:, None]}, state, params, **extra)
    return state, {f: _field(state, f) for f in fields}

  def one_sequence(xs):
    return jax.lax.scan(step, tx.init(params), xs)[1]

  run = one_sequence
  for _ in range(norms.ndim - 2):
    run = jax.vmap(run)
  out = jax.jit(run)({k: jnp.asarray(v) for k, v in inputs.items()})
  return {k: np.asarray(v) for k, v in out.items()}


def _field(state, field: str):
  if field in CONTROLLER_FIELDS:
    return getattr(state_lib.controller_state(state), field)[UNIT_LEAF]
  if not isinstance(state, priorities.PriorityState):
    raise ValueError(f"replay: {field!r} is a budgeted priority's field; this controller keeps "
                     f"a {type(state).__name__}.")
  return getattr(state, field)[UNIT_LEAF]
