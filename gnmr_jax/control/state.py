"""Reading a controller's state out of any optax state: the recovery mask and the statistics.

Every controller of this package keeps its mask in a :class:`GNMRState` (the paper's
``gnmr`` as its own state; the budgeted priorities inside a :class:`PriorityState`, whose
``controller`` field holds the paper's statistics with the priority's mask, lock and budget
counts). One finder, :func:`find_states`, looks for a state type anywhere in a chained,
nested, masked or NNX-wrapped optax state, as ``optax.tree_utils.tree_get`` does by type.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from gnmr_jax.control import units as units_lib
from gnmr_jax.control.paper import GNMRState
from gnmr_jax.control.priorities import PriorityState


def find_states(opt_state, state_type: type) -> list:
  """Every ``state_type`` instance inside ``opt_state``, in tree order."""
  return [x for x in jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, state_type)) if isinstance(x, state_type)]


# dtype of each per-unit field, for the scalar that stands in for a masked-out leaf.
_PER_UNIT_DTYPES = dict(mask=jnp.bool_, lock=jnp.int32, gnmr=jnp.float32,
                        delta_gnmr=jnp.float32, score=jnp.float32, risky=jnp.bool_,
                        norm=jnp.float32, norm_sum=jnp.float32, norm_count=jnp.int32,
                        window=jnp.float32, window_count=jnp.int32)


def _as_tree(values, dtype):
  """A per-unit field (:class:`UnitValues`) as the params-shaped tree, with scalar zeros for
  masked-out leaves: under ``optax.masked`` / ``multi_transform`` / ``partition`` the params'
  structure holds leafless ``optax.MaskedNode()`` for params outside gnmr's branch, which
  cannot be handed to a model as a ``bool[]`` recovery bit."""
  tree = values.tree() if isinstance(values, units_lib.UnitValues) else values
  return jax.tree_util.tree_map(
      lambda x: jnp.zeros((), dtype) if isinstance(x, optax.MaskedNode) else x, tree,
      is_leaf=lambda x: isinstance(x, optax.MaskedNode))


def _readable(state: GNMRState) -> GNMRState:
  """The state with plain arrays (``nnx.Optimizer`` wraps every opt-state leaf in an
  ``OptArray`` Variable) and its per-unit fields as params-shaped trees."""
  state = units_lib.unbox(state)
  return state._replace(**{field: _as_tree(getattr(state, field), dtype)
                           for field, dtype in _PER_UNIT_DTYPES.items()})


def controller_state(opt_state) -> GNMRState:
  """Finds the GNMRState anywhere inside a (chained, nested, masked) optax state.

  The result is for reading (masks, statistics, telemetry), not for putting
  back into ``opt_state``: its leaves are plain arrays even when ``opt_state``
  is an ``nnx.Optimizer``'s (whose leaves are ``OptArray`` Variables), and a
  param outside gnmr's branch of ``optax.masked`` / ``multi_transform`` /
  ``partition`` (an ``optax.MaskedNode()`` in the state) reads as a scalar 0 /
  False of the field's dtype, like any other non-unit leaf.

  Args:
    opt_state: the state of an optax transform that chains ``gnmr`` once.

  Returns:
    The :class:`GNMRState`: per-unit statistics, locks, the mask and telemetry.

  Raises:
    ValueError: if there is no GNMRState, or more than one.

  Example:
    An isolated gradient spike at step 3 (GNMR = 30 / mean(3, 3) = 10 > alpha)
    puts the unit in the mask and locks it for ``t_lock`` more steps:

    >>> import jax.numpy as jnp, optax, gnmr_jax
    >>> tx = optax.chain(gnmr_jax.gnmr(alpha=2.0, beta=1.5, delta=4, max_o=1, t_lock=2),
    ...                  optax.sgd(0.1))
    >>> params = {'w': jnp.ones((3, 3))}
    >>> state = tx.init(params)
    >>> for scale in (1.0, 1.0, 10.0):
    ...   _, state = tx.update({'w': scale * jnp.ones((3, 3))}, state, params)
    >>> ctl = gnmr_jax.controller_state(state)
    >>> int(ctl.count), float(ctl.norm['w']), float(ctl.gnmr['w']), bool(ctl.risky['w'])
    (3, 30.0, 10.0, True)
    >>> bool(ctl.mask['w']), int(ctl.lock['w']), int(ctl.telemetry.active_unit_steps)
    (True, 2, 1)
  """
  found = find_states(opt_state, GNMRState)
  if len(found) != 1:
    raise ValueError(f"gnmr_jax: expected exactly one GNMRState in the optimizer state, "
                     f"found {len(found)}; chain gnmr_jax.gnmr(...) into the optimizer once.")
  return _readable(found[0])


def recovery_mask(opt_state):
  """The recovery mask tree (bool, mirrors params) for the next step, from an optax state.

  Leaves are bool[] per unit, bool[L] for layer-stacked leaves (``layer_axis``),
  and scalar False for leaves that are not units (including params outside
  gnmr's branch of ``optax.masked`` / ``multi_transform`` / ``partition``), as
  plain arrays also for an ``nnx.Optimizer``'s ``opt_state``. Feed them to the model (for
  example ``policy.dot_general(mask['dense']['kernel'])``) on the next step.

  Example:
    >>> import jax.numpy as jnp, gnmr_jax
    >>> params = {'layers': {'q': {'kernel': jnp.ones((3, 4, 4))}}, 'head': jnp.ones((4, 2))}
    >>> tx = gnmr_jax.gnmr(alpha=2.0, beta=1.5, delta=4, max_o=1, t_lock=0,
    ...                    units=r'layers/.*kernel', layer_axis=r'^layers/')
    >>> mask = gnmr_jax.recovery_mask(tx.init(params))
    >>> mask['layers']['q']['kernel'].shape, mask['layers']['q']['kernel'].dtype, mask['head'].shape
    ((3,), dtype('bool'), ())
  """
  return controller_state(opt_state).mask


def maybe_controller_state(opt_state, *, flat: bool = False) -> Optional[GNMRState]:
  """:func:`controller_state`, or None when ``opt_state`` holds no controller (static runs).

  With ``flat=True`` the per-unit fields stay :class:`UnitValues` (one [N] array each, boxes
  removed): what the train step reads its per-unit metrics from without re-concatenating
  the trees."""
  found = find_states(opt_state, GNMRState)
  if len(found) != 1:
    return None
  return units_lib.unbox(found[0]) if flat else _readable(found[0])


def gap_estimate(opt_state) -> Optional[Any]:
  """The recovery-gap estimate tree of the PriorityState inside ``opt_state`` (None if none)."""
  found = find_states(opt_state, PriorityState)
  return _as_tree(units_lib.unbox(found[0].gap), jnp.float32) if len(found) == 1 else None
