"""NVFP4 and MXFP8 compiled: emulated on H100 and TPU, native cuDNN block-scaled GEMMs on B200."""

import pytest

from aot_helpers import compiled, kinds, projection_forward_flops, projection_gemms, total_flops

# Each path once, the two covering both modes and both targets (2 compiles instead of 8: the
# emulated NVFP4 step is the slowest to compile of all paths).
MICROSCALING = [('v5e-1', 'gnmr', 'nvfp4'), ('h100', 'static', 'mxfp8')]
NATIVE_KIND = {'nvfp4': 'cudnn_block_scaled f4e2m1fn x f4e2m1fn -> f32',
               'mxfp8': 'cudnn_block_scaled f8e4m3fn x f8e4m3fn -> f32'}
BF16_KINDS = {'cublaslt bf16 x bf16 -> f32', 'cublaslt bf16 x bf16 -> bf16'}


@pytest.mark.parametrize('target,mode,path', MICROSCALING)
def test_emulated_microscaling_paths_compile(target, mode, path):
  """'auto' stays emulated where no block-scaled tensor core exists (H100: XLA would expand
  the native call into float32 dots; TPU: no lowering at all)."""
  _, report, inventory = compiled(target, mode, path)
  assert report['steps']['train']['fits']
  # Emulated: block-scaled values go into a wide dot, never a native block-scaled GEMM.
  gemms = projection_gemms(inventory)
  assert gemms and not any(g.kind == 'cudnn_block_scaled' for g in gemms)
  assert all(g.lhs in ('bf16', 'f32') for g in gemms), kinds(gemms)
  if mode == 'gnmr':
    assert report['steps']['train']['conditionals'] > 0


# (mode, low-cost path, recovery path): the static steps, a routed MXFP8 step recovering in
# bf16, and NVIDIA's forward-only late switch (its recovery path keeps an NVFP4 backward).
NATIVE = [('static', 'nvfp4', 'bf16'), ('static', 'mxfp8', 'bf16'),
          ('gnmr', 'mxfp8', 'bf16'), ('gnmr', 'nvfp4', 'nvfp4_backward')]
# Every GEMM dimension a multiple of 128 (4 x 32 tokens): XLA pads smaller ones up to 128 for
# cuDNN's scale layout, which would make the FLOPs it runs exceed the model's.
NATIVE_SHAPE = dict(d_model=128, ffn_dim=256)


@pytest.mark.parametrize('mode,path,recovery', NATIVE)
def test_b200_runs_every_quantized_projection_leg_as_a_cudnn_block_scaled_gemm(
    mode, path, recovery):
  """'auto' on a B200 target: the forward and both backward GEMMs of every projection are
  cuDNN block-scaled GEMMs of the format's dtypes (their FLOPs those of three matmuls per
  projection), with no emulating bf16 dot beside them; routed, the recovery branch runs
  bf16 GEMMs exactly for the legs its path does not quantize."""
  config, report, inventory = compiled('b200', mode, path, recovery=recovery, **NATIVE_SHAPE)
  assert report['steps']['train']['fits']
  forward = projection_forward_flops(config)
  low_cost = projection_gemms(inventory, branch=0)
  assert kinds(low_cost) == {NATIVE_KIND[path]}, kinds(low_cost)
  assert total_flops(low_cost) == 3 * forward
  if mode == 'static':
    assert report['steps']['train']['conditionals'] == 0
    return
  recovered = projection_gemms(inventory, branch=1)
  native = [g for g in recovered if g.kind == 'cudnn_block_scaled']
  bf16 = [g for g in recovered if g.kind != 'cudnn_block_scaled']
  assert kinds(bf16) <= BF16_KINDS, kinds(bf16)
  native_legs = 2 if recovery == 'nvfp4_backward' else 0   # dx and dW stay NVFP4
  assert total_flops(native) == native_legs * forward
  assert total_flops(bf16) == (3 - native_legs) * forward
  assert not [g for g in native if not g.backward]          # the forward is bf16


def test_the_report_names_the_resolved_implementation():
  """The tool's report says which implementation 'auto' became for the target."""
  from gnmr_jax.aot import report as report_lib
  _, native, _ = compiled('b200', 'static', 'nvfp4', recovery='bf16', **NATIVE_SHAPE)
  _, emulated, _ = compiled('h100', 'static', 'mxfp8')
  assert native['precision']['microscaling_impl'] == 'native'
  assert emulated['precision']['microscaling_impl'] == 'emulated'
  assert '(microscaling native)' in report_lib.format_report(native)
