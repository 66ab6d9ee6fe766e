"""Everything that decides the recovery mask: unit layout, the controllers, the recovery gap.

The controllers, one constructor each:
  gnmr             the paper's rule, exactly (:func:`gnmr`, :class:`GNMRState`)
  transient_alarm  the paper's rule at alpha 4 / beta 3 / t_lock 2: the config default
  norm_level       the max_o units with the largest gradient norm
  fixed_set, last_blocks, late_switch
                   static recipes: a named set, the last layers, every unit from a step on
  research         instruments and baselines: gap, relgap, oracle, hybrid, random, noise
  from_config      the controller that ``config.gnmr.priority`` names
  register_priority  a priority of your own in that table

Modules:
  units          which leaves are recoverable units; :class:`UnitLayout`, the per-unit codec;
                 :class:`UnitValues`, one state field over the units
  paper          the paper's rule
  priority_types the typed entries of the priority table (:class:`Ranked`, :class:`StaticSet`,
                 :class:`Built`, :class:`Field`; what a ranking reads: :class:`Signals`)
  priority_table the table ``config.gnmr.priority`` names; :func:`register_priority`
  priorities     the engine of the budgeted controllers and their rankings
                 (:class:`PriorityState`)
  static_recipes the static recipes' transform
  recommended    the constructors above, with the measurements that recommend each
  research       the research instruments and baselines
  recovery_gap   the recovery-gap measurement (:func:`measure`, :class:`GapProbe`)
  state          readers: :func:`recovery_mask`, :func:`controller_state`
  config         :func:`from_config`, the controller of ``config.gnmr``

This package imports jax, optax and itself only: it never imports the precision paths
(:mod:`gnmr_jax.replay` replays a controller of a config on logged signals).
"""

from gnmr_jax.control import research as research
from gnmr_jax.control.config import from_config as from_config
from gnmr_jax.control.paper import GNMRState as GNMRState
from gnmr_jax.control.paper import GNMRTelemetry as GNMRTelemetry
from gnmr_jax.control.paper import gnmr as gnmr
from gnmr_jax.control.priorities import PriorityState as PriorityState
from gnmr_jax.control.priority_table import get as get_priority
from gnmr_jax.control.priority_table import names as priority_names
from gnmr_jax.control.priority_table import needs_recovery_gap as needs_recovery_gap
from gnmr_jax.control.priority_table import register_priority as register_priority
from gnmr_jax.control.priority_table import unregister_priority as unregister_priority
from gnmr_jax.control.priority_types import Built as Built
from gnmr_jax.control.priority_types import Field as Field
from gnmr_jax.control.priority_types import Ranked as Ranked
from gnmr_jax.control.priority_types import Ranking as Ranking
from gnmr_jax.control.priority_types import Settings as Settings
from gnmr_jax.control.priority_types import Signals as Signals
from gnmr_jax.control.priority_types import StaticSet as StaticSet
from gnmr_jax.control.recommended import fixed_set as fixed_set
from gnmr_jax.control.recommended import last_blocks as last_blocks
from gnmr_jax.control.recommended import late_switch as late_switch
from gnmr_jax.control.recommended import norm_level as norm_level
from gnmr_jax.control.recommended import transient_alarm as transient_alarm
from gnmr_jax.control.recovery_gap import GapProbe as GapProbe
from gnmr_jax.control.recovery_gap import GradientPasses as GradientPasses
from gnmr_jax.control.recovery_gap import RecoveryGap as RecoveryGap
from gnmr_jax.control.recovery_gap import measure as measure
from gnmr_jax.control.state import controller_state as controller_state
from gnmr_jax.control.state import gap_estimate as gap_estimate
from gnmr_jax.control.state import recovery_mask as recovery_mask
from gnmr_jax.control.units import UnitLayout as UnitLayout
from gnmr_jax.control.units import UnitValues as UnitValues
from gnmr_jax.control.units import layout_of as layout_of
