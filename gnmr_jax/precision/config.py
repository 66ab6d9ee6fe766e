"""Precision config: the defaults and their up-front validation."""

from __future__ import annotations

import ml_collections

from gnmr_jax.precision import microscaling, native_microscaling, registry, saved_activation
from gnmr_jax.precision import scaling

MODES = ('static', 'gnmr')
RECOVERY_STORAGE = ('side_buffer', 'per_unit')


def default_precision_config() -> ml_collections.ConfigDict:
  """Default precision config (GNMR routing between int8 and bf16).

  ``mode='static', low_cost_path='bf16'`` is the bf16 reference.

  Returns:
    A ``ConfigDict``; ``make_policy`` validates it.
  """
  config = ml_collections.ConfigDict()
  # 'static': every unit runs low_cost_path; 'gnmr': each unit runs
  # lax.cond(recover, recovery_path, low_cost_path) on its recovery-mask bit.
  config.mode = 'gnmr'
  # Registered path for units that are not recovered: 'bf16', 'int8', 'fp8',
  # 'saved_activation', 'blockwise', 'mxfp8', 'nvfp4', or any name given to
  # register_path.
  config.low_cost_path = 'int8'
  # Registered path for recovered units (mode='gnmr' only). With
  # low_cost_path='saved_activation', use 'saved_activation' here to store the
  # recovered units at recovery_saved_activation_bits in the same residual slots.
  # With low_cost_path='nvfp4' ('mxfp8'), 'nvfp4_backward' ('mxfp8_backward'): bf16 forward,
  # FP4 (FP8) backward, makes a 'late_switch' controller NVIDIA's forward-only late switch.
  config.recovery_path = 'bf16'
  # How the int8 and fp8 paths scale their operands (scaling.SCALINGS): 'row' (one absmax
  # scale per row of each leg's lhs and column of its rhs, current: the most precise; six
  # operands quantized per unit and step), 'tensor' (one current scale per tensor, each of x,
  # W and the output gradient quantized once per step; fp8: the scale folded into the GEMM) or
  # 'delayed' (per tensor, from the unit's amax history: the casts fuse into the operands'
  # producers; a tensor whose amax jumps past its history saturates for that step), or 'auto'
  # (per low-cost path and platform, scaling.AUTO_BY_PLATFORM, resolved where the policy is
  # built and recorded in the run's config).
  config.scaling = 'row'
  # Steps of amax history a unit keeps for scaling='delayed' (Transformer Engine's
  # amax_history_len): each operand's scale comes from the largest amax of its last
  # amax_history_length steps.
  config.amax_history_length = 16
  # Bits of the saved activation on the low-cost saved_activation path (2..8).
  config.saved_activation_bits = 4
  # Bits of the saved activation on the recovery saved_activation path (2..8,
  # or 16 for the exact bf16 value).
  config.recovery_saved_activation_bits = 8
  # Stochastic instead of round-to-nearest codes for saved activations.
  config.stochastic_rounding = False
  # Absmax scale of saved activations: 'token' (one per row) or 'tensor' (one
  # per activation tensor: outlier tokens flatten the others; a harsher stress).
  config.saved_activation_scale = 'token'
  # Also compute the forward of the saved_activation path from the k-bit
  # activation (the error then reaches the loss and the input gradient of the
  # earlier layers, and compounds across layers; a harsher stress).
  config.saved_activation_forward = False
  # NVFP4 path (low_cost_path='nvfp4'): True quantizes the forward matmul only
  # and runs both backward matmuls in bf16 (the recovery precision).
  config.nvfp4_forward_only = False
  # NVFP4 paths: rounding of the incoming gradient in the backward matmuls,
  # 'stochastic' (unbiased; the noise is keyed by the gradient's bits) or
  # 'nearest'. The 'nvfp4' path ignores it when nvfp4_forward_only; the
  # 'nvfp4_backward' path (bf16 forward, NVFP4 backward) always reads it and
  # ignores nvfp4_forward_only.
  config.nvfp4_gradient_rounding = 'stochastic'
  # How the NVFP4 / MXFP8 paths multiply their block-scaled operands: 'emulated' (the values
  # into a bf16 x bf16 -> float32 dot, any backend), 'native' (the same codes and scales into
  # one cuDNN block-scaled GEMM: GPUs of compute capability >= 10 only, refused elsewhere) or
  # 'auto' (native where the devices run it natively). Same numerics up to the order of the
  # float32 accumulation (native_microscaling.py); training records the resolved choice.
  config.microscaling_impl = 'auto'
  # Bits of the integer grid of the blockwise (DeepSeek-V3-style) path (2..8).
  config.block_bits = 8
  # Tile length (activations, 1 x block_size) and block side (weights,
  # block_size x block_size) of the blockwise path.
  config.block_size = 128
  # How many layers a scanned model unrolls per loop iteration when routed: 0 = all of them
  # (no loop), k = groups of k, -1 = per backend (policy.ROUTED_SCAN_UNROLL_BY_PLATFORM): GPU
  # and CPU unroll fully (conditionals inside a scanned loop cost +14..18% step time on an
  # H200, unrolled +0.3%), TPU keeps the loop rolled (for v5e at 1B it compiles in the static
  # step's time, unrolled in 2.15x; TPU conditionals run on the chip). Read it through
  # policy.scan_unroll(L, platform).
  config.routed_scan_unroll = -1
  # Where routed units keep the recovery path's residuals. 'side_buffer': each
  # unit keeps only the low-cost residuals and recovered units append theirs to
  # one buffer for side_buffer_units units (bytes = static low-cost + that
  # buffer); 'per_unit': every unit has slots for both paths (bytes = the
  # larger path's for every unit). Same numerics.
  config.recovery_storage = 'side_buffer'
  # Recovered units the side buffer holds; 0 = the controller's max_o (the
  # training pipeline passes gnmr.max_o to make_policy).
  config.side_buffer_units = 0
  return config


