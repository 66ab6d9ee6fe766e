"""The step-time model (gnmr_jax.aot.step_time) on hand-written HLO with known answers.

Each expected time is recomputed here from the roofline's definition with the spec's constants
(max(flops / rate, bytes / bandwidth) + launch per kernel, times its executions), independently
of the model's walk; the device table is checked for structure and sources.
"""

import math
import os
import sys

from absl.testing import absltest
from absl.testing import parameterized

from gnmr_jax.aot import compile as compile_lib
from gnmr_jax.aot import device_specs
from gnmr_jax.aot import inventory
from gnmr_jax.aot import report
from gnmr_jax.aot import step_time

H200 = device_specs.get_spec('h200')
V6E = device_specs.get_spec('v6e-1')

_GEMM = ('custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":'
         '{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}}')


def _fp8_gemm_hlo(m, k, n):
  return f'''HloModule m
ENTRY %main (a: f8e4m3fn[{m},{k}], b: f8e4m3fn[{k},{n}]) -> bf16[{m},{n}] {{
  %a = f8e4m3fn[{m},{k}]{{1,0}} parameter(0)
  %b = f8e4m3fn[{k},{n}]{{1,0}} parameter(1)
  ROOT %d = (bf16[{m},{n}]{{1,0}}, s8[1024]{{0}}) custom-call(%a, %b), {_GEMM}
}}'''


# A loop of 5 trips whose body runs a bf16 elementwise fusion over 1M elements, then a
# conditional choosing between an f32 add fusion (false: the low-cost branch 0) and a bf16 GEMM
# (true: branch 1).
LOOP_COND_HLO = '''HloModule m
%fused_mul (p0: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  ROOT %m = bf16[1024,1024]{1,0} multiply(%p0, %p0)
}
%fused_add (q0: f32[256,256]) -> f32[256,256] {
  %q0 = f32[256,256]{1,0} parameter(0)
  ROOT %s = f32[256,256]{1,0} add(%q0, %q0)
}
%false_branch (fx: bf16[1024,1024]) -> bf16[1024,1024] {
  %fx = bf16[1024,1024]{1,0} parameter(0)
  %small = f32[256,256]{1,0} constant({...})
  %fa = f32[256,256]{1,0} fusion(%small), kind=kLoop, calls=%fused_add
  ROOT %fr = bf16[1024,1024]{1,0} copy(%fx)
}
%true_branch (tx: bf16[1024,1024]) -> bf16[1024,1024] {
  %tx = bf16[1024,1024]{1,0} parameter(0)
  ROOT %g = bf16[1024,1024]{1,0} custom-call(%tx, %tx), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}}
}
%body (state: (s32[], bf16[1024,1024], pred[])) -> (s32[], bf16[1024,1024], pred[]) {
  %state = (s32[], bf16[1024,1024]{1,0}, pred[]) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = bf16[1024,1024]{1,0} get-tuple-element(%state), index=1
  %p = pred[] get-tuple-element(%state), index=2
  %y = bf16[1024,1024]{1,0} fusion(%x), kind=kLoop, calls=%fused_mul
  %c = bf16[1024,1024]{1,0} conditional(%p, %y, %y), true_computation=%true_branch, false_computation=%false_branch
  ROOT %t = (s32[], bf16[1024,1024]{1,0}, pred[]) tuple(%i, %c, %p)
}
%cond (cs: (s32[], bf16[1024,1024], pred[])) -> pred[] {
  %cs = (s32[], bf16[1024,1024]{1,0}, pred[]) parameter(0)
  %ci = s32[] get-tuple-element(%cs), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%ci, %n), direction=LT
}
ENTRY %main (x0: bf16[1024,1024], p0: pred[]) -> bf16[1024,1024] {
  %x0 = bf16[1024,1024]{1,0} parameter(0)
  %pp = pred[] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[1024,1024]{1,0}, pred[]) tuple(%zero, %x0, %pp)
  %w = (s32[], bf16[1024,1024]{1,0}, pred[]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = bf16[1024,1024]{1,0} get-tuple-element(%w), index=1
}'''

