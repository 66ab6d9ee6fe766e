"""A step-time model of a compiled program: a roofline over the kernels the device would launch.

Each kernel of the optimized HLO (inventory.kernels: fusions, library GEMMs, copies,
collectives, conditionals) is priced on a device (device_specs.DeviceSpec):

  GEMM        max(flops / rate[operand class], bytes / HBM bandwidth) + launch
  attention   max(flops / attention rate, bytes / HBM bandwidth) + launch   (a flash-attention
              kernel: cuDNN's fused attention, Pallas splash; device_specs.attention_rate: the
              datasheet bf16 rate times a published efficiency for the kernel, no anchor)
  other       bytes / HBM bandwidth + launch            (fusions, copies, reductions)
  collective  bytes / interconnect bandwidth (x2 for an all-reduce) + launch
  conditional launch, + `cond_in_loop_s` per execution inside a while loop (GPU; fitted)
  TPU prefetch nothing (copy-start / slice-start into on-chip memory overlap; the consumer's
              operands are priced)

times its executions per step (loop trip counts multiplied). A kernel under conditionals counts
with the share of executions that take its branches: `recovered` is the share of conditional
executions that take branch 1 (the recovery path of a routed unit), so 0 is a routed step with
nothing recovered and max_o / units a step recovering max_o units (every unit alike).

The total is a sum: kernels never overlap in the model (a GPU stream runs them in order; a TPU
program may overlap collectives with compute, which the model does not credit).

Example:
  >>> from gnmr_jax.aot import device_specs, inventory
  >>> hlo = '''HloModule m
  ... ENTRY %main (a: f8e4m3fn[4096,4096], b: f8e4m3fn[4096,4096]) -> bf16[4096,4096] {
  ...   %a = f8e4m3fn[4096,4096]{1,0} parameter(0)
  ...   %b = f8e4m3fn[4096,4096]{1,0} parameter(1)
  ...   ROOT %d = bf16[4096,4096]{1,0} custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}}
  ... }'''
  >>> kernels = summarize(inventory.parse(hlo))
  >>> t = price(kernels, device_specs.get_spec('h200'))
  >>> round(t.total_s * 1e6, 1), round(t.by_category['gemm fp8'] * 1e6, 1), t.launches
  (158.6, 156.6, 1.0)
"""

from __future__ import annotations

import collections
import dataclasses
import re

from gnmr_jax.aot import device_specs
from gnmr_jax.aot import inventory as inventory_lib

# Fitted (benchmarks/aot_step_time.py --part calibration): seconds one conditional costs per
# execution inside a while loop on a GPU, fitted so that the fp8 stack routed by a cond per
# matmul in a scan (gpu-anchors.md design B, 41.0 ms) is priced as measured. A roofline cannot
# see this cost (its kernels move no more bytes than the static step's); it is the price of a
# conditional that stops the stream from running ahead inside a loop (measured: the same
# conditionals unrolled cost nothing).
COND_IN_LOOP_S_FITTED = 100e-6
# TPU asynchronous copies between HBM and on-chip memory (VMEM / CMEM) that XLA schedules ahead
# of their consumers: priced at nothing, since the consumer's operand bytes are priced already.
_TPU_PREFETCH = frozenset(('copy-start', 'slice-start'))
CATEGORIES = ('gemm bf16', 'gemm f32', 'gemm fp8', 'gemm int8', 'gemm fp4', 'gemm mxfp8',
              'attention', 'quantization', 'optimizer', 'collectives', 'conditionals',
              'other', 'launch')
_LOW_PRECISION = re.compile(r'^(f8|f4|s8$|s4$|u8$)')
_QUANTIZE = re.compile(r'quantiz')  # an emulated path's rounding (jit(nvfp4_quantize)/...)
_ATTENTION = re.compile(r'/(attn|attention)/')
_OPTIMIZER = re.compile(r'optax|adam|opt_state|apply_updates|scale_by|clip_by')
# jax names the forward 'jvp(...)' and the backward 'transpose(jvp(...))': an op named outside
# both (the update, the controller's statistics) is the optimizer step's.
_MODEL_PASS = re.compile(r'jvp\(')


def gemm_class(gemm: str, opcode: str = '') -> str:
  """The rate class of a kernel's GEMM from its '<lhs> x <rhs> -> <result>' dtypes."""
  lhs, _, rest = gemm.partition(' x ')
  rhs = rest.partition(' -> ')[0]
  if lhs.startswith('f4') or rhs.startswith('f4'):
    return 'fp4'
  if lhs.startswith('f8') or rhs.startswith('f8'):
    return 'mxfp8' if opcode == 'block_scaled' else 'fp8'
  if lhs in ('s8', 'u8', 's4') or rhs in ('s8', 'u8', 's4'):
    return 'int8'
  if lhs == 'f32' or rhs == 'f32':
    return 'f32'
  return 'bf16'


