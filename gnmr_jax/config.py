"""The experiment config: one ConfigDict grouping model, data, train, optimizer, gnmr, precision,
checkpoint, logging and mesh, plus its up-front validation.

configs/*.py start from :func:`base_config` and override fields; every field
is validated by :func:`validate_config` before anything is traced, with a
ValueError naming the field and the allowed values.
"""

from __future__ import annotations

import math
import numbers
import re

import jax
import ml_collections

from gnmr_jax.data.config import default_data_config, validate_data_config
from gnmr_jax.faults import default_faults_config, validate_faults_config
from gnmr_jax.model import PROJECTIONS
from gnmr_jax.model_configs import default_seq_len, model_config, validate_model_config
from gnmr_jax.sharding import MESH_FIELDS, default_mesh_config, mesh_axis_types, mesh_shape
from gnmr_jax.precision.config import default_precision_config, validate_config as validate_precision
from gnmr_jax.control import priority_table
from gnmr_jax.control.checks import check_regex
from gnmr_jax.control.config import check_priority_fields, options_of
from gnmr_jax.optim import SCHEDULES

NONFINITE_POLICIES = ("skip", "zero", "none")
GAP_PASSES = ("swapped", "recovery", "uniform")
GROUPS = ("model", "data", "train", "optimizer", "gnmr", "precision", "checkpoint", "logging", "mesh",
          "faults", "diagnostics")
# Groups a config may omit (configs written before they existed); they default to off.
OPTIONAL_GROUPS = ("faults", "diagnostics")


