"""The emulated microscaling paths (NVFP4, MXFP8) compile for H100 and TPU, static and routed."""

import pytest

from aot_helpers import compiled, kinds, projection_gemms

# Each path once, the two covering both modes and both targets (2 compiles instead of 8: the
# emulated NVFP4 step is the slowest to compile of all paths).
MICROSCALING = [('v5e-1', 'gnmr', 'nvfp4'), ('h100', 'static', 'mxfp8')]


@pytest.mark.parametrize('target,mode,path', MICROSCALING)
def test_emulated_microscaling_paths_compile(target, mode, path):
  _, report, inventory = compiled(target, mode, path)
  assert report['steps']['train']['fits']
  # Emulated: block-scaled values go into a wide dot, never a native block-scaled GEMM.
  gemms = projection_gemms(inventory)
  assert gemms and not any(g.kind == 'cudnn_block_scaled' for g in gemms)
  assert all(g.lhs in ('bf16', 'f32') for g in gemms), kinds(gemms)
  if mode == 'gnmr':
    assert report['steps']['train']['conditionals'] > 0