def category(kernel: dict) -> str:
  """Where a kernel's time goes (one of CATEGORIES but 'launch').

  GEMMs by operand class (attention's own GEMMs and flash-attention kernels under 'attention');
  'quantization': a kernel touching f8 / f4 / s8 / u8 data that is no GEMM, or one of an
  emulated path's quantizers
  (op named '...quantize...'); 'optimizer': the update and the controller
  (ops of a train step named outside the forward 'jvp(...)' and backward 'transpose(jvp(...))'
  passes);
  'other': everything else (norms, activations, the loss, buffer initialisation, copies).
  """
  if kernel['opcode'] == 'conditional':
    return 'conditionals'
  if kernel['collective']:
    return 'collectives'
  if kernel.get('attention'):
    return 'attention'
  op_name = kernel['op_name']
  if kernel['flops']:
    if _ATTENTION.search(op_name) and not inventory_lib.PROJECTION_OP.search(op_name):
      return 'attention'
    return 'gemm ' + kernel['gemm_class']
  if any(_LOW_PRECISION.match(d) for d in kernel['dtypes']) or _QUANTIZE.search(op_name):
    return 'quantization'
  if _ATTENTION.search(op_name):
    return 'attention'
  if _OPTIMIZER.search(op_name) or ('train_step' in op_name and not kernel.get('in_loop')
                                    and not _MODEL_PASS.search(op_name)):
    return 'optimizer'
  return 'other'


def summarize(inventory: inventory_lib.Inventory) -> list[dict]:
  """The program's kernels as JSON-able dicts, identical launch sites merged (`count`).

  What pricing needs and nothing more: opcode, GEMM class and FLOPs, bytes, executions, the
  branch indices around it, whether a loop encloses it, its category's inputs; a flash-attention
  kernel adds 'attention' ('<kernel> <phase>') and 'seq_kv' (its key length).
  """
  merged = collections.OrderedDict()
  for k in inventory_lib.kernels(inventory):
    base = k.opcode.removesuffix('-start')
    collective = base in inventory_lib.COLLECTIVES
    block_scaled = k.opcode == 'custom-call' and k.gemm and 'blockScaled' in (
        inventory.instructions[k.name].attributes)
    entry = {
        'opcode': base if collective else k.opcode,
        'gemm_class': gemm_class(k.gemm, 'block_scaled' if block_scaled else '')
                      if k.flops and not k.attention else '',
        'flops': k.flops,
        # a collective moves its buffer (the larger of what it reads and writes) once
        'bytes': max(k.bytes_read, k.bytes_written) if collective
                 else k.bytes_read + k.bytes_written,
        'executions': k.executions, 'branches': [index for _, index in k.branches],
        'in_loop': k.in_loop, 'collective': collective,
        'dtypes': sorted(k.dtypes), 'op_name': k.op_name,
    }
    if k.attention:
      entry.update(attention=k.attention, seq_kv=k.seq_kv)
    entry['category'] = category(entry)
    key = (entry['opcode'], entry['gemm_class'], entry['flops'], entry['bytes'],
           entry['executions'], tuple(entry['branches']), entry['in_loop'], entry['category'],
           k.attention, k.seq_kv)
    if key in merged:
      merged[key]['count'] += 1
    else:
      entry['count'] = 1
      merged[key] = entry
  for entry in merged.values():
    del entry['dtypes'], entry['op_name']  # only the category needed them
  return list(merged.values())


@dataclasses.dataclass
class StepTime:
  """A priced step: total seconds, seconds by category (CATEGORIES), GEMM FLOPs by class, and
  the flash-attention kernels' FLOPs (apart: they are no GEMM of a class)."""
  total_s: float
  by_category: dict
  flops_by_class: dict
  launches: float
  attention_flops: float = 0.0


def _share(branches, recovered: float) -> float:
  share = 1.0
  for index in branches:
    share *= recovered if index == 1 else (1.0 - recovered) if index == 0 else 0.0
  return share


def price(kernels: list[dict], spec: device_specs.DeviceSpec, recovered: float = 0.0,
          cond_in_loop_s: float = 0.0, collective_bandwidth: float | None = None) -> StepTime:
  """The step time of `kernels` (summarize's) on `spec`.

  Args:
    recovered: share of conditional executions taking branch 1, in [0, 1].
    cond_in_loop_s: seconds per conditional execution inside a while loop (GPU only; use
      COND_IN_LOOP_S_FITTED for the calibrated model, 0 for the pure roofline).
    collective_bandwidth: bytes/s for collectives (default: the spec's interconnect).

  Raises:
    ValueError: recovered outside [0, 1], or a flash-attention kernel with no efficiency for
      `spec` (device_specs.ATTENTION_EFFICIENCY).
  """
  if not 0.0 <= recovered <= 1.0:
    raise ValueError(f'recovered must be in [0, 1], got {recovered}')
  bandwidth = collective_bandwidth or spec.interconnect_bandwidth
  by_category = dict.fromkeys(CATEGORIES, 0.0)
  flops_by_class = collections.Counter()
  launches, attention_flops = 0.0, 0.0
  for k in kernels:
    runs = k['executions'] * k['count'] * _share(k['branches'], recovered)
    if not runs:
      continue
    if spec.platform == 'tpu' and k['opcode'] in _TPU_PREFETCH:
      continue  # a copy into on-chip memory, overlapped; its consumer's read is counted
    if k['opcode'] == 'conditional':
      seconds = cond_in_loop_s if (k['in_loop'] and spec.platform == 'gpu') else 0.0
    elif k['collective']:
      seconds = k['bytes'] / bandwidth * (2.0 if k['opcode'] == 'all-reduce' else 1.0)
    elif k.get('attention'):
      kernel, phase = k['attention'].split()
      rate = spec.attention_rate(kernel, phase != 'fwd', k['seq_kv'])
      seconds = max(k['bytes'] / spec.memory_bandwidth, k['flops'] / rate)
      attention_flops += k['flops'] * runs
    else:
      seconds = k['bytes'] / spec.memory_bandwidth
      if k['flops']:
        seconds = max(seconds, k['flops'] / spec.rate(k['gemm_class']))
        flops_by_class[k['gemm_class']] += k['flops'] * runs
    by_category[k['category']] += seconds * runs
    by_category['launch'] += spec.launch_s * runs
    launches += runs
  return StepTime(sum(by_category.values()), by_category, dict(flops_by_class), launches,
                  attention_flops)