def gnmr_config() -> ml_collections.ConfigDict:
  """GNMR controller hyper-parameters (the paper's alpha, beta, delta, maxO, T_lock)."""
  c = ml_collections.ConfigDict()
  # Put the controller in the optimizer chain (needed by precision.mode='gnmr'; in static modes it
  # only measures, for telemetry).
  c.enabled = True
  # Threshold on GNMR_t = ||g_t|| / mean(||g_1..t-1||). The paper uses 2 (with beta 1.5, t_lock 5:
  # the experiments pin those, experiments/common.py); 4 / 3 / 2 here: the cheapest setting of
  # THRESHOLDS.md's replay of `make train` that recovers every x5 / x10 / x100 spike within 2
  # steps, at 0.75% of the clean run's unit-steps (2 / 1.5 / 5: 8.5%).
  c.alpha = 4.0
  # Threshold on dGNMR_t = GNMR_t / mean(GNMR over the last delta steps).
  c.beta = 3.0
  # Short window length for dGNMR.
  c.delta = 8
  # Hard budget: at most this many units on the recovery path per step.
  c.max_o = 4
  # Lock length: a selected risky unit stays a candidate for this many more steps. None: per
  # priority (the priority table's t_lock): 2 for 'gnmr' (the alarm above), 1 for
  # 'saturation', 5 for the others (the paper's, which every other priority was measured with).
  c.t_lock = ml_collections.config_dict.placeholder(int)
  # Steps during which statistics accumulate but nothing is recovered.
  c.warmup = 20
  # Regex over '/'-joined param paths selecting the recoverable units (the 7 projections).
  c.units = (f"layers/({'|'.join(PROJECTIONS)})/"
             f"({'|'.join(n for names in PROJECTIONS.values() for n in names)})/kernel")
  # Regex selecting layer-stacked leaves whose axis-0 slices are separate units.
  c.layer_axis = r"^layers/"
  # How the max_o units are ranked (gnmr_jax/control/priority_table.py; control.register_priority
  # adds one, with its own fields here): 'norm' (gradient-norm level),
  # 'gnmr' (the paper's rule: alpha, beta, delta above), 'gap' (measured recovery gap; needs
  # diagnostics.recovery_gap_every > 0), 'relgap' (the norm level times the measured relative
  # gap e_u/||g_rec,u||; needs it too), 'oracle' (the last measured gap alone), 'hybrid' (the
  # paper's transient risk first, the norm level fills the budget), 'random', or a static recipe:
  # 'fixed' (the units matching fixed_units below, at most max_o, at every step after warmup),
  # 'last_blocks' (every unit of the last `last_blocks` layers, NVIDIA's NVFP4 recipe) or
  # 'late_switch' (every unit from step `switch_step`; max_o >= the number of units), or 'noise'
  # (the measured quantization-noise fraction against noise_upper / noise_lower below; a cap:
  # the mask may be empty; needs the gap measured with recovery_gap_pass 'uniform').
  # The default is 'gnmr' at the thresholds above, a transient alarm: max_o is a cap and the mask
  # is empty unless a unit's gradient jumps (or is NaN/Inf), so where the low-cost path does not
  # hurt (int8 / bf16 here) it spends ~1% of unit-steps instead of max_o every step ('norm', the
  # default until 2026-12-02, recovered 13% of `make train`'s unit-steps for no measured gain).
  # Where the low-cost error is persistent it recovers next to nothing: there 'norm' (closed 0.61
  # of the 4-bit per-tensor gap) or a static set ('fixed', 'last_blocks') is the choice
  # (docs/guides/choosing_a_recipe.md; RESULTS.md). For the other priorities
  # alpha/beta/delta only feed telemetry ('hybrid', 'noise': their alarm).
  c.priority = "gnmr"
  # 'gap'/'relgap' only: weight of the old estimate when a new measurement arrives, in [0, 1).
  c.gap_decay = 0.0
  # 'fixed' only: a regex searched in the unit names ('layers/mlp/down/kernel[3]': the leaf path,
  # [l] for layer l of a layer-stacked leaf); the 1 to max_o matching units are the static set.
  c.fixed_units = ""
  # 'last_blocks' only: how many of the last layers run the recovery path for the whole run.
  c.last_blocks = 0
  # 'late_switch' only: the first step at which every unit runs the recovery path.
  c.switch_step = 0
  # 'noise' only: a unit becomes a candidate when its noise fraction pi_u = EMA(e_u^2) /
  # EMA(||g_rec,u||^2) exceeds noise_upper (1/3: FP4 All the Way's sqrt(3) rule per tensor) and
  # stays one while in the mask down to noise_lower (hysteresis); gap_decay weighs the EMAs.
  c.noise_upper = 1 / 3
  c.noise_lower = 1 / 6
  # 'noise': candidates beyond the alarm, when more than max_o compete, ranked by 'pi' or by the
  # gradient-norm level ('norm': pi decides whether a unit is recovered, the norm which).
  c.noise_rank = "pi"
  # 'noise': 'unit' (a unit's own pi makes it a candidate) or 'any' (any unit's pi over
  # noise_upper makes every unit a candidate: pi decides whether to spend, noise_rank where).
  c.noise_gate = "unit"
  return c


