"""Which low-cost path suits the device: int8 on TPUs, fp8 on GPUs with fp8 tensor cores."""

from __future__ import annotations

import jax

from gnmr_jax.precision import native_microscaling

# Device names of GPUs with fp8 tensor cores, for runtimes that report no CUDA capability.
FP8_GPU_NAMES = ("H100", "H200", "H800", "H20", "L4", "L40", "Ada", "RTX 40", "RTX 50",
                 "B100", "B200", "GB200", "Blackwell")


def default_low_cost_path(device=None) -> str:
  """'fp8' on GPUs with fp8 tensor cores (CUDA compute capability >= 8.9), else 'int8'.

  int8 is the TPU low-cost path (int8 MXU) and the portable choice elsewhere (older GPUs, CPU,
  where XLA has no fast low-precision matmul and both are simulated).

  Args:
    device: a jax Device (default: jax.devices()[0]).

  Returns:
    A registered path name for ``config.precision.low_cost_path``.

  Example:
    >>> import jax
    >>> from gnmr_jax.precision import default_low_cost_path
    >>> default_low_cost_path(jax.devices('cpu')[0])
    'int8'
  """
  device = device if device is not None else jax.devices()[0]
  if device.platform not in ("gpu", "cuda", "rocm"):
    return "int8"
  capability = native_microscaling.compute_capability(device)
  if capability is None:  # no CUDA capability (e.g. ROCm 'gfx942'): go by the device name
    return "fp8" if any(n in device.device_kind for n in FP8_GPU_NAMES) else "int8"
  return "fp8" if capability >= (8, 9) else "int8"