# A scan-like fusion: reads one [1,512,512] layer of a stacked [8,512,512] f32 parameter and
# writes it in place into a stacked bf16 output (dynamic-update-slice).
SLICED_HLO = '''HloModule m
%fused_slice (s0: f32[8,512,512], s1: s32[], s2: bf16[8,512,512]) -> bf16[8,512,512] {
  %s0 = f32[8,512,512]{2,1,0} parameter(0)
  %s1 = s32[] parameter(1)
  %s2 = bf16[8,512,512]{2,1,0} parameter(2)
  %z = s32[] constant(0)
  %ds = f32[1,512,512]{2,1,0} dynamic-slice(%s0, %s1, %z, %z), dynamic_slice_sizes={1,512,512}
  %cv = bf16[1,512,512]{2,1,0} convert(%ds)
  ROOT %dus = bf16[8,512,512]{2,1,0} dynamic-update-slice(%s2, %cv, %s1, %z, %z)
}
ENTRY %main (w: f32[8,512,512], i: s32[], buf: bf16[8,512,512]) -> bf16[8,512,512] {
  %w = f32[8,512,512]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %buf = bf16[8,512,512]{2,1,0} parameter(2)
  ROOT %f = bf16[8,512,512]{2,1,0} fusion(%w, %i, %buf), kind=kLoop, calls=%fused_slice
}'''

# TPU: an int8 MXU matmul is a convolution inside a fusion.
TPU_HLO = '''HloModule m
%fused_conv (c0: s8[2048,1024], c1: s8[1024,4096]) -> s32[2048,4096] {
  %c0 = s8[2048,1024]{1,0} parameter(0)
  %c1 = s8[1024,4096]{1,0} parameter(1)
  ROOT %cv = s32[2048,4096]{1,0} convolution(%c0, %c1), dim_labels=bf_io->bf
}
ENTRY %main (a: s8[2048,1024], b: s8[1024,4096]) -> s32[2048,4096] {
  %a = s8[2048,1024]{1,0} parameter(0)
  %b = s8[1024,4096]{1,0} parameter(1)
  ROOT %f = s32[2048,4096]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_conv
}'''


def _price(hlo, spec, **kwargs):
  return step_time.price(step_time.summarize(inventory.parse(hlo)), spec, **kwargs)


class GemmTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('compute_bound', 4096, 4096, 4096),
      ('memory_bound', 65536, 16, 8192))  # K=16: 2 FLOPs per byte or so
  def test_gemm_is_max_of_flops_and_bytes_plus_launch(self, m, k, n):
    flops = 2 * m * k * n
    nbytes = m * k + k * n + 2 * m * n  # fp8 operands, bf16 result; the workspace is not read
    expected = max(flops / H200.rate('fp8'), nbytes / H200.memory_bandwidth) + H200.launch_s
    got = _price(_fp8_gemm_hlo(m, k, n), H200)
    self.assertAlmostEqual(got.total_s, expected, delta=1e-12)
    self.assertEqual(got.flops_by_class, {'fp8': flops})
    compute_bound = flops / H200.rate('fp8') > nbytes / H200.memory_bandwidth
    self.assertEqual(compute_bound, k == 4096)

  def test_h200_rate_is_the_measured_mean(self):
    # gpu-anchors.md: fp8 778 and 977 TFLOP/s at the two shapes
    self.assertAlmostEqual(H200.rate('fp8'), (778e12 + 977e12) / 2)
    self.assertEqual(H200.rate_source('fp8'), 'calibrated (measured on this chip)')

  def test_tpu_convolution_is_an_mxu_gemm_without_launch_cost(self):
    flops = 2 * 2048 * 1024 * 4096
    nbytes = 2048 * 1024 + 1024 * 4096 + 4 * 2048 * 4096
    expected = max(flops / V6E.rate('int8'), nbytes / V6E.memory_bandwidth)
    got = _price(TPU_HLO, V6E)
    self.assertAlmostEqual(got.total_s, expected, delta=1e-12)
    self.assertEqual(got.by_category['launch'], 0.0)
    self.assertGreater(got.by_category['gemm int8'], 0.0)