def diagnostics_config() -> ml_collections.ConfigDict:
  """Measurements that cost extra compute (the recovery gap, which gnmr.priority='gap' ranks by)."""
  c = ml_collections.ConfigDict()
  # Every this many steps (from recovery_gap_start below), also compute the gradients of the
  # measuring pass (recovery_gap_pass below) and log the per-unit recovery gap
  # (gnmr_jax/recovery_gap.py); it feeds gnmr.priority='gap'/'relgap'/'oracle'. 0: never. Costs
  # one extra forward+backward per measurement (two for 'uniform' once the mask is not empty;
  # benchmarks/recovery_gap_overhead.py); ignored when gnmr.enabled is False.
  c.recovery_gap_every = 0
  # The first measured step (then every recovery_gap_every steps). 0: gnmr.warmup + 1, the first
  # step at which the controller selects (the mask is empty before, and a measurement at step 1,
  # from the initial params, kept picking the wrong set in the selection experiment at K=50).
  c.recovery_gap_start = 0
  # What the measuring pass runs (gnmr_jax/recovery_gap.py):
  # 'recovery': every unit recovered; units in the mask show only a residual and keep the
  #   estimate they had on the low-cost path, so with priority 'gap' the units picked by the
  #   first measurement are never re-measured: it picks a fixed set from one measurement at
  #   recovery_gap_start (a static set chosen online; later measurements only re-rank the rest).
  # 'uniform': every unit low-cost against every unit recovered (two extra passes on a step
  #   whose mask is not empty): every unit re-measured in the same context at every measurement.
  # 'swapped': each unit on the other path than in the step (one extra pass, every unit
  #   measured, a recovered unit in the context of the others recovered).
  c.recovery_gap_pass = "recovery"
  # Compute the all-recovered gradient of the measuring pass as two half batches (the same
  # FLOPs; 'recovery' and 'uniform' passes) and also log each unit's signal <g_a, g_b> and
  # sampling noise ||g_a - g_b||^2 / 4 (recovery_gap.jsonl): the two limits of the noise fraction.
  c.recovery_gap_split = False
  return c


def base_config(model: str = "tiny") -> ml_collections.ConfigDict:
  """Defaults for every group; configs/*.py override what they need."""
  config = ml_collections.ConfigDict()
  config.model = model_config(model)
  config.data = default_data_config()
  config.data.seq_len = default_seq_len(model)

  config.train = ml_collections.ConfigDict()
  # Number of optimizer steps.
  config.train.steps = 300
  # Seed for parameter init (data order has its own seed in data.seed).
  config.train.seed = 0
  # Relative perturbation of the initial params, p * (1 + init_perturbation * z) with z ~ N(0, 1)
  # drawn from the seed (0: none). ~1e-7 (one float32 ulp) measures a run's noise floor: how
  # far the same seed lands when nothing but rounding differs (experiments' '_perturb' arms).
  config.train.init_perturbation = 0.0
  # Evaluate validation loss/perplexity every this many steps (0: only at the end).
  config.train.eval_every = 100
  # Raise after this many consecutive non-finite losses (a last good checkpoint is kept).
  config.train.max_consecutive_nonfinite = 20
  # Micro-batches per optimizer step: the step runs forward and backward on data.batch_size /
  # grad_accum_steps sequences at a time (one micro-batch's activations in memory), sums the
  # gradients in float32 and updates the controller and the optimizer once, on the global
  # batch's gradient (gnmr_jax/grad_accumulation.py).
  config.train.grad_accum_steps = 1

  config.optimizer = ml_collections.ConfigDict()
  # Peak learning rate of the warmup + cosine schedule.
  config.optimizer.learning_rate = 3e-3
  # Linear warmup steps.
  config.optimizer.warmup_steps = 50
  # Final learning rate as a fraction of the peak.
  config.optimizer.min_lr_ratio = 0.1
  # After the warmup: 'cosine' decay, or 'wsd' (warmup-stable-decay: the peak, then a linear
  # decay over the last decay_fraction of the steps).
  config.optimizer.schedule = "cosine"
  config.optimizer.decay_fraction = 0.2
  # AdamW decoupled weight decay.
  config.optimizer.weight_decay = 0.1
  config.optimizer.b1 = 0.9
  config.optimizer.b2 = 0.95
  config.optimizer.eps = 1e-8
  # Global-norm clipping threshold (0 disables clipping).
  config.optimizer.grad_clip = 1.0
  # What to do with a step whose gradients are not finite: 'skip' the whole update (the controller
  # still sees the gradients and ranks the bad units first), 'zero' only the updates of the units
  # (and non-unit leaves) whose gradient is not finite, the others proceed, or 'none' (no guard).
  config.optimizer.nonfinite = "skip"

  config.gnmr = gnmr_config()
  config.precision = default_precision_config()

  config.checkpoint = ml_collections.ConfigDict()
  # Save every this many steps (0: only at the end); the run resumes from the latest in --workdir.
  config.checkpoint.every_steps = 100
  # Checkpoints kept on disk.
  config.checkpoint.max_to_keep = 2

  config.logging = ml_collections.ConfigDict()
  # Write a metrics line (JSONL, TensorBoard, progress bar) every this many steps.
  config.logging.log_every = 10
  # Log per-unit GNMR scores and the recovery mask every this many steps (0: never).
  config.logging.unit_log_every = 5
  # Write TensorBoard event files (needs tensorboardX).
  config.logging.tensorboard = True
  # Show a progress bar on stderr.
  config.logging.progress_bar = True
  # Write loss/recovery plots to <workdir>/plots at the end.
  config.logging.plots = True

  # Mesh axis sizes (data, fsdp, tensor); -1 means "all remaining devices".
  config.mesh = default_mesh_config()
  # Fault injection for reliability tests (off); see gnmr_jax/faults.py.
  config.faults = default_faults_config()
  # Extra measurements (recovery gap), off.
  config.diagnostics = diagnostics_config()
  return config


