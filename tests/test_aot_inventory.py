"""gnmr_jax.aot without the compilers: target names, the HLO inventory on hand-written programs
(the AOT tier, tests/aot, checks it on compiled ones), and the messages of a missing install."""

import os
import subprocess
import sys

import pytest

from gnmr_jax.aot import compile as compile_lib
from gnmr_jax.aot import inventory, targets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A scanned loop of 4 trips holding a routed projection (fp8 / bf16 branches), a bf16 GEMM
# outside it, and an all-gather; its loop condition carries no known_trip_count (as on TPU).
HLO = '''HloModule jit_step, is_scheduled=true

%low (p0: (f8e4m3fn[8,16], f8e4m3fn[16,32])) -> f32[8,32] {
  %p0 = (f8e4m3fn[8,16]{1,0}, f8e4m3fn[16,32]{1,0}) parameter(0)
  %a = f8e4m3fn[8,16]{1,0} get-tuple-element(%p0), index=0
  %b = f8e4m3fn[16,32]{1,0} get-tuple-element(%p0), index=1
  %g = (f32[8,32]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(step)/layers/mlp/up/cond/branch_0_fun/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %r = f32[8,32]{1,0} get-tuple-element(%g), index=0
}

%rec (p1: (f8e4m3fn[8,16], f8e4m3fn[16,32])) -> f32[8,32] {
  %p1 = (bf16[8,16]{1,0}, bf16[16,32]{1,0}) parameter(0)
  %c = bf16[8,16]{1,0} get-tuple-element(%p1), index=0
  %d = bf16[16,32]{1,0} get-tuple-element(%p1), index=1
  %h = (f32[8,32]{1,0}, s8[1024]{0}) custom-call(%c, %d), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/layers/mlp/up/cond/branch_1_fun/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %s = f32[8,32]{1,0} get-tuple-element(%h), index=0
}

%body (w0: (s32[], pred[])) -> (s32[], pred[]) {
  %w0 = (s32[], pred[]) parameter(0)
  %i = s32[] get-tuple-element(%w0), index=0
  %bit = pred[] get-tuple-element(%w0), index=1
  %ops = (f8e4m3fn[8,16]{1,0}, f8e4m3fn[16,32]{1,0}) constant({...})
  %cond.1 = f32[8,32]{1,0} conditional(%bit, %ops, %ops), true_computation=%rec, false_computation=%low
  ROOT %t = (s32[], pred[]) tuple(%i, %bit)
}

%loop_cond (w1: (s32[], pred[])) -> pred[] {
  %w1 = (s32[], pred[]) parameter(0)
  %j = s32[] get-tuple-element(%w1), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %four), direction=LT
}

ENTRY %main (x: bf16[64,128], y: bf16[128,256], z: f32[2,512]) -> f32[64,256] {
  %x = bf16[64,128]{1,0} parameter(0)
  %y = bf16[128,256]{1,0} parameter(1)
  %z = f32[2,512]{1,0} parameter(2)
  %init = (s32[], pred[]) constant({...})
  %while.1 = (s32[], pred[]) while(%init), condition=%loop_cond, body=%body
  %ag = f32[8,512]{1,0} all-gather(%z), dimensions={0}
  %head = (f32[64,256]{1,0}, s8[1024]{0}) custom-call(%x, %y), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/bsd,dv->bsv/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %out = f32[64,256]{1,0} get-tuple-element(%head), index=0
}
'''


def test_inventory_of_a_routed_loop():
  inv = inventory.parse(HLO)
  assert inv.entry == 'main'
  assert inv.loops == {'while.1': 4}                      # counted from `i < 4`
  assert inv.conditionals == {'cond.1': ['low', 'rec']}   # indexed by the predicate
  assert inv.gemm_counts() == {'cublaslt_fp8 f8e4m3fn x f8e4m3fn -> f32': 1,
                               'cublaslt bf16 x bf16 -> f32': 2}
  low, rec = inv.branch_gemms('cond.1')
  assert [(g.kind, g.projection, g.executions) for g in low] == [('cublaslt_fp8', 'up', 4)]
  assert [(g.lhs, g.projection) for g in rec] == [('bf16', 'up')]
  up = 2 * 8 * 32 * 16 * 4           # 2 * M * N * K, 4 trips
  head = 2 * 64 * 256 * 128
  assert inv.flops_by_kind(branch=0) == {'cublaslt_fp8 f8e4m3fn x f8e4m3fn -> f32': up,
                                         'cublaslt bf16 x bf16 -> f32': head}
  assert inv.flops_by_kind(branch=1) == {'cublaslt bf16 x bf16 -> f32': up + head}
  assert inv.flops_by_kind(branch=None, projection=False) == {
      'cublaslt bf16 x bf16 -> f32': head}
  assert inv.collective_summary() == {'all-gather': {'count': 1, 'bytes': 8 * 512 * 4}}