class WalkTest(parameterized.TestCase):

  def test_tpu_prefetch_into_on_chip_memory_costs_nothing(self):
    hlo = '''HloModule m
ENTRY %main (a: s8[4194304]) -> s8[1048576] {
  %a = s8[4194304]{0} parameter(0)
  %s = ((s8[4194304]{0}), s8[1048576]{0}, s32[]) slice-start(%a), slice={[0:1048576]}
  ROOT %d = s8[1048576]{0} slice-done(%s)
}'''
    self.assertEqual(_price(hlo, V6E).total_s, 0.0)
    concat = hlo.replace('ROOT %d = s8[1048576]{0} slice-done(%s)', '%d = s8[1048576]{0} '
                         'slice-done(%s)\n  ROOT %c = s8[1048576]{0} custom-call(%d), '
                         'custom_call_target="ConcatBitcast"')
    self.assertEqual(_price(concat, V6E).total_s, 0.0)  # a reinterpretation, no kernel
    on_gpu = _price(hlo, H200)  # not a TPU: a kernel like any other
    moved = 4194304 + (4194304 + 1048576 + 4)  # read, and the result tuple written
    self.assertAlmostEqual(on_gpu.total_s, moved / H200.memory_bandwidth + H200.launch_s,
                           delta=1e-12)

  def test_loop_trip_count_multiplies_and_branch_share_mixes(self):
    launch, bw = H200.launch_s, H200.memory_bandwidth
    mul = (2 + 2) * 1024 * 1024 / bw + launch            # bf16 in, bf16 out
    low = (4 + 4) * 256 * 256 / bw + launch               # branch 0: f32 add fusion
    low += (2 + 2) * 1024 * 1024 / bw + launch            # ... and its copy
    flops = 2 * 1024 ** 3
    gemm_bytes = 3 * 2 * 1024 * 1024
    high = max(flops / H200.rate('bf16'), gemm_bytes / bw) + launch
    cond = launch                                         # the conditional's own site
    compare = 4 + 4 + 1                                   # the loop condition: s32, s32 -> pred
    loop_cond = compare / bw + launch
    for recovered in (0.0, 0.25, 1.0):
      expected = 5 * (mul + cond + loop_cond + (1 - recovered) * low + recovered * high)
      got = _price(LOOP_COND_HLO, H200, recovered=recovered)
      self.assertAlmostEqual(got.total_s, expected, delta=1e-12, msg=f'recovered={recovered}')
    self.assertEqual(_price(LOOP_COND_HLO, H200).flops_by_class, {})
    self.assertEqual(_price(LOOP_COND_HLO, H200, recovered=1.0).flops_by_class,
                     {'bf16': 5 * flops})

  def test_cost_per_conditional_in_a_loop(self):
    base = _price(LOOP_COND_HLO, H200).total_s
    with_cost = _price(LOOP_COND_HLO, H200, cond_in_loop_s=1e-3).total_s
    self.assertAlmostEqual(with_cost - base, 5 * 1e-3, delta=1e-12)  # 5 executions
    # a TPU runs the branch choice on the device: no such cost
    self.assertAlmostEqual(_price(LOOP_COND_HLO, V6E, cond_in_loop_s=1e-3).total_s,
                           _price(LOOP_COND_HLO, V6E).total_s, delta=1e-15)

  def test_sliced_and_in_place_operands_count_their_slices(self):
    (kernel,) = inventory.kernels(inventory.parse(SLICED_HLO))
    layer = 512 * 512
    self.assertEqual(kernel.bytes_read, 4 * layer + 4)    # one f32 layer and the index
    self.assertEqual(kernel.bytes_written, 2 * layer)     # one bf16 layer, in place
    self.assertFalse(kernel.in_loop)

  def test_kernel_sites_and_executions(self):
    inv = inventory.parse(LOOP_COND_HLO)
    sites = {k.name: k for k in inventory.kernels(inv)}
    self.assertEqual(set(sites), {'y', 'c', 'fa', 'fr', 'g', 'lt'})
    self.assertTrue(all(k.executions == 5 and k.in_loop for k in sites.values()))
    self.assertEqual(sites['g'].branches, (('c', 1),))
    self.assertEqual(sites['fa'].branches, (('c', 0),))
    self.assertEqual(sites['g'].flops, 2 * 1024 ** 3)

  def test_recovered_outside_unit_interval_is_an_error(self):
    with self.assertRaisesRegex(ValueError, 'recovered'):
      _price(LOOP_COND_HLO, H200, recovered=1.5)