def _int(cfg, group, field, minimum):
  value = cfg[field]
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    raise ValueError(f"config.{group}.{field} must be an integer >= {minimum}, got {value!r}.")


def _choice(cfg, group, field, choices, default=None):
  """The field's value (``default`` when a config written before the field lacks it), which
  must be one of ``choices``."""
  value = cfg.get(field, default)
  if value not in choices:
    raise ValueError(f"config.{group}.{field} must be one of {list(choices)}, got {value!r}.")
  return value


def _float(cfg, group, field, minimum=0.0, inclusive=False, maximum=None):
  value = cfg[field]
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
  ok = ok and math.isfinite(value)
  ok = ok and (value >= minimum if inclusive else value > minimum)
  ok = ok and (maximum is None or value <= maximum)
  if not ok:
    bound = f"{'>=' if inclusive else '>'} {minimum}" + (f" and <= {maximum}" if maximum else "")
    raise ValueError(f"config.{group}.{field} must be a finite number {bound}, got {value!r}.")


def _check_keys(config):
  unknown = sorted(set(config.keys()) - set(GROUPS))
  if unknown:
    raise ValueError(f"config has unknown groups {unknown}; valid groups: {list(GROUPS)}.")
  missing = sorted(set(GROUPS) - set(OPTIONAL_GROUPS) - set(config.keys()))
  if missing:
    raise ValueError(f"config is missing groups {missing}.")
  reference = base_config()
  for group in ("train", "optimizer", "gnmr", "checkpoint", "logging", "diagnostics"):
    if group not in config:
      continue
    valid = set(reference[group].keys())
    if group == "gnmr":  # and the fields of priorities registered since (control.register_priority)
      valid |= set(priority_table.field_owners())
    extra = sorted(set(config[group].keys()) - valid)
    if extra:
      registered = (" (a priority's own fields are valid once it is registered: "
                    "gnmr_jax.control.register_priority)" if group == "gnmr" else "")
      raise ValueError(f"config.{group} has unknown fields {extra}; valid fields: "
                       f"{sorted(valid)}{registered}.")


def _check_unit_regexes(config):
  """gnmr.units / gnmr.layer_axis compile, and under precision.mode='gnmr' select every
  projection kernel, layer-stacked (the routed model reads one mask bit per projection and layer)."""
  for field in ("units", "layer_axis"):
    check_regex(f"config.gnmr.{field}", config.gnmr[field],
                "a regex string ('' for the default)")
  if config.precision.mode != "gnmr":
    return
  paths = [f"layers/{group}/{name}/kernel" for group, names in PROJECTIONS.items()
           for name in names]
  for field in ("units", "layer_axis"):
    value = config.gnmr[field]
    missed = [p for p in paths if value and not re.search(value, p)]
    if field == "layer_axis" and not value:
      missed = paths
    if missed:
      raise ValueError(f"config.gnmr.{field}={value!r} must match every projection kernel when "
                       f"config.precision.mode='gnmr' (the routed model reads one recovery bit "
                       f"per projection and layer); it misses {missed}.")


