"""Device constants the step-time model prices kernels with, one row per accelerator, each sourced.

Rates are dense (no structured sparsity) peak FLOP/s (int8: OP/s) per device by GEMM operand
class: 'bf16', 'f32' (what XLA runs a float32 GEMM as at DEFAULT precision: TF32 on an NVIDIA
tensor core, one bf16 pass on a TPU MXU), 'fp8', 'int8', 'fp4' (NVFP4, block-scaled) and
'mxfp8' (MXFP8, block-scaled). A class a device lacks is absent from `datasheet`.

The rates the model uses are `rate(cls)`: the H200's measured GEMM rates where they exist (the
'calibrated' column: ../shared/reference/gpu-anchors.md, raw jitted GEMMs at 8192^3 and
16384x4096x11008, the two shapes' mean), elsewhere the datasheet rate times the H200's measured
fraction of its datasheet rate (`H200_EFFICIENCY`: for that class on a GPU, bf16's for every
class on a TPU), so every other chip carries the H200's GEMM efficiency: an assumption, named in
the output.
Nothing here is fitted to a step time; the one fitted constant lives in step_time.py.

Example:
  >>> spec = get_spec('h200')
  >>> round(spec.rate('fp8') / 1e12, 1), spec.memory_bandwidth / 1e12
  (877.5, 4.8)
  >>> round(get_spec('h100').rate('int8') / 1e12, 1)
  855.0
"""

from __future__ import annotations

import dataclasses
import re

T = 1e12
GEMM_CLASSES = ('bf16', 'f32', 'fp8', 'int8', 'fp4', 'mxfp8')

_NVIDIA_H100 = ('NVIDIA H100 Tensor Core GPU datasheet (SXM5; dense = half the sparsity '
                'figures), https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet')
_NVIDIA_H200 = ('NVIDIA H200 Tensor Core GPU datasheet (SXM; dense = half the sparsity figures), '
                'https://www.nvidia.com/en-us/data-center/h200/')
_NVIDIA_B200 = ('NVIDIA DGX B200 / HGX B200 datasheet, per GPU (dense = half the sparsity '
                'figures), https://www.nvidia.com/en-us/data-center/dgx-b200/')
_TPU_V5P = 'Cloud TPU v5p system architecture, https://cloud.google.com/tpu/docs/v5p'
_TPU_V6E = 'Cloud TPU v6e (Trillium) system architecture, https://cloud.google.com/tpu/docs/v6e'
_TPU_V5E = 'Cloud TPU v5e system architecture, https://cloud.google.com/tpu/docs/v5e'
_ANCHORS = ('measured on one H200, jax 0.11.2, 2026-11-29: ../shared/reference/gpu-anchors.md '
            '(probes/gpu_anchor.py), mean of 8192^3 and 16384x4096x11008')
_LAUNCH_GPU = ('assumed: ~2 us per kernel, a CUDA launch inside a CUDA graph / XLA command '
               'buffer (no anchor measures it)')
_LAUNCH_TPU = 'assumed: 0; a TPU program is one executable, fusions are not launched from the host'

# The H200's measured GEMM rates (TFLOP/s or TOP/s): (8192^3, 16384x4096x11008).
H200_MEASURED = {'bf16': (595., 633.), 'fp8': (778., 977.), 'int8': (756., 954.)}


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """One accelerator's constants.

  Attributes:
    name: the gnmr_jax.aot target kind ('h200', 'v5p').
    platform: 'gpu' or 'tpu'.
    datasheet: GEMM class -> dense peak FLOP/s per device.
    memory_bandwidth: HBM bytes/s per device (datasheet).
    interconnect_bandwidth: bytes/s per device to its peers (NVLink / ICI, datasheet).
    launch_s: seconds added per kernel launch.
    sources: field -> where its value comes from.
    calibrated: GEMM class -> measured FLOP/s on this very chip (H200 only).
    native_classes: GEMM classes the chip runs natively; another class is priced at the bf16
      rate (what the compiled program then runs: XLA converts the operands).
  """
  name: str
  platform: str
  datasheet: dict
  memory_bandwidth: float
  interconnect_bandwidth: float
  launch_s: float
  sources: dict
  calibrated: dict = dataclasses.field(default_factory=dict)

  def rate(self, cls: str) -> float:
    """FLOP/s the model uses for a GEMM of operand class `cls`."""
    if cls not in GEMM_CLASSES:
      raise ValueError(f'GEMM class must be one of {GEMM_CLASSES}, got {cls!r}')
    if cls in self.calibrated:
      return self.calibrated[cls]
    if cls not in self.datasheet:
      cls = 'bf16'
      if cls in self.calibrated:
        return self.calibrated[cls]
    return self.datasheet[cls] * self.efficiency(cls)

  def efficiency(self, cls: str) -> float:
    """The fraction of the datasheet rate assumed reached: the H200's measured one for the
    class on an NVIDIA GPU (the same libraries), its bf16 one for every class on a TPU (the
    H200's low int8 / fp8 fractions are Hopper's, nothing says a TPU MXU shares them)."""
    return H200_EFFICIENCY['bf16' if self.platform == 'tpu' else cls]

  def rate_source(self, cls: str) -> str:
    if cls in self.calibrated:
      return 'calibrated (measured on this chip)'
    if cls not in self.datasheet:
      return 'not native: bf16 rate'
    return f'datasheet x H200 efficiency {self.efficiency(cls):.3f}'