class ClassifyTest(parameterized.TestCase):

  @parameterized.parameters(
      ('f8e4m3fn x f8e5m2 -> f32', '', 'fp8'), ('s8 x s8 -> s32', '', 'int8'),
      ('f32 x f32 -> f32', '', 'f32'), ('bf16 x bf16 -> f32', '', 'bf16'),
      ('f4e2m1fn x f4e2m1fn -> bf16', 'block_scaled', 'fp4'),
      ('f8e4m3fn x f8e4m3fn -> bf16', 'block_scaled', 'mxfp8'))
  def test_gemm_class(self, gemm, opcode, expected):
    self.assertEqual(step_time.gemm_class(gemm, opcode), expected)

  @parameterized.parameters(
      ({'flops': 0, 'dtypes': ['bf16', 'f8e4m3fn']}, 'quantization'),
      ({'flops': 0, 'dtypes': ['f32'], 'op_name': 'jit(step)/optax/adam/mul'}, 'optimizer'),
      ({'flops': 0, 'dtypes': ['f32'], 'op_name': 'jit(train_step)/cond/mul'}, 'optimizer'),
      ({'flops': 0, 'dtypes': ['f32'], 'op_name': 'jit(train_step)/jvp()/reduce_max'}, 'other'),
      ({'flops': 0, 'dtypes': ['f32'], 'op_name': ''}, 'other'),
      ({'flops': 0, 'dtypes': ['f32'], 'op_name': 'jit(f)/convert_element_type'}, 'other'),
      ({'flops': 0, 'dtypes': ['bf16'], 'op_name': 'x/layers/attn/v/jit(nvfp4_quantize)/mul'},
       'quantization'),
      ({'flops': 0, 'dtypes': ['bf16'], 'op_name': 'jit(step)/layers/attn/softmax'},
       'attention'),
      ({'flops': 10, 'gemm_class': 'bf16', 'op_name': 'x/layers/attn/q/dot_general'},
       'gemm bf16'),
      ({'flops': 10, 'gemm_class': 'bf16', 'op_name': 'x/layers/attn/dot_general'},
       'attention'),
      ({'collective': True}, 'collectives'), ({'opcode': 'conditional'}, 'conditionals'))
  def test_category(self, fields, expected):
    kernel = {'opcode': 'fusion', 'collective': False, 'op_name': '', 'flops': 0,
              'gemm_class': '', 'dtypes': []}
    kernel.update(fields)
    self.assertEqual(step_time.category(kernel), expected)