# --- A train step's projection (python -m gnmr_jax.aot --step_time) ---------------------------
# The anchors' errors (model / measured - 1, no fitted constant) of the figures a projection rests
# on: benchmarks/aot_step_time.py calibrate() over benchmarks/results/step_time/calibration__*.json
# against the H200 measurements (BENCHMARKS.md "Step time on paper", Calibration). Copied here
# since the tool runs without the benchmarks; tests/test_step_time.py recomputes them.
CALIBRATION_ERRORS = {'bf16 step': -0.081, 'fp8 / bf16': -0.098, 'int8 / bf16': 0.100,
                      'routed / static': -0.065}


def calibration_error(platform: str, path: str, mode: str) -> str:
  """The calibration a projection of `path` ('bf16', 'fp8', ...) in `mode` rests on, e.g.
  'bf16 step -8.1%' or 'no anchor' (as BENCHMARKS.md's projections label theirs)."""
  if platform == 'tpu':
    return 'no anchor (TPU)'
  label = {'bf16': 'bf16 step', 'fp8': 'fp8 / bf16', 'int8': 'int8 / bf16'}.get(path)
  parts = [f'{label} {100 * CALIBRATION_ERRORS[label]:+.1f}%' if label else 'no anchor']
  if mode == 'gnmr':
    parts.append(f"routed / static {100 * CALIBRATION_ERRORS['routed / static']:+.1f}%")
  return '; '.join(parts)


def model_flops_per_token(matmul_params: int, num_layers: int, num_heads: int, head_dim: int,
                          seq_len: int) -> float:
  r"""A causal LM's training FLOPs per token: 6 N + 6 L H D S.

  PaLM's count (Chowdhery et al. 2022, appendix B: 6 N + 12 L H Q T) with the attention term
  halved for the causal mask, as the flash-attention kernels' FLOPs are; N counts the weights
  that multiply (not the embedding table, a lookup); no recomputation (rematerialisation, the
  backward's QK^T) is counted.
  """
  return 6.0 * matmul_params + 6.0 * num_layers * num_heads * head_dim * seq_len


def project(kernels: list[dict], spec: device_specs.DeviceSpec, *, tokens: float,
            model_flops: float, path: str, mode: str) -> dict:
  """A train step's projection per device, the roofline's pure price (no fitted constant).

  Args:
    kernels: summarize's, of the per-device program.
    spec: the device.
    tokens: tokens one device trains on per step (batch * sequence / devices).
    model_flops: the step's model FLOPs per device (model_flops_per_token * tokens).
    path, mode: the precision's low-cost path and mode (for the calibration it rests on); a
      routed ('gnmr') step is priced with nothing recovered (every conditional on branch 0).

  Returns:
    {'device', 'mode', 'step_s', 'tokens_per_s', 'model_flops', 'mfu' (model FLOPs / step /
    datasheet bf16 rate), 'attention_kernel_flops' (what the flash-attention kernels execute, the
    backward's recomputation included), 'shares' (category -> fraction of the step),
    'calibration', 'attention_anchor'}.
  """
  priced = price(kernels, spec)
  step_s = priced.total_s
  return {
      'device': spec.name, 'mode': mode, 'step_s': step_s,
      'tokens_per_s': tokens / step_s if step_s else 0.0,
      'model_flops': model_flops,
      'mfu': model_flops / step_s / spec.datasheet['bf16'] if step_s else 0.0,
      'attention_kernel_flops': priced.attention_flops,
      'shares': {name: seconds / step_s for name, seconds in priced.by_category.items()
                 if step_s and seconds},
      'calibration': calibration_error(spec.platform, path, mode),
      'attention_anchor': ('none: flash-attention kernels are priced at published efficiencies '
                           '(device_specs.ATTENTION_EFFICIENCY), no measurement in this project '
                           'checks them') if priced.attention_flops else '',
  }