def _check_finite(config):
  """No float field of any group may be NaN or +-Inf, and no integer field may hold a bool
  (ConfigDict lets True into an int field); the group validators check ranges."""
  reference = base_config()
  for group in config.keys():
    for field, value in config[group].items():
      if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"config.{group}.{field} must be a finite number, got {value!r}.")
      default = reference[group].get(field) if group in reference else None
      if isinstance(value, bool) and isinstance(default, int) and not isinstance(default, bool):
        raise ValueError(f"config.{group}.{field} must be an integer, got {value!r}.")


def _validate_train_and_optimizer(config: ml_collections.ConfigDict) -> None:
  t, o = config.train, config.optimizer
  _int(t, "train", "steps", 1)
  _int(t, "train", "seed", 0)
  _int(t, "train", "eval_every", 0)
  if "init_perturbation" in t:
    _float(t, "train", "init_perturbation", 0.0, inclusive=True, maximum=1.0)
  _int(t, "train", "max_consecutive_nonfinite", 1)
  if "grad_accum_steps" in t:
    _int(t, "train", "grad_accum_steps", 1)
    if config.data.batch_size % t.grad_accum_steps:
      raise ValueError(f"config.train.grad_accum_steps={t.grad_accum_steps} must divide "
                       f"config.data.batch_size={config.data.batch_size} (equal micro-batches).")
  _float(o, "optimizer", "learning_rate")
  _int(o, "optimizer", "warmup_steps", 0)
  _float(o, "optimizer", "min_lr_ratio", 0.0, inclusive=True, maximum=1.0)
  _choice(o, "optimizer", "schedule", SCHEDULES, "cosine")
  if "decay_fraction" in o:
    _float(o, "optimizer", "decay_fraction", 0.0, maximum=1.0)
  _float(o, "optimizer", "weight_decay", 0.0, inclusive=True)
  _float(o, "optimizer", "b1", 0.0, inclusive=True, maximum=1.0)
  _float(o, "optimizer", "b2", 0.0, inclusive=True, maximum=1.0)
  _float(o, "optimizer", "eps")
  _float(o, "optimizer", "grad_clip", 0.0, inclusive=True)
  _choice(o, "optimizer", "nonfinite", NONFINITE_POLICIES)


def _validate_controller(config: ml_collections.ConfigDict) -> None:
  """config.gnmr: the shared fields, the priority's own (the priority table's checks) and what
  the priority and the routed mode need elsewhere in the config."""
  g = config.gnmr
  if not isinstance(g.enabled, bool):
    raise ValueError(f"config.gnmr.enabled must be True or False, got {g.enabled!r}.")
  _float(g, "gnmr", "alpha")
  _float(g, "gnmr", "beta")
  _int(g, "gnmr", "delta", 1)
  _int(g, "gnmr", "max_o", 0)
  if g.t_lock is not None:
    _int(g, "gnmr", "t_lock", 0)
  _int(g, "gnmr", "warmup", 0)
  # A config written before priorities existed means the paper's rule (as optim reads it).
  priority = _choice(g, "gnmr", "priority", priority_table.names(), "gnmr")
  if "gap_decay" in g:
    _float(g, "gnmr", "gap_decay", 0.0, inclusive=True)
  if g.get("gap_decay", 0.0) >= 1:
    raise ValueError(f"config.gnmr.gap_decay must be in [0, 1), got {g.gap_decay!r}.")
  entry = priority_table.get(priority)
  options_of(g)  # the priority's own fields (the table's checks)
  check_priority_fields(g)  # a field that only another priority reads would be ignored
  if entry.check_config is not None:
    entry.check_config(config)
  gap_every = config.diagnostics.recovery_gap_every if "diagnostics" in config else 0
  _validate_diagnostics(config)
  if g.enabled and entry.reads_gap and not gap_every:
    raise ValueError(f"config.gnmr.priority={priority!r} ranks units by a measured recovery "
                     "gap: set config.diagnostics.recovery_gap_every to K > 0 (measure every K "
                     "steps).")
  if config.precision.mode == "gnmr" and not g.enabled:
    raise ValueError("config.precision.mode='gnmr' needs config.gnmr.enabled=True "
                     "(the recovery mask comes from the controller).")
  units = config.precision.side_buffer_units
  if config.precision.mode == "gnmr" and isinstance(units, int) and 0 < units < g.max_o:
    raise ValueError(f"config.precision.side_buffer_units={units} < config.gnmr.max_o="
                     f"{g.max_o}: recoveries beyond the buffer would run the low-cost path; "
                     "use 0 (= max_o) or at least max_o.")