class DeviceSpecsTest(parameterized.TestCase):

  @parameterized.parameters(*device_specs.SPECS)
  def test_every_spec_has_every_field_and_a_source(self, name):
    spec = device_specs.SPECS[name]
    self.assertIn(spec.platform, ('gpu', 'tpu'))
    for cls in ('bf16', 'f32', 'int8'):
      self.assertGreater(spec.datasheet[cls], 1e13)
    for cls in device_specs.GEMM_CLASSES:
      self.assertTrue(math.isfinite(spec.rate(cls)) and spec.rate(cls) > 0)
      self.assertLessEqual(spec.rate(cls), max(spec.datasheet.values()))
    self.assertGreater(spec.memory_bandwidth, 5e11)
    self.assertGreater(spec.interconnect_bandwidth, 1e11)
    self.assertGreaterEqual(spec.launch_s, 0.0)
    for field in ('datasheet', 'memory_bandwidth', 'interconnect_bandwidth', 'launch_s', 'f32'):
      self.assertTrue(spec.sources.get(field), f'{name}: no source for {field}')
    if spec.platform == 'gpu':
      self.assertIn('fp8', spec.datasheet)

  def test_tpu_rates_keep_the_datasheet_ratios(self):
    # the H200's per-class efficiencies are Hopper's: a TPU takes its bf16 one for every class
    self.assertAlmostEqual(V6E.rate('int8') / V6E.rate('bf16'), 1836 / 918)
    self.assertAlmostEqual(V6E.rate('bf16'), 918e12 * 614e12 / 989.4e12)
    self.assertLess(H200.rate('int8') / H200.rate('bf16'), 1.5)  # measured: 855 / 614

  def test_only_the_h200_is_calibrated_and_b200_has_fp4(self):
    self.assertEqual(sorted(device_specs.SPECS['h200'].calibrated), ['bf16', 'fp8', 'int8'])
    self.assertIn('gpu-anchors.md', device_specs.SPECS['h200'].sources['calibrated'])
    self.assertEqual([n for n, s in device_specs.SPECS.items() if s.calibrated], ['h200'])
    self.assertIn('fp4', device_specs.SPECS['b200'].datasheet)
    self.assertEqual(device_specs.get_spec('h100:8').name, 'h100')
    self.assertEqual(device_specs.get_spec('v5p-64').name, 'v5p')
    with self.assertRaisesRegex(ValueError, 'no device spec.*h200'):
      device_specs.get_spec('a100')
    self.assertEqual(len(device_specs.table()), 2 + len(device_specs.SPECS))


# --- flash attention: priced at the published kernel efficiency, in 'attention' ------------------
H100 = device_specs.get_spec('h100')
V5E = device_specs.get_spec('v5e-1')
# B=2 rows, S=T=512, H=8 query heads over K=2 key/value heads, head dim 64; causal.
_B, _S, _H, _K, _D = 2, 512, 8, 2, 64
_Q, _KV = f'bf16[{_B},{_S},{_H},{_D}]', f'bf16[{_B},{_S},{_K},{_D}]'
CUDNN_FWD_HLO = f'''HloModule m
ENTRY %main (q: {_Q}, k: {_KV}, v: {_KV}) -> {_Q} {{
  %q = {_Q}{{3,2,1,0}} parameter(0)
  %k = {_KV}{{3,2,1,0}} parameter(1)
  %v = {_KV}{{3,2,1,0}} parameter(2)
  %att = ({_Q}{{3,2,1,0}}, f32[{_B},{_H},{_S}]{{2,1,0}}, u8[0]{{0}}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", metadata={{op_name="jit(step)/jvp()/dot_product_attention_fwd"}}, backend_config={{"cudnn_fmha_backend_config": {{"intermediate_tensor_shape": {{"element_type": "BF16", "dimensions": ["{_B}", "{_H}", "{_S}", "{_S}"]}}, "mask_type": "CAUSAL"}}}}
  ROOT %o = {_Q}{{3,2,1,0}} get-tuple-element(%att), index=0
}}'''
_CUDNN_FLOPS = 4 * _B * _H * _S * _S * _D // 2
_CUDNN_BYTES = (2 * (_B * _S * _H * _D + 2 * _B * _S * _K * _D)    # q, k, v read
                + 2 * _B * _S * _H * _D + 4 * _B * _H * _S)       # o and its lse written
