"""The recovery-gap instrument: how far each unit's low-cost gradient is from its recovery one.

For unit u at step t, with the gradients of the same params and batch computed twice,
once as the step trains (g_used: the units outside the recovery mask on the low-cost
path, the units in it on the recovery path) and once with every unit *swapped* to the
other path (g_swap: the mask's units on the low-cost path, every other unit recovered):

  e_u     = ||g_used,u - g_swap,u||_F      (the recovery gap: one side is u's low-cost
                                            gradient, the other its recovery gradient)
  e_rel_u = e_u / ||g_rec,u||_F            (g_rec,u: whichever side recovered u; 0/0 = 0)

so one extra pass measures every unit, also those recovered on that step. With an empty
mask (static low-cost mode) the swapped pass is simply every unit on the recovery path.
The default pass ('recovery', ``swapped=False``) recovers every unit instead (below).

What it measures depends on the regime:
  * Only the weight gradient differs (saved activations quantized for the backward
    only, ``saved_activation_forward=False``): the upstream gradients are the same on
    both passes, so e_u is exactly the error of unit u's own low-cost path.
  * The forward differs too (int8/fp8 operands, ``saved_activation_forward=True``,
    blockwise): the loss and the upstream gradients change, so e_u is the total effect
    on u of *every* unit's low-cost path (recovering u alone does not remove all of it).
  * With a non-empty mask, the swapped pass changes every unit's path at once, so in the
    forward-quantized regimes a recovered unit's e_u is measured with the *other* units on
    the opposite paths too: the same kind of total effect, from the other side.
  * The 'recovery' pass (``swapped=False``, the default) takes g_rec (every unit recovered)
    instead; units in the mask then show only a residual gap and are marked not ``valid``,
    and a controller keeps the estimate they had while on the low-cost path (measured with
    the others mostly low-cost, the context they train in). On the CPU scenario model it
    closed more of the loss gap than the swapped pass (RESULTS.md, "Selection").

  * The 'uniform' pass (``measuring_pass='uniform'``) ignores the mask: e_u = ||g_low,u -
    g_rec,u|| with *every* unit low-cost on one side and every unit recovered on the other,
    so every unit is measured in the same context on every measured step, whatever the
    controller recovered. It is the refresh of the 'recovery' pass: with the 'recovery' pass
    the mask's units are never re-measured, so a 'gap' controller keeps the set its first
    measurement picked (RESULTS.md, "Selection").

Split halves (``split_halves=True``, 'recovery' and 'uniform' passes): the recovery
gradient is computed as two half-batch gradients g_a, g_b (the same FLOPs), g_rec = (g_a +
g_b) / 2, which also gives per unit

  signal_sq   = <g_a,u, g_b,u>            (an unbiased estimate of ||G_u||^2, the squared
                                           expected gradient)
  sampling_sq = ||g_a,u - g_b,u||^2 / 4    (S_u, the sampling noise of the batch mean)

so with Q_u = e_u^2 both limits of the noise fraction are logged on the same run: the signal
form ||G_u||^2 / Q_u (Chmiel) and the sampling-noise form Q_u / S_u (GACT).

Cost: one extra forward + backward per measured step ('recovery', 'swapped'; 'uniform' when
the step's mask is empty, as in static mode), two for 'uniform' with a mask, so about 1/K
(2/K) of a step's cost when measured every K steps.

One implementation measures, behind both the public :func:`measure` (a user's
``loss_fn(params, batch, recovery_mask)``) and the train step (:class:`GapProbe`, with the
model's own passes): :func:`measure_passes`, given the three gradient passes it may need
(:class:`GradientPasses`).

Example:
  >>> import jax.numpy as jnp
  >>> from gnmr_jax.control import recovery_gap
  >>> used = {'w': jnp.array([[3.0, 0.0], [0.0, 0.0]]), 'b': jnp.ones(2)}
  >>> rec = {'w': jnp.zeros((2, 2)), 'b': jnp.ones(2)}
  >>> gap = recovery_gap.unit_gaps(used, rec)
  >>> float(gap.gap['w']), bool(gap.valid['w']), bool(gap.valid['b'])
  (3.0, True, False)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from gnmr_jax.control import checks as _checks
from gnmr_jax.control import units as units_lib


class RecoveryGap(NamedTuple):
  """Per-unit trees shaped like the recovery mask (leaf () or (L,); non-units scalar 0/False)."""
  gap: Any        # float32: e_u = ||g_used,u - g_swap,u|| (or g_rec with swapped=False)
  rec_norm: Any   # float32: ||g_rec,u||, u's gradient on the recovery path
  valid: Any      # bool: measured on this step (and, with swapped=False, u ran low-cost)
  signal_sq: Any = None    # float32 <g_a,u, g_b,u> of the split halves (None: not split)
  sampling_sq: Any = None  # float32 ||g_a,u - g_b,u||^2 / 4 (None: not split)


_layout = units_lib.layout_of


def unit_gaps(grads_used, grads_other, mask_used=None, *, swapped: bool = False, units=None,
              layer_axis=None, measured: Any = True) -> RecoveryGap:
  """e_u, ||g_rec,u|| and validity per unit from two gradient trees of the same params.

  Args:
    grads_used: gradients as the step computed them (mask units recovered).
    grads_other: gradients with every unit on the recovery path, or with ``swapped``, with
      every unit on the other path than in ``grads_used`` (``swapped_mask(mask_used)``).
    mask_used: the recovery mask of the step (bool tree like the controller's), or None
      when every unit ran the low-cost path (static mode).
    swapped: what ``grads_other`` is (above). Without it, units in ``mask_used`` are not
      valid (their measured gap is only a residual).
    units, layer_axis: which leaves are units, as in :func:`gnmr_jax.gnmr`.
    measured: bool scalar; False marks every unit not valid (a step that did not measure).

  Returns:
    A :class:`RecoveryGap`.
  """
  grads_used, grads_other = units_lib.unbox(grads_used), units_lib.unbox(grads_other)
  layout = _layout(grads_used, units, layer_axis)
  leaves_used, treedef = jax.tree_util.tree_flatten(grads_used)
  leaves_other = treedef.flatten_up_to(grads_other)
  diff = [jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32)
          for a, b in zip(leaves_used, leaves_other)]
  gap = layout.per_unit(units_lib.unit_norms(diff, layout), jnp.float32)
  other_norm = layout.per_unit(units_lib.unit_norms(leaves_other, layout), jnp.float32)
  if mask_used is None:
    in_mask = jax.tree_util.tree_map(lambda g: jnp.zeros(jnp.shape(g), jnp.bool_), gap)
  else:
    in_mask = jax.tree_util.tree_map(lambda m: jnp.asarray(m, jnp.bool_), mask_used)
  rec_norm = other_norm
  if swapped and mask_used is not None:  # u's recovery gradient is on the used side
    used_norm = layout.per_unit(units_lib.unit_norms(leaves_used, layout), jnp.float32)
    rec_norm = jax.tree_util.tree_map(jnp.where, in_mask, used_norm, other_norm)
  measured = jnp.asarray(measured, jnp.bool_)
  is_unit = [u.is_unit for u in layout]
  valid_leaves = [measured & (jnp.ones_like(m) if swapped else ~m) if keep
                  else jnp.zeros((), jnp.bool_)
                  for m, keep in zip(jax.tree_util.tree_leaves(in_mask), is_unit)]
  return RecoveryGap(gap=gap, rec_norm=rec_norm,
                     valid=jax.tree_util.tree_unflatten(treedef, valid_leaves))


def swapped_mask(mask_used, params, *, units=None, layer_axis=None, everything=None):
  """The mask of the measuring pass: every unit on the other path than in ``mask_used``
  (all units recovered when ``mask_used`` is None). ``everything``: the
  :func:`all_recovered_mask` of ``params`` if the caller has it."""
  if everything is None:
    everything = all_recovered_mask(params, units=units, layer_axis=layer_axis)
  if mask_used is None:
    return everything
  return jax.tree_util.tree_map(lambda every, m: every & ~jnp.asarray(m, jnp.bool_),
                                everything, mask_used)


def not_measured(params, *, units=None, layer_axis=None,
                 split_halves: bool = False) -> RecoveryGap:
  """A RecoveryGap of zeros with nothing valid: what a step that does not measure passes."""
  layout = _layout(params, units, layer_axis)
  zeros = layout.full(0, jnp.float32)
  return RecoveryGap(gap=zeros, rec_norm=zeros, valid=layout.full(False, jnp.bool_),
                     signal_sq=zeros if split_halves else None,
                     sampling_sq=zeros if split_halves else None)


def split_batch(batch):
  """(first half, second half) of every leaf of ``batch`` along its leading (batch) axis."""
  sizes = {jnp.shape(x)[0] for x in jax.tree_util.tree_leaves(batch)}
  if len(sizes) != 1 or next(iter(sizes)) % 2:
    raise ValueError(f"recovery gap: split_halves needs one even batch size along the leading "
                     f"axis of every batch leaf, got sizes {sorted(sizes)}.")
  half = next(iter(sizes)) // 2
  return (jax.tree_util.tree_map(lambda x: x[:half], batch),
          jax.tree_util.tree_map(lambda x: x[half:], batch))


def half_statistics(grads_a, grads_b, *, units=None, layer_axis=None):
  """(g_rec = (g_a + g_b) / 2, signal_sq, sampling_sq) of two half-batch gradients."""
  grads_a, grads_b = units_lib.unbox(grads_a), units_lib.unbox(grads_b)
  layout = _layout(grads_a, units, layer_axis)
  leaves_a, treedef = jax.tree_util.tree_flatten(grads_a)
  leaves_b = treedef.flatten_up_to(grads_b)
  grads = treedef.unflatten([(a + b) / 2 for a, b in zip(leaves_a, leaves_b)])
  dots, diffs = [], []
  for a, b, info in zip(leaves_a, leaves_b, layout):
    if not info.is_unit:
      continue
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    axes = tuple(i for i in range(a32.ndim) if i != info.layer_axis)
    dots.append(jnp.sum(a32 * b32, axis=axes))
    diffs.append(jnp.sum(jnp.square(a32 - b32), axis=axes) / 4)
  return (grads, layout.per_unit(dots, jnp.float32), layout.per_unit(diffs, jnp.float32))


def all_recovered_mask(params, *, units=None, layer_axis=None):
  """A recovery mask (bool tree like the controller's) with every unit True."""
  return _layout(params, units, layer_axis).full(True, jnp.bool_)


MEASURING_PASSES = ("recovery", "swapped", "uniform")


class GradientPasses(NamedTuple):
  """The gradient passes a measurement may run (each returns a params-shaped gradient tree).

  Attributes:
    low_cost: ``() -> grads`` with every unit on the low-cost path.
    recovered: ``() -> grads`` with every unit on the recovery path.
    routed: ``mask -> grads`` with the mask's units recovered, the others low-cost.
    recovered_halves: ``() -> (grads_a, grads_b)``, ``recovered`` on each half of the batch
      (``split_halves`` only).
  """
  low_cost: Callable[[], Any]
  recovered: Callable[[], Any]
  routed: Callable[[Any], Any]
  recovered_halves: Optional[Callable[[], Any]] = None


def check_measuring_pass(measuring_pass: str, swapped: bool = False) -> str:
  """The measuring pass, from ``measuring_pass`` or the older ``swapped`` flag (ValueError)."""
  if measuring_pass is None:
    return "swapped" if swapped else "recovery"
  if swapped and measuring_pass != "swapped":
    raise ValueError(f"measure: swapped=True contradicts measuring_pass={measuring_pass!r}.")
  if measuring_pass not in MEASURING_PASSES:
    raise ValueError(f"measure: `measuring_pass` must be one of {MEASURING_PASSES}, got "
                     f"{measuring_pass!r}.")
  return measuring_pass


def measure_passes(passes: GradientPasses, params, mask_used=None, grads_used=None, *,
                   measuring_pass: str = "recovery", units=None, layer_axis=None,
                   split_halves: bool = False) -> RecoveryGap:
  """The recovery gap from a model's gradient passes (the one implementation of a measurement).

  Args:
    passes: the model's :class:`GradientPasses` on the step's params and batch.
    params: the params (for the unit layout).
    mask_used: the step's recovery mask (None: every unit low-cost).
    grads_used: the step's gradients if already computed (else computed here).
    measuring_pass: one of :data:`MEASURING_PASSES` (module docstring).
    units, layer_axis: which leaves are units, as in :func:`gnmr_jax.gnmr`.
    split_halves: compute the recovery gradient as two half-batch gradients and return the
      signal and sampling-noise estimates too (module docstring); not with 'swapped'.

  Returns:
    A :class:`RecoveryGap`.
  """
  if split_halves and measuring_pass == "swapped":
    raise ValueError("recovery gap: split_halves splits the all-recovered pass, which the "
                     "'swapped' pass does not run; use the 'recovery' or 'uniform' pass.")
  halves = None

  def recovered():
    nonlocal halves
    if not split_halves:
      return passes.recovered()
    grads_rec, signal_sq, sampling_sq = half_statistics(*passes.recovered_halves(),
                                                        units=units, layer_axis=layer_axis)
    halves = (signal_sq, sampling_sq)
    return grads_rec

  if measuring_pass == "uniform":  # every unit low-cost against every unit recovered
    grads_low = (grads_used if grads_used is not None and mask_used is None
                 else passes.low_cost())
    gap = unit_gaps(grads_low, recovered(), None, units=units, layer_axis=layer_axis)
  else:
    if grads_used is None:
      grads_used = passes.low_cost() if mask_used is None else passes.routed(mask_used)
    swapped = measuring_pass == "swapped"
    if swapped and mask_used is not None:
      other = passes.routed(swapped_mask(mask_used, params, units=units, layer_axis=layer_axis))
    else:  # 'recovery', or the swapped pass of a step without a mask: every unit recovered
      other = recovered()
    gap = unit_gaps(grads_used, other, mask_used, swapped=swapped, units=units,
                    layer_axis=layer_axis)
  if halves is not None:
    gap = gap._replace(signal_sq=halves[0], sampling_sq=halves[1])
  return gap


def measure(loss_fn: Callable, params, batch, mask_used=None, grads_used=None, *,
            swapped: bool = False, measuring_pass: Optional[str] = None, units=None,
            layer_axis=None, split_halves: bool = False) -> RecoveryGap:
  """The recovery gap of a user's model on one batch.

  Args:
    loss_fn: ``loss_fn(params, batch, recovery_mask) -> scalar loss`` of a model whose
      units are routed by ``recovery_mask`` (e.g. ``policy.dot_general(mask[...])``
      with a policy in mode 'gnmr' and per-unit residual storage: the second pass may
      recover every unit). ``recovery_mask=None`` must mean "every unit
      on the low-cost path".
    params: the params.
    batch: the batch.
    mask_used: the step's recovery mask (None: every unit low-cost).
    grads_used: the step's gradients if already computed (else computed here).
    swapped: ``measuring_pass='swapped'`` (kept for existing callers).
    measuring_pass: one of :data:`MEASURING_PASSES`, as
      ``config.diagnostics.recovery_gap_pass`` (module docstring): 'recovery' (the
      default; units in ``mask_used`` not valid), 'swapped' (every unit on the other path;
      every unit valid) or 'uniform' (every unit low-cost against every unit recovered;
      every unit valid; ``grads_used`` is only reused when ``mask_used`` is None).
    units, layer_axis: which leaves are units, as in :func:`gnmr_jax.gnmr`; pass the
      controller's (a layer-stacked model needs its ``layer_axis`` here too).
    split_halves: also estimate the signal and sampling-noise energies from two half
      batches (``batch``'s leaves split along their leading axis; module docstring).

  Returns:
    A :class:`RecoveryGap`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from gnmr_jax.control import recovery_gap
    >>> from gnmr_jax.precision import make_policy, default_precision_config
    >>> policy = make_policy(default_precision_config(), max_recovered=None)  # int8 / bf16
    >>> def loss_fn(params, x, mask):
    ...   bit = None if mask is None else mask['w']
    ...   return jnp.sum(policy.dot(x, params['w'], bit) ** 2)
    >>> x = jax.random.normal(jax.random.key(0), (8, 16))
    >>> params = {'w': jax.random.normal(jax.random.key(1), (16, 4))}
    >>> gap = recovery_gap.measure(loss_fn, params, x)
    >>> 0.0 < float(gap.gap['w']) < 0.1 * float(gap.rec_norm['w'])
    True
  """
  measuring_pass = check_measuring_pass(measuring_pass, swapped)

  def grads_at(mask, data=batch):
    return jax.grad(loss_fn)(params, data, mask)

  everything = all_recovered_mask(params, units=units, layer_axis=layer_axis)
  passes = GradientPasses(
      low_cost=lambda: grads_at(None), recovered=lambda: grads_at(everything), routed=grads_at,
      recovered_halves=lambda: tuple(grads_at(everything, half) for half in split_batch(batch)))
  return measure_passes(passes, params, mask_used, grads_used, measuring_pass=measuring_pass,
                        units=units, layer_axis=layer_axis, split_halves=split_halves)


@dataclasses.dataclass(frozen=True)
class GapProbe:
  """When and how a train step measures the recovery gap (``config.diagnostics.recovery_gap_*``).

  Measured steps are ``start``, ``start + every``, ``start + 2 every``, ... (1-based step
  numbers). On the other steps :meth:`__call__` returns :func:`not_measured` under a
  ``lax.cond``, so the extra passes cost nothing there.

  Attributes:
    every: steps between measurements (>= 1).
    start: the first measured step (>= 1).
    measuring_pass: one of :data:`MEASURING_PASSES`.
    units, layer_axis: the controller's unit selectors.
    split_halves: measure the recovery gradient as two half batches (module docstring).
  """
  every: int
  start: int = 1
  measuring_pass: str = "recovery"
  units: Any = None
  layer_axis: Any = None
  split_halves: bool = False

  def __post_init__(self):
    _checks.check_int("GapProbe: `every`", self.every, 1)
    _checks.check_int("GapProbe: `start`", self.start, 1)
    check_measuring_pass(self.measuring_pass)
    if self.split_halves and self.measuring_pass == "swapped":
      raise ValueError("GapProbe: split_halves needs the 'recovery' or 'uniform' pass.")

  def due(self, step_number):
    """Whether 1-based ``step_number`` (traced) is a measured step."""
    return (step_number >= self.start) & ((step_number - self.start) % self.every == 0)

  def __call__(self, step_number, passes: GradientPasses, params, mask_used, grads_used):
    """(measured: bool[], RecoveryGap) of the step: a measurement on due steps, else zeros."""
    due = self.due(step_number)

    def run(_):
      return measure_passes(passes, params, mask_used, grads_used,
                            measuring_pass=self.measuring_pass, units=self.units,
                            layer_axis=self.layer_axis, split_halves=self.split_halves)

    def skip(_):
      return not_measured(params, units=self.units, layer_axis=self.layer_axis,
                          split_halves=self.split_halves)

    return due, jax.lax.cond(due, run, skip, None)


def summarize(gap: np.ndarray, mask_used: Optional[np.ndarray], max_o: int) -> dict:
  """Concentration and coverage of one measured step (flat per-unit NumPy vectors).

  concentration: share of sum_u e_u held by the top max_o units by e_u.
  coverage: share of the top max_o units' gap that the mask used at that step covers,
    sum_{u in mask and top} e_u / sum_{u in top} e_u (meaningful where the mask did not
    change the gradients, i.e. in static mode, where the controller only measures).
  """
  gap = np.asarray(gap, np.float64)
  total = float(gap.sum())
  top = np.argsort(-gap, kind="stable")[:max_o]
  top_sum = float(gap[top].sum())
  out = {"concentration": top_sum / total if total > 0 else 0.0}
  if mask_used is not None:
    in_mask = np.asarray(mask_used, bool)
    out["coverage"] = float(gap[top][in_mask[top]].sum()) / top_sum if top_sum > 0 else 0.0
  return out