def _gpu(name, bf16, tf32, fp8, int8, bandwidth, link, source, fp4=None):
  datasheet = {'bf16': bf16 * T, 'f32': tf32 * T, 'fp8': fp8 * T, 'int8': int8 * T}
  if fp4:
    datasheet.update(fp4=fp4 * T, mxfp8=fp8 * T)
  return DeviceSpec(name, 'gpu', datasheet, bandwidth * T, link * 1e9, 2e-6, {
      'datasheet': source, 'memory_bandwidth': source, 'interconnect_bandwidth': source,
      'launch_s': _LAUNCH_GPU, 'f32': 'TF32 dense (XLA runs f32 GEMMs at DEFAULT precision as '
      'TF32 on tensor cores)'})


def _tpu(name, bf16, int8, bandwidth, link_gbps, source):
  return DeviceSpec(name, 'tpu', {'bf16': bf16 * T, 'f32': bf16 * T, 'int8': int8 * T},
                    bandwidth * 1e9, link_gbps / 8 * 1e9, 0.0, {
                        'datasheet': source, 'memory_bandwidth': source,
                        'interconnect_bandwidth': source + ' (ICI Gbps per chip / 8)',
                        'launch_s': _LAUNCH_TPU,
                        'f32': 'one bf16 MXU pass (DEFAULT precision on TPU)'})


SPECS = {
    'h100': _gpu('h100', 989.4, 494.7, 1978.9, 1978.9, 3.35, 900, _NVIDIA_H100),
    'h200': dataclasses.replace(
        _gpu('h200', 989.4, 494.7, 1978.9, 1978.9, 4.8, 900, _NVIDIA_H200),
        calibrated={cls: sum(v) / len(v) * T for cls, v in H200_MEASURED.items()}),
    'b200': _gpu('b200', 2250., 1100., 4500., 4500., 8.0, 1800, _NVIDIA_B200, fp4=9000.),
    'v5p': _tpu('v5p', 459., 918., 2765., 4800., _TPU_V5P),
    'v6e': _tpu('v6e', 918., 1836., 1640., 3584., _TPU_V6E),
    'v5e': _tpu('v5e', 197., 394., 819., 1600., _TPU_V5E),
}
SPECS['h200'].sources['calibrated'] = _ANCHORS
# measured / datasheet on the H200 per class; f32 (TF32, unmeasured) takes bf16's, the
# block-scaled classes fp8's: assumptions, printed as such.
H200_EFFICIENCY = {cls: SPECS['h200'].calibrated[cls] / SPECS['h200'].datasheet[cls]
                   for cls in H200_MEASURED}
H200_EFFICIENCY.update(f32=H200_EFFICIENCY['bf16'], fp4=H200_EFFICIENCY['fp8'],
                       mxfp8=H200_EFFICIENCY['fp8'])


def get_spec(target: str) -> DeviceSpec:
  """The spec of a gnmr_jax.aot target name ('h200', 'h100:8', 'v5p-8', 'v6e-4').

  Raises:
    ValueError: no spec for that accelerator, listing those there are.
  """
  kind = re.match(r'[a-z0-9]+?(?=$|:|-)', target or '')
  if not kind or kind.group(0) not in SPECS:
    raise ValueError(f'no device spec for target {target!r}; specs: {sorted(SPECS)}')
  return SPECS[kind.group(0)]


def table() -> list[str]:
  """The constants as markdown rows (TFLOP/s, TB/s, GB/s, us) with their sources."""
  lines = ['| device | ' + ' | '.join(f'{c} TFLOP/s datasheet / model' for c in GEMM_CLASSES)
           + ' | HBM TB/s | link GB/s | launch us | sources |', '|' + '---|' * 11]
  for name, spec in SPECS.items():
    cells = []
    for cls in GEMM_CLASSES:
      sheet = spec.datasheet.get(cls)
      cells.append(f"{sheet / T:.0f} / {spec.rate(cls) / T:.0f}" if sheet
                   else f"- / {spec.rate(cls) / T:.0f}")
    sources = '; '.join(sorted({spec.sources['datasheet'], spec.sources.get('calibrated', '')}
                               - {''}))
    lines.append(f"| {name} | {' | '.join(cells)} | {spec.memory_bandwidth / T:.2f} "
                 f"| {spec.interconnect_bandwidth / 1e9:.0f} | {spec.launch_s * 1e6:.0f} "
                 f"| {sources} |")
  return lines