# The same attention as a TPU splash dkv kernel ([B, heads, S, D] operands; 8x the GEMM work).
_QT, _KVT = f'bf16[{_B},{_H},{_S},{_D}]', f'bf16[{_B},{_K},{_S},{_D}]'
SPLASH_DKV_HLO = f'''HloModule m
ENTRY %main (q: {_QT}, k: {_KVT}, v: {_KVT}, lse: f32[{_B},{_H},8,{_S}], do: {_QT}) -> {_KVT} {{
  %q = {_QT}{{3,2,1,0}} parameter(0)
  %k = {_KVT}{{3,2,1,0}} parameter(1)
  %v = {_KVT}{{3,2,1,0}} parameter(2)
  %lse = f32[{_B},{_H},8,{_S}]{{3,2,1,0}} parameter(3)
  %do = {_QT}{{3,2,1,0}} parameter(4)
  %iota = s32[8,{_S}]{{1,0}} iota(), iota_dimension=1
  %dkv = (bf16[{_B},{_K},{_S},{_D}]{{3,2,1,0}}, bf16[{_B},{_K},{_S},{_D}]{{3,2,1,0}}) custom-call(%q, %k, %v, %lse, %do, %lse, %iota), custom_call_target="tpu_custom_call", metadata={{op_name="jit(step)/transpose(jvp())/splash_mha_dkv_no_residuals/pallas_call"}}
  ROOT %dk = {_KVT}{{3,2,1,0}} get-tuple-element(%dkv), index=0
}}'''


class AttentionPricingTest(parameterized.TestCase):

  def test_cudnn_attention_is_priced_at_the_published_rate(self):
    got = _price(CUDNN_FWD_HLO, H100)
    # FA3 paper Fig. 5(d): cuDNN causal forward, head dim 128, S = 512: 315 TFLOP/s
    expected = max(_CUDNN_FLOPS / 315e12, _CUDNN_BYTES / H100.memory_bandwidth) + H100.launch_s
    self.assertAlmostEqual(got.total_s, expected, delta=1e-12)
    self.assertAlmostEqual(got.by_category['attention'], expected - H100.launch_s, delta=1e-12)
    self.assertEqual(got.attention_flops, _CUDNN_FLOPS)
    self.assertEqual(got.flops_by_class, {})   # no GEMM of a class: not at the GEMM rate
    self.assertGreaterEqual(got.by_category['attention'], _CUDNN_FLOPS / H100.datasheet['bf16'])

  @parameterized.parameters('v5e-1', 'v5p-8', 'v6e-4')
  def test_splash_attention_is_priced_on_every_tpu(self, target):
    spec = device_specs.get_spec(target)
    got = _price(SPLASH_DKV_HLO, spec)
    flops = 8 * _B * _H * _S * _S * _D // 2   # QK^T, dV, dP, dK; causal (the iota)
    self.assertEqual(got.attention_flops, flops)
    self.assertTrue(math.isfinite(got.total_s) and got.total_s > 0)
    self.assertEqual(got.total_s, got.by_category['attention'])   # no launch cost on a TPU
    self.assertGreaterEqual(got.total_s, flops / spec.datasheet['bf16'])
    self.assertAlmostEqual(got.total_s, max(
        flops / spec.attention_rate('splash', True, _S),
        (3 * 2 * _B * _H * _S * _D + 2 * 2 * _B * _K * _S * _D + 2 * 4 * _B * _H * 8 * _S
         + 4 * 8 * _S) / spec.memory_bandwidth), delta=1e-12)

  def test_a_kernel_without_an_efficiency_for_the_device_is_an_error(self):
    with self.assertRaisesRegex(ValueError, "no attention efficiency for kernel 'cudnn' on 'v5e'"):
      _price(CUDNN_FWD_HLO, V5E)