def test_inventory_refuses_text_that_is_not_hlo():
  with pytest.raises(ValueError, match='no ENTRY computation'):
    inventory.parse('not a module')


def test_convolution_flops_follow_dim_labels():
  text = '''HloModule m
ENTRY %e (a: s8[8,2,128], b: s8[2,128,512]) -> s32[8,512,1] {
  %a = s8[8,2,128]{2,1,0} parameter(0)
  %b = s8[2,128,512]{2,1,0} parameter(1)
  ROOT %c = s32[8,512,1]{1,0,2} convolution(%a, %b), window={size=2}, dim_labels=b0f_0io->bf0
}'''
  (gemm,) = inventory.parse(text).gemms
  assert (gemm.kind, gemm.lhs, gemm.result) == ('convolution', 's8', 's32')
  assert gemm.flops == 2 * 8 * 512 * (2 * 128)   # the window and input features are summed


@pytest.mark.parametrize('name,platform,devices,hosts', [
    ('h100', 'gpu', 1, 1), ('t4', 'gpu', 1, 1), ('h100:8', 'gpu', 8, 1),
    ('b200:4x8', 'gpu', 32, 4), ('v5e-1', 'tpu', 1, 1), ('v6e-8', 'tpu', 8, 2),
    ('v5p-64', 'tpu', 32, 8), ('v5e-256x2', 'tpu', 512, 128)])
def test_targets(name, platform, devices, hosts):
  target = targets.get_target(name)
  assert (target.platform, target.num_devices, target.num_hosts) == (platform, devices, hosts)
  assert target.device_memory_bytes > 10e9


def test_gpu_target_configs_carry_the_runtime_version_the_fp8_rewrite_needs():
  for kind in targets.GPU_TARGETS:
    text = targets.gpu_config_text(kind)
    assert 'runtime_version { major: 12 minor: 8' in text, kind
  assert targets.get_target('h100').device_memory_bytes == 84942979072   # XLA's h100_sxm spec


@pytest.mark.parametrize('name,expect', [
    ('h900', 'not a GPU or TPU name'), ('v5e-3', 'v5e slices come in sizes'),
    ('h100:9', 'a GPU host holds 1 to 8 GPUs'), ('', 'non-empty')])
def test_unknown_targets_name_the_accepted_forms(name, expect):
  with pytest.raises(ValueError, match=expect) as error:
    targets.get_target(name)
  assert 'v5p-64' in str(error.value) and 'h100' in str(error.value)


def test_a_compile_refused_for_memory_is_reported_as_not_fitting():
  class Lowered:
    def compile(self, compiler_options):
      del compiler_options
      raise RuntimeError('RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used '
                         '20.5G of 15.75G hbm.')

  class Jitted:
    def trace(self, *args):
      del args
      return self

    def lower(self):
      return Lowered()

  import jax  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((1, 1, 1), ('data', 'fsdp', 'tensor'))
  with pytest.raises(compile_lib.DoesNotFit, match='Ran out of memory'):
    compile_lib.compile_step(Jitted(), (), mesh, targets.get_target('v5e-1'))


def test_missing_install_names_the_command():
  """In the CPU environment (no libtpu, no CUDA plugin) the tool says how to install them."""
  if compile_lib._find_spec('libtpu') is not None:  # pylint: disable=protected-access
    pytest.skip('libtpu is installed in this environment (the AOT tier runs here)')
  out = subprocess.run([sys.executable, '-m', 'gnmr_jax.aot', '--config=configs/tiny.py',
                        '--target=v5e-4'], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, check=False)
  assert out.returncode == 2, out.stderr[-2000:]
  assert 'needs libtpu' in out.stderr and 'make aot-venv' in out.stderr