def _validate_diagnostics(config: ml_collections.ConfigDict) -> None:
  if "diagnostics" not in config:
    return
  _int(config.diagnostics, "diagnostics", "recovery_gap_every", 0)
  if "recovery_gap_start" in config.diagnostics:
    _int(config.diagnostics, "diagnostics", "recovery_gap_start", 0)
  gap_pass = config.diagnostics.get("recovery_gap_pass", "recovery")
  split = config.diagnostics.get("recovery_gap_split", False)
  if not isinstance(split, bool):
    raise ValueError(f"config.diagnostics.recovery_gap_split must be True or False, got "
                     f"{split!r}.")
  accum = config.train.get("grad_accum_steps", 1)
  if split and config.data.batch_size % (2 * accum):
    raise ValueError(f"config.diagnostics.recovery_gap_split accumulates each half batch over "
                     f"config.train.grad_accum_steps={accum} micro-batches: "
                     f"config.data.batch_size={config.data.batch_size} must be a multiple of "
                     f"{2 * accum}.")
  if split and gap_pass == "swapped":
    raise ValueError("config.diagnostics.recovery_gap_split splits the all-recovered pass: "
                     "use recovery_gap_pass 'recovery' or 'uniform', not 'swapped'.")
  _choice(config.diagnostics, "diagnostics", "recovery_gap_pass", GAP_PASSES, gap_pass)


def _validate_checkpoint_and_logging(config: ml_collections.ConfigDict) -> None:
  c, lg = config.checkpoint, config.logging
  _int(c, "checkpoint", "every_steps", 0)
  _int(c, "checkpoint", "max_to_keep", 1)
  _int(lg, "logging", "log_every", 1)
  _int(lg, "logging", "unit_log_every", 0)
  for field in ("tensorboard", "progress_bar", "plots"):
    if not isinstance(lg[field], bool):
      raise ValueError(f"config.logging.{field} must be True or False, got {lg[field]!r}.")


def validate_config(config: ml_collections.ConfigDict, device_count: int = 0) -> None:
  """Checks every field before anything is built or traced. Raises ValueError naming the field."""
  _check_keys(config)
  _check_finite(config)
  validate_model_config(config.model)
  validate_data_config(config.data)
  validate_precision(config.precision)
  _validate_train_and_optimizer(config)
  _validate_controller(config)
  _check_unit_regexes(config)
  _validate_checkpoint_and_logging(config)
  extra = sorted(set(config.mesh.keys()) - set(MESH_FIELDS))
  if extra:
    raise ValueError(f"config.mesh has unknown fields {extra}; valid fields: {list(MESH_FIELDS)}.")
  mesh_shape(config.mesh, device_count or jax.device_count())
  mesh_axis_types(config.mesh)
  if "faults" in config:
    validate_faults_config(config.faults)
  if config.data.seq_len > config.model.max_seq_len:
    raise ValueError(f"config.data.seq_len ({config.data.seq_len}) exceeds "
                     f"config.model.max_seq_len ({config.model.max_seq_len}).")