class AttentionEfficiencyTest(parameterized.TestCase):

  @parameterized.parameters(*device_specs.SPECS)
  def test_every_device_has_a_sourced_efficiency_for_its_kernel(self, name):
    spec = device_specs.SPECS[name]
    entry = device_specs.attention_efficiency(name, 'cudnn' if spec.platform == 'gpu'
                                              else 'splash')
    for values in (entry.forward, entry.backward):
      self.assertLen(values, len(entry.seq_lens))
      self.assertTrue(all(0.1 < v < 0.8 for v in values), values)   # never 1.0, never free
    self.assertIn('https://', entry.source)
    published = {'h100': 'arxiv.org/abs/2407.08608', 'v5p': 'marin-community/marin/pull/6330'}
    if name in published:
      self.assertIn(published[name], entry.source)
    else:
      self.assertTrue(entry.source.startswith('assumed:'), entry.source)

  def test_efficiency_interpolates_in_log_length_and_holds_its_ends(self):
    entry = device_specs.attention_efficiency('h100', 'cudnn')
    peak = H100.datasheet['bf16']
    self.assertAlmostEqual(entry.at(False, 512) * peak, 315e12, delta=1e3)
    self.assertAlmostEqual(entry.at(True, 16384) * peak, 516e12, delta=1e3)
    self.assertAlmostEqual(entry.at(False, 724) * peak, (315e12 + 410e12) / 2, delta=0.2e12)
    self.assertEqual(entry.at(False, 128), entry.at(False, 512))       # shorter: the shortest's
    self.assertEqual(entry.at(True, 65536), entry.at(True, 16384))
    self.assertAlmostEqual(H100.attention_rate('cudnn', False, 2048), 484e12, delta=1e3)

  def test_splash_v5p_reads_its_published_forward_figure(self):
    # marin PR 6330: 8192 tokens, 8 heads, head dim 128, causal: 0.778 ms
    v5p = device_specs.get_spec('v5p-8')
    flops = 4 * 8 * 8192 ** 2 * 128 / 2
    self.assertAlmostEqual(flops / v5p.attention_rate('splash', False, 8192), 0.778e-3,
                           delta=1e-9)
    self.assertLen(device_specs.attention_table(), 2 + len(device_specs.ATTENTION_EFFICIENCY))