def test_program_cache_round_trip_and_keys(tmp_path):
  from gnmr_jax.aot import program_cache  # pylint: disable=g-import-not-at-top
  program = program_cache.Program('HloModule m', {'temp': 5, 'peak_bytes': 9}, 1.5)
  key = program_cache.key('module @jit_f', 'h100', {'a': 0}, {'jax': '0.10.2'})
  assert program_cache.load(str(tmp_path), key) is None
  program_cache.store(str(tmp_path), key, program)
  got = program_cache.load(str(tmp_path), key)
  assert (got.hlo_text, got.memory, got.compile_s, got.cached) == (
      'HloModule m', {'temp': 5, 'peak_bytes': 9}, 1.5, True)
  # Any part of the key changes it: the program, the target, the options, the versions.
  others = [program_cache.key('module @jit_g', 'h100', {'a': 0}, {'jax': '0.10.2'}),
            program_cache.key('module @jit_f', 'v5e-1', {'a': 0}, {'jax': '0.10.2'}),
            program_cache.key('module @jit_f', 'h100', {'a': 1}, {'jax': '0.10.2'}),
            program_cache.key('module @jit_f', 'h100', {'a': 0}, {'jax': '0.11.0'})]
  assert len({key, *others}) == 5
  # A half-written entry (a killed writer) reads as absent.
  (tmp_path / (others[0] + '.json.gz')).write_bytes(b'\x1f\x8b\x08 truncated')
  assert program_cache.load(str(tmp_path), others[0]) is None
  assert program_cache.load(None, key) is None


def test_dilated_convolution_counts_the_elements_it_meets():
  # A TPU batched matmul (attention's scores): batch dimensions b=4, h=2 as windows of size =
  # lhs dilation, so each output element sums over the 16 features only.
  hlo = '''HloModule m
ENTRY %main (a: f32[4,16,2,8], b: f32[4,16,2,8]) -> f32[4,2,8,8] {
  %a = f32[4,16,2,8]{3,2,1,0} parameter(0)
  %b = f32[4,16,2,8]{3,2,1,0} parameter(1)
  ROOT %c = f32[4,2,8,8]{3,2,1,0} convolution(%a, %b), window={size=4x2 stride=3x1 lhs_dilate=4x2}, dim_labels=0f1b_0i1o->01bf
}'''
  (gemm,) = inventory.parse(hlo).gemms
  assert gemm.flops == 2 * (4 * 2 * 8 * 8) * 16


# --- flash attention: cuDNN's fused attention and Pallas splash, from their custom calls -------
# Grouped-query shapes: B=2 rows, S=T=512, H=8 query heads over K=2 key/value heads, D=64.
B, S, H, K, D = 2, 512, 8, 2, 64


def _cudnn_hlo(backward: bool, mask: str, scores: bool = True) -> str:
  """A forward or backward cuDNN attention call as XLA prints it (backend_config trimmed)."""
  config = ('{"cudnn_fmha_backend_config": {'
            + (f'"intermediate_tensor_shape": {{"element_type": "BF16", "dimensions": '
               f'["{B}", "{H}", "{S}", "{S}"], "tuple_shapes": []}}, ' if scores else '')
            + f'"is_flash_attention": true, "mask_type": "{mask}"}}}}')
  q, kv = f'bf16[{B},{S},{H},{D}]', f'bf16[{B},{S},{K},{D}]'
  if backward:
    call = (f'%att = ({q}{{3,2,1,0}}, {kv}{{3,2,1,0}}, {kv}{{3,2,1,0}}, u8[0]{{0}}) '
            f'custom-call(%q, %k, %v, %lse, %do, %o), '
            'custom_call_target="__cudnn$fmhaSoftmaxBackward", '
            'metadata={op_name="jit(f)/transpose(jvp())/dot_product_attention_bwd"}')
  else:
    call = (f'%att = ({q}{{3,2,1,0}}, f32[{B},{H},{S}]{{2,1,0}}, u8[0]{{0}}) '
            'custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", '
            'metadata={op_name="jit(f)/jvp()/dot_product_attention_fwd"}')
  return f'''HloModule m
ENTRY %main (q: {q}, k: {kv}, v: {kv}, lse: f32[{B},{H},{S}], do: {q}, o: {q}) -> {q} {{
  %q = {q}{{3,2,1,0}} parameter(0)
  %k = {kv}{{3,2,1,0}} parameter(1)
  %v = {kv}{{3,2,1,0}} parameter(2)
  %lse = f32[{B},{H},{S}]{{2,1,0}} parameter(3)
  %do = {q}{{3,2,1,0}} parameter(4)
  %o = {q}{{3,2,1,0}} parameter(5)
  {call}, backend_config={config}
  ROOT %r = {q}{{3,2,1,0}} get-tuple-element(%att), index=0
}}'''


