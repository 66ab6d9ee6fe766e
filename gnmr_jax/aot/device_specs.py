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

Flash-attention kernels (cuDNN's fused attention, Pallas splash attention) are priced apart, at
`attention_rate`: the datasheet bf16 rate times the fraction of it a published benchmark of that
kernel reached on that device (`ATTENTION_EFFICIENCY`, by key length), or the nearest published
one where none exists (said so in the entry). No measurement in this project anchors them.

Example:
  >>> spec = get_spec('h200')
  >>> round(spec.rate('fp8') / 1e12, 1), spec.memory_bandwidth / 1e12
  (877.5, 4.8)
  >>> round(get_spec('h100').rate('int8') / 1e12, 1)
  855.0
"""

from __future__ import annotations

import dataclasses
import math
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

  def attention_rate(self, kernel: str, backward: bool, seq_len: int) -> float:
    """FLOP/s the model uses for a flash-attention kernel ('cudnn', 'splash') over `seq_len`
    keys: the datasheet bf16 rate times `attention_efficiency`'s published fraction.

    Raises:
      ValueError: no ATTENTION_EFFICIENCY entry for this device and kernel.
    """
    return self.datasheet['bf16'] * attention_efficiency(self.name, kernel).at(backward, seq_len)

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


@dataclasses.dataclass(frozen=True)
class AttentionEfficiency:
  """The fraction of a device's datasheet bf16 rate one flash-attention kernel reaches.

  FLOPs counted as the benchmarks count them: 4 * B * H * S * T * D forward, 2.5x that backward,
  halved when causal (inventory.FlashKernel counts a kernel's the same way, so time =
  flops / (efficiency * datasheet bf16 rate)).

  Attributes:
    device: the SPECS name.
    kernel: 'cudnn' or 'splash' (inventory.FlashKernel.kernel).
    seq_lens: key lengths the fractions were read at, ascending.
    forward, backward: the fraction at each of seq_lens (a splash dq / dkv kernel takes the
      backward one); between two lengths interpolated in log2(length), outside them the
      nearest end's (a shorter sequence than the shortest benchmarked runs slower still: the
      model is optimistic there).
    source: where the numbers come from (URL, figure, values), "assumed: ..." for what no
      publication gives.
  """
  device: str
  kernel: str
  seq_lens: tuple
  forward: tuple
  backward: tuple
  source: str

  def at(self, backward: bool, seq_len: int) -> float:
    """The fraction for a key length `seq_len`."""
    values = self.backward if backward else self.forward
    if seq_len <= self.seq_lens[0]:
      return values[0]
    for (s0, v0), (s1, v1) in zip(zip(self.seq_lens, values),
                                  zip(self.seq_lens[1:], values[1:])):
      if seq_len <= s1:
        w = (math.log2(seq_len) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
        return v0 + w * (v1 - v0)
    return values[-1]


# FlashAttention-3 (Shah et al. 2024, arXiv 2407.08608), H100 80GB SXM5, BF16, head dim 128,
# B * S = 16k tokens, 2048 hidden: cuDNN's TFLOP/s at S = 512 ... 16k. Forward: Figure 5 panel
# (d) "Forward, with causal mask, head dim 128" (the image is
# github.com/Dao-AILab/flash-attention/blob/main/assets/flash3_fp16_fwd.png). Backward: the
# backward-speed figure's head dim 128 panel, without causal mask (the paper shows no causal
# backward).
_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
_H100_CUDNN_FWD_CAUSAL_TFLOPS = (315., 410., 484., 518., 529., 539.)
_H100_CUDNN_BWD_TFLOPS = (305., 408., 465., 499., 518., 516.)
_H100_BF16_TFLOPS = SPECS['h100'].datasheet['bf16'] / T
_FA3 = ('FlashAttention-3 paper (Shah et al. 2024), https://arxiv.org/abs/2407.08608: H100 SXM5 '
        'BF16 head dim 128, cuDNN TFLOP/s at S = 512..16k / 989.4 datasheet; forward: Fig. 5(d) '
        '"Forward, with causal mask, head dim 128" = 315, 410, 484, 518, 529, 539 (image: '
        'https://github.com/Dao-AILab/flash-attention/blob/main/assets/flash3_fp16_fwd.png); '
        'backward: the backward-speed figure, head dim 128 (no causal mask: the paper has no '
        'causal backward) = 305, 408, 465, 499, 518, 516')
# Splash on v5p: marin-community/marin PR 6330 (levanter splash prefix-LM masks, 2026-06-13),
# "static_causal_splash", 8192 tokens, B = 1, 8 heads, head dim 128: 0.778 ms per layer (median
# of a 20-layer stack). 4 * 8 * 8192^2 * 128 / 2 FLOPs in 0.778 ms = 176.7 TFLOP/s (as a forward
# pass: forward and backward would be above the chip's peak).
_V5P_SPLASH_FWD_CAUSAL_8K = (4 * 8 * 8192 ** 2 * 128 / 2 / 0.778e-3
                             / SPECS['v5p'].datasheet['bf16'])
_SPLASH_V5P = (
    'marin-community/marin PR 6330, https://github.com/marin-community/marin/pull/6330 (v5p, '
    'static causal splash, 8192 tokens, B=1, 8 heads, head dim 128: 0.778 ms per layer, 20-layer '
    'median) = 176.7 TFLOP/s forward = 0.385 of 459 at S = 8192; assumed: the forward / backward '
    'and sequence-length dependence of the H100 cuDNN curves (FA3 paper figures, scaled by 0.385 '
    '/ 0.535 at 8192): no splash backward or short-sequence figure is published')


def _fractions(tflops, peak, scale=1.0):
  return tuple(scale * t / peak for t in tflops)


def _h100_cudnn(device: str, note: str = '') -> AttentionEfficiency:
  return AttentionEfficiency(
      device, 'cudnn', _SEQ_LENS, _fractions(_H100_CUDNN_FWD_CAUSAL_TFLOPS, _H100_BF16_TFLOPS),
      _fractions(_H100_CUDNN_BWD_TFLOPS, _H100_BF16_TFLOPS), (note + _FA3) if note else _FA3)


def _splash(device: str, note: str = '') -> AttentionEfficiency:
  scale = _V5P_SPLASH_FWD_CAUSAL_8K / (_H100_CUDNN_FWD_CAUSAL_TFLOPS[4] / _H100_BF16_TFLOPS)
  return AttentionEfficiency(
      device, 'splash', _SEQ_LENS,
      _fractions(_H100_CUDNN_FWD_CAUSAL_TFLOPS, _H100_BF16_TFLOPS, scale),
      _fractions(_H100_CUDNN_BWD_TFLOPS, _H100_BF16_TFLOPS, scale), note + _SPLASH_V5P)


ATTENTION_EFFICIENCY = {(e.device, e.kernel): e for e in (
    _h100_cudnn('h100'),
    _h100_cudnn('h200', 'assumed: the H100\'s (same tensor cores and bf16 peak; flash attention '
                'at these shapes is compute-bound, the H200\'s faster HBM does not change it); '),
    _h100_cudnn('b200', 'assumed: the H100\'s fractions (no cuDNN-on-B200 figure by sequence '
                'length found; FlashAttention-4, https://github.com/Dao-AILab/flash-attention '
                'assets/fa4_paper.pdf, reports 1613 TFLOP/s = 71% of peak on B200 BF16 and up to '
                '1.3x over cuDNN 9.13, i.e. cuDNN at >= ~0.55 of 2250 at its best shapes, '
                'consistent with the H100\'s 0.54 at 16k); '),
    _splash('v5p'),
    _splash('v5e', 'assumed: the v5p\'s (no splash figure published for v5e); '),
    _splash('v6e', 'assumed: the v5p\'s (no splash figure published for v6e; its 256x256 MXU is '
            'half filled by head dim 128, which may lower it); '),
)}


def attention_efficiency(device: str, kernel: str) -> AttentionEfficiency:
  """The ATTENTION_EFFICIENCY entry of a SPECS device and a flash-attention kernel.

  Raises:
    ValueError: none, listing those there are.
  """
  entry = ATTENTION_EFFICIENCY.get((device, kernel))
  if entry is None:
    raise ValueError(f'no attention efficiency for kernel {kernel!r} on {device!r}; entries: '
                     f'{sorted(ATTENTION_EFFICIENCY)}')
  return entry


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


def attention_table() -> list[str]:
  """ATTENTION_EFFICIENCY as markdown rows: the forward / backward fraction of the datasheet
  bf16 rate at each benchmarked key length, and the source."""
  lines = ['| device | kernel | ' + ' | '.join(f'S={n}' for n in _SEQ_LENS)
           + ' | source |', '|' + '---|' * (3 + len(_SEQ_LENS))]
  for entry in ATTENTION_EFFICIENCY.values():
    cells = [f'{entry.at(False, n):.2f} / {entry.at(True, n):.2f}' for n in _SEQ_LENS]
    lines.append(f"| {entry.device} | {entry.kernel} | {' | '.join(cells)} | {entry.source} |")
  return lines