class ProjectionTest(parameterized.TestCase):

  def test_calibration_errors_are_the_benchmarks(self):
    # the tool's copy of BENCHMARKS.md's calibration, recomputed from the calibration JSONs
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = os.path.join(root, 'benchmarks', 'results', 'step_time')
    if not any(n.startswith('calibration__') for n in os.listdir(results)):
      self.skipTest('no calibration JSONs')
    sys.path.insert(0, os.path.join(root, 'benchmarks'))
    try:
      import aot_step_time  # pylint: disable=g-import-not-at-top
    finally:
      sys.path.pop(0)
    # pylint: disable-next=protected-access
    cal = aot_step_time.calibrate(aot_step_time._load_calibration())
    bf16 = cal['rows']['stack_bf16_static']
    computed = {'bf16 step': bf16['roofline_ms'] / bf16['measured_ms'] - 1}
    for key, (label, _, _) in zip(('fp8 / bf16', 'int8 / bf16', 'routed / static'),
                                  aot_step_time.GOAL_RATIOS):
      computed[key] = cal['ratio_error'][label]
    for key, value in step_time.CALIBRATION_ERRORS.items():
      self.assertAlmostEqual(value, computed[key], delta=0.0005, msg=key)

  @parameterized.parameters(
      ('gpu', 'bf16', 'static', 'bf16 step -8.1%'), ('gpu', 'fp8', 'static', 'fp8 / bf16 -9.8%'),
      ('gpu', 'int8', 'gnmr', 'int8 / bf16 +10.0%; routed / static -6.5%'),
      ('gpu', 'nvfp4', 'static', 'no anchor'), ('tpu', 'bf16', 'static', 'no anchor (TPU)'))
  def test_calibration_label(self, platform, path, mode, expected):
    self.assertEqual(step_time.calibration_error(platform, path, mode), expected)

  def test_projection_of_a_step(self):
    kernels = step_time.summarize(inventory.parse(CUDNN_FWD_HLO))
    tokens, model_flops = 4096.0, 3e12
    got = step_time.project(kernels, H100, tokens=tokens, model_flops=model_flops, path='bf16',
                            mode='static')
    step_s = step_time.price(kernels, H100).total_s
    self.assertAlmostEqual(got['step_s'], step_s, delta=1e-15)
    self.assertAlmostEqual(got['tokens_per_s'], tokens / step_s)
    self.assertAlmostEqual(got['mfu'], model_flops / step_s / 989.4e12)
    self.assertAlmostEqual(sum(got['shares'].values()), 1.0)
    self.assertEqual(set(got['shares']), {'attention', 'launch'})
    self.assertEqual(got['attention_kernel_flops'], _CUDNN_FLOPS)
    self.assertEqual(got['calibration'], 'bf16 step -8.1%')
    self.assertIn('no measurement in this project', got['attention_anchor'])

  def test_model_flops_per_token(self):
    # 6 N + 12 L H D S / 2 (PaLM's count, causal): N = 1e6, 2 layers, 4 heads of 32, S = 256
    self.assertEqual(step_time.model_flops_per_token(10 ** 6, 2, 4, 32, 256),
                     6e6 + 12 * 2 * 4 * 32 * 256 / 2)

  def test_report_formats_the_projection(self):
    kernels = step_time.summarize(inventory.parse(CUDNN_FWD_HLO))
    projection = step_time.project(kernels, H100, tokens=4096.0, model_flops=3e12, path='fp8',
                                   mode='gnmr')
    step_s = projection['step_s']
    lines = report.format_step_time(projection)
    self.assertEqual(lines[0], f'  step time on paper (h100 roofline, per device): '
                     f'{step_s * 1e3:.2f} ms, {4096 / step_s:,.0f} tokens/s, MFU '
                     f'{100 * 3e12 / step_s / 989.4e12:.1f}% (model FLOPs 6N + causal attention '
                     '3 TFLOP per step, against the datasheet bf16 rate)')
    shares = projection['shares']   # 2 us launch, 1.7 us at 315 TFLOP/s: launch first
    self.assertEqual(lines[1], f"    where the time goes: launch {100 * shares['launch']:.0f}%, "
                     f"attention {100 * shares['attention']:.0f}%")
    self.assertEqual(lines[2], '    calibration: fp8 / bf16 -9.8%; routed / static -6.5% (H200 '
                     'anchors, BENCHMARKS.md "Step time on paper"); routed: priced with nothing '
                     'recovered')
    self.assertIn('anchor none', lines[3])
    unpriced = report.format_step_time({'error': "no device spec for target 't4'"})
    self.assertEqual(unpriced, ["  step time on paper: not priced (no device spec for target "
                                "'t4')"])
    # a report with a train step's projection prints it after the step's collectives
    entry = {'memory': dict.fromkeys(('peak_bytes', 'argument', 'temp', 'output', 'alias',
                                      'generated_code'), 0), 'fits': True, 'margin_bytes': 0,
             'compile_s': 1.0, 'lower_s': 0.5, 'gemm_flops': {}, 'gemms': {}, 'loops': {},
             'conditionals': 0, 'collectives': {}, 'step_time': projection}
    text = report.format_report({
        'target': 'h100', 'description': 'H100', 'num_devices': 1, 'num_hosts': 1,
        'device_memory_bytes': 80e9, 'model': 'tiny', 'batch_size': 4, 'seq_len': 512,
        'mesh': {'data': 1}, 'precision': {'mode': 'gnmr', 'low_cost_path': 'fp8',
                                           'recovery_path': 'bf16'},
        'steps': {'train': entry}, 'versions': {}})
    self.assertIn('\n'.join(lines), text)

  def test_a_target_without_a_device_spec_is_reported_not_priced(self):
    got = compile_lib.project_step_time('', {'target': 't4'}, None)
    self.assertRegex(got['error'], r"no device spec for target 't4'; specs: \[")


if __name__ == '__main__':
  absltest.main()