@pytest.mark.parametrize('backward,gemms', [(False, 4), (True, 10)])
@pytest.mark.parametrize('mask,causal', [('CAUSAL', True), ('NO_MASK', False)])
@pytest.mark.parametrize('scores', [True, False])   # without the scores' shape: q, k's
def test_cudnn_attention_flops(backward, gemms, mask, causal, scores):
  # forward: QK^T and PV; backward: QK^T again, dV, dP, dQ, dK; every one 2 * B*H*S*T*D
  (call,) = inventory.parse(_cudnn_hlo(backward, mask, scores)).attention
  full = gemms * B * H * S * S * D
  assert call.flops == (full // 2 if causal else full)
  assert (call.kind.kernel, call.kind.phase, call.causal) == (
      'cudnn', 'bwd' if backward else 'fwd', causal)
  assert (call.batch_heads, call.seq_q, call.seq_kv, call.head_dim) == (B * H, S, S, D)


def test_cudnn_attention_is_a_kernel_with_its_flops_and_traffic():
  inv = inventory.parse(_cudnn_hlo(False, 'CAUSAL'))
  (kernel,) = [k for k in inventory.kernels(inv) if k.attention]
  assert (kernel.attention, kernel.seq_kv) == ('cudnn fwd', S)
  assert kernel.flops == 4 * B * H * S * S * D // 2                        # causal
  assert kernel.bytes_read == 2 * (B * S * H * D + 2 * B * S * K * D)      # q, k, v
  assert kernel.bytes_written == 2 * B * H * S * D + 4 * B * H * S         # o and its lse
  assert inv.gemms == []                                                   # no GEMM of a class


_SPLASH_RESULTS = {
    'fwd_residuals': f'(f32[{B},128,128]{{2,1,0}}, bf16[{B},{H},{S},{D}]{{3,2,1,0}}, '
                     f'f32[{B},{H},{S},128]{{3,2,1,0}})',
    'dq_no_residuals': f'(f32[{B},128,128]{{2,1,0}}, bf16[{B},{H},{S},{D}]{{3,2,1,0}})',
    'dkv_no_residuals': f'(f32[{B},128,{D}]{{2,1,0}}, f32[{B},128,{D}]{{2,1,0}}, '
                        f'bf16[{B},{K},{S},{D}]{{3,2,1,0}}, bf16[{B},{K},{S},{D}]{{3,2,1,0}})',
    # the fused backward: dQ unreduced over the key blocks, [B, T / block, H, S, D], beside dK, dV
    'fused': f'(f32[{B},128,{D}]{{2,1,0}}, f32[{B},128,{D}]{{2,1,0}}, '
             f'bf16[{B},4,{H},{S},{D}]{{4,3,2,1,0}}, bf16[{B},{K},{S},{D}]{{3,2,1,0}}, '
             f'bf16[{B},{K},{S},{D}]{{3,2,1,0}})',
}


def _splash_hlo(kernel: str, causal: bool) -> str:
  """A splash kernel as XLA:TPU prints it: its name and op_name after a multi-line attribute.

  A causal mask (a computable one) reads the q_sequence iota; a full mask does not.
  """
  name = 'dkv_no_residuals' if kernel == 'fused' else kernel
  operands = '%data_next, %block_mask, %q, %k, %v'
  if kernel != 'fwd_residuals':
    operands += ', %lse, %do, %di'
  if causal:
    operands += ', %kv_sequence' if name == 'dkv_no_residuals' else ', %q_sequence'
  q, kv = f'bf16[{B},{H},{S},{D}]', f'bf16[{B},{K},{S},{D}]'
  return f'''HloModule m
ENTRY %main (q: {q}, k: {kv}, v: {kv}, lse: f32[{B},{H},1,{S}], do: {q}, di: f32[{B},{H},1,{S}]) -> {q} {{
  %data_next = s8[1,4,4]{{2,1,0}} constant({{...}})
  %block_mask = s8[1,4,4]{{2,1,0}} constant({{...}})
  %q = {q}{{3,2,1,0}} parameter(0)
  %k = {kv}{{3,2,1,0}} parameter(1)
  %v = {kv}{{3,2,1,0}} parameter(2)
  %lse = f32[{B},{H},1,{S}]{{3,2,1,0}} parameter(3)
  %do = {q}{{3,2,1,0}} parameter(4)
  %di = f32[{B},{H},1,{S}]{{3,2,1,0}} parameter(5)
  %q_sequence = s32[{S},128]{{1,0}} iota(), iota_dimension=0
  %kv_sequence = s32[8,{S}]{{1,0}} iota(), iota_dimension=1
  %call.7 = {_SPLASH_RESULTS[kernel]} custom-call({operands}), custom_call_target="tpu_custom_call", frontend_attributes={{kernel_metadata={{
"xprof_metadata":"{{\\"block_q\\": 128, \\"q_layout\\": 1, \\"k_layout\\": 1, \\"v_layout\\": 1}}"
}}}}, metadata={{op_name="jit(f)/vmap(static_sparsity_splash)/jit(_splash_attention)/splash_mha_{name}/pallas_call"}}, backend_config={{"custom_call_config":{{"body":"TUzvUg=="}}}}
  ROOT %r = {q}{{3,2,1,0}} get-tuple-element(%call.7), index=1
}}'''


@pytest.mark.parametrize('kernel,phase,gemms', [
    ('fwd_residuals', 'fwd', 4),   # QK^T, PV
    ('dq_no_residuals', 'dq', 6),  # QK^T, dP, dQ (splash_attention_kernel.py: dq kernel)
    ('dkv_no_residuals', 'dkv', 8),  # QK^T, dV, dP, dK
    ('fused', 'bwd', 10)])          # dkv with dQ fused in
@pytest.mark.parametrize('causal', [True, False])
def test_splash_attention_flops(kernel, phase, gemms, causal):
  inv = inventory.parse(_splash_hlo(kernel, causal))
  (call,) = inv.attention
  full = gemms * B * H * S * S * D   # H query heads: K = 2 kv heads read, 8 multiplied
  assert call.flops == (full // 2 if causal else full)
  assert (call.kind.kernel, call.kind.phase, call.causal) == ('splash', phase, causal)
  assert (call.batch_heads, call.seq_q, call.seq_kv, call.head_dim, call.head_dim_v) == (
      B * H, S, S, D, D)
  assert call.op_name.endswith('/pallas_call')   # read from the line after the metadata string
  assert inv.attention_flops(forward_only=True) == (call.flops if phase == 'fwd' else 0)


def test_an_instruction_printed_over_several_lines_is_one_instruction():
  inv = inventory.parse(_splash_hlo('fwd_residuals', True))
  call = inv.instructions['call.7']
  assert call.operands == ['data_next', 'block_mask', 'q', 'k', 'v', 'q_sequence']
  assert 'backend_config' in call.attributes and 'r' in inv.instructions
  (kernel,) = [k for k in inventory.kernels(inv) if k.attention]
  assert kernel.op_name.endswith('splash_mha_fwd_residuals/pallas_call')


def test_attention_in_a_loop_counts_every_trip():
  # the splash call above inside a 3-trip while loop (a scan over layers)
  q, kv = f'bf16[{B},{H},{S},{D}]', f'bf16[{B},{K},{S},{D}]'
  call = _splash_hlo('fwd_residuals', True).split('  %call.7 = ', 1)[1].split('\n  ROOT', 1)[0]
  hlo = f'''HloModule m
%body (p: (s32[], {q}, {kv})) -> (s32[], {q}, {kv}) {{
  %p = (s32[], {q}, {kv}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %q = {q}{{3,2,1,0}} get-tuple-element(%p), index=1
  %k = {kv}{{3,2,1,0}} get-tuple-element(%p), index=2
  %v = {kv}{{3,2,1,0}} copy(%k)
  %data_next = s8[1,4,4]{{2,1,0}} constant({{...}})
  %block_mask = s8[1,4,4]{{2,1,0}} constant({{...}})
  %q_sequence = s32[{S},128]{{1,0}} iota(), iota_dimension=0
  %call.7 = {call}
  %o = {q}{{3,2,1,0}} get-tuple-element(%call.7), index=1
  ROOT %t = (s32[], {q}, {kv}) tuple(%i, %o, %k)
}}
%cond (c: (s32[], {q}, {kv})) -> pred[] {{
  %c = (s32[], {q}, {kv}) parameter(0)
  %j = s32[] get-tuple-element(%c), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %three), direction=LT
}}
ENTRY %main (x: (s32[], {q}, {kv})) -> (s32[], {q}, {kv}) {{
  %x = (s32[], {q}, {kv}) parameter(0)
  ROOT %w = (s32[], {q}, {kv}) while(%x), condition=%cond, body=%body
}}'''
  inv = inventory.parse(hlo)
  (call,) = inv.attention
  assert call.executions == 3 and call.flops == 4 * B * H * S * S * D // 2
  assert inv.attention_flops() == 3 * call.flops


@pytest.mark.parametrize('kernel,phase,gemms', [('fwd_residuals', 'fwd', 4),
                                                ('dq_no_residuals', 'dq', 6),
                                                ('dkv_no_residuals', 'dkv', 8)])
def test_a_causal_splash_kernel_is_priced_at_the_blocks_it_computes(kernel, phase, gemms):
  """Splash skips the blocks above the diagonal and computes the others whole: with n blocks
  a side, n (n + 1) / 2 of n^2 (not half), read from the kernel's block sizes."""
  block = 32
  fields = ', '.join(f'\\"{name}\\": {block}' for name in (
      'block_q', 'block_kv', 'block_kv_compute', 'block_q_dkv', 'block_kv_dkv',
      'block_kv_dkv_compute', 'block_q_dq', 'block_kv_dq'))
  hlo = _splash_hlo(kernel, True).replace('\\"block_q\\": 128', fields)
  (call,) = inventory.parse(hlo).attention
  n = S // block
  assert n > 1
  full = gemms * B * H * S * S * D
  assert call.flops == int(full * (n * (n + 1) / 2) / n ** 2)
  assert inventory.causal_block_share(S, S, S, S) == 1.0   # one block: the whole square


def test_a_window_over_a_padded_size_one_dimension_counts_one_element():
  # How XLA:TPU writes a projection whose output is split into heads (h=4 of 8 features): the
  # heads as a window of 4 over a size-1 lhs dimension padded by 3 on each side (compiled for
  # v6e-1, 2026-12-07): each output element meets one real lhs element per input feature.
  hlo = '''HloModule m
ENTRY %main (a: bf16[4,16,64,1], b: bf16[4,8,64,1]) -> bf16[4,16,4,8] {
  %a = bf16[4,16,64,1]{2,1,3,0} parameter(0)
  %b = bf16[4,8,64,1]{2,1,0,3} parameter(1)
  ROOT %c = bf16[4,16,4,8]{3,1,2,0} convolution(%a, %b), window={size=1x4 pad=0_0x3_3 rhs_reversal=0x1}, dim_labels=0bf1_1oi0->0b1f
}'''
  (gemm,) = inventory.parse(hlo).gemms
  assert gemm.flops == 2 * (4 * 16 * 4 * 8) * 64   # the dot [64 tokens, 64] x [64, 32]
  assert inventory.window_taps(6, 3, pad=(1, 1), stride=2) == 8 / 3   # outputs 0..2: 2, 3, 3