def _check_choice(config, field, valid):
  value = config[field]
  if value not in valid:
    raise ValueError(f'precision config field {field!r} must be one of {tuple(valid)}, '
                     f'got {value!r}.')


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first invalid field and its allowed values."""
  required = tuple(default_precision_config().keys())
  missing = [f for f in required if f not in config]
  if missing:
    raise ValueError(f'precision config is missing fields {missing}; required: {required}.')
  _check_choice(config, 'mode', MODES)
  _check_choice(config, 'low_cost_path', registry.available_paths())
  _check_choice(config, 'recovery_path', registry.available_paths())
  _check_choice(config, 'scaling', scaling.config_values())
  if (isinstance(config.amax_history_length, bool) or not isinstance(config.amax_history_length,
                                                                      int)
      or config.amax_history_length < 1):
    raise ValueError("precision config field 'amax_history_length' must be an int >= 1, got "
                     f'{config.amax_history_length!r}.')
  _check_choice(config, 'saved_activation_bits', tuple(range(2, 9)))
  _check_choice(config, 'recovery_saved_activation_bits', saved_activation.VALID_BITS)
  _check_choice(config, 'stochastic_rounding', (False, True))
  _check_choice(config, 'saved_activation_scale', saved_activation.SCALES)
  _check_choice(config, 'saved_activation_forward', (False, True))
  _check_choice(config, 'nvfp4_forward_only', (False, True))
  _check_choice(config, 'nvfp4_gradient_rounding', microscaling.ROUNDINGS)
  _check_choice(config, 'microscaling_impl', native_microscaling.IMPLS)
  _check_choice(config, 'block_bits', tuple(range(2, 9)))
  if not isinstance(config.block_size, int) or config.block_size < 1:
    raise ValueError(f"precision config field 'block_size' must be a positive int, "
                     f'got {config.block_size!r}.')
  _check_choice(config, 'recovery_storage', RECOVERY_STORAGE)
  if not isinstance(config.side_buffer_units, int) or config.side_buffer_units < 0:
    raise ValueError("precision config field 'side_buffer_units' must be an int >= 0 "
                     f'(0 = the controller\'s max_o), got {config.side_buffer_units!r}.')
  if (isinstance(config.routed_scan_unroll, bool) or not isinstance(config.routed_scan_unroll, int)
      or config.routed_scan_unroll < -1):
    raise ValueError("precision config field 'routed_scan_unroll' must be an int >= -1 "
                     f'(0 = fully unrolled, -1 = per backend), got {config.routed_scan_unroll!r}.')
