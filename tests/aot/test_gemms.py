"""The low-cost GEMMs are really 8-bit in the compiled program: fp8 / int8 on H100, int8 on TPU.

FLOPs, not names: XLA merges the GEMMs that share an operand (q, k, v; gate, up), so each test
sums the projections' GEMM FLOPs of one kind and compares with the model's shape: forward and
both backward legs are 3 x 2 x tokens x layers x sum(K x N) per step.
"""

from aot_helpers import FP8_KINDS, compiled, kinds, projection_forward_flops
from aot_helpers import projection_gemms, total_flops


def test_h100_fp8_static_runs_every_projection_leg_as_an_fp8_gemm():
  config, report, inventory = compiled('h100', 'static', 'fp8')
  gemms = projection_gemms(inventory)
  assert kinds(gemms) <= FP8_KINDS, kinds(gemms)            # no bf16 GEMM for a projection
  assert total_flops(gemms) == 3 * projection_forward_flops(config)
  # e4m3 x e4m3 forward; the backward legs take the e5m2 gradient on one side.
  by_kind = inventory.flops_by_kind(projection=True)
  forward = by_kind['cublaslt_fp8 f8e4m3fn x f8e4m3fn -> f32']
  assert forward == projection_forward_flops(config)
  assert report['steps']['train']['conditionals'] == 0


def test_h100_fp8_routed_low_cost_branch_is_fp8_and_recovery_branch_bf16():
  config, report, inventory = compiled('h100', 'gnmr', 'fp8')
  layers = config.model.num_layers
  projection_conds = [c for c in inventory.conditionals
                      if any(g.projection for branch in inventory.branch_gemms(c)
                             for g in branch)]
  # One conditional per projection per layer in the forward pass and one in the backward.
  assert len(projection_conds) == 2 * 7 * layers
  for cond in projection_conds:
    low_cost, recovery = inventory.branch_gemms(cond)
    assert low_cost and kinds(low_cost) <= FP8_KINDS, (cond, kinds(low_cost))
    assert recovery and kinds(recovery) == {'cublaslt bf16 x bf16 -> f32'}, cond
  flops = 3 * projection_forward_flops(config)
  assert total_flops(projection_gemms(inventory, branch=0)) == flops   # nothing recovered
  assert total_flops(projection_gemms(inventory, branch=1)) == flops   # everything recovered
  assert report['steps']['train']['fits']


def test_h100_int8_static_gemms_are_s8_by_s8_into_s32():
  config, _, inventory = compiled('h100', 'static', 'int8')
  gemms = projection_gemms(inventory)
  assert kinds(gemms) == {'cublaslt s8 x s8 -> s32'}
  assert total_flops(gemms) == 3 * projection_forward_flops(config)


def test_tpu_int8_static_projections_are_s8_convolutions_into_s32():
  """v5e here; v6e's int8 GEMMs: test_runtimes.py's Colab v6e-1 compile."""
  config, report, inventory = compiled('v5e-1', 'static', 'int8')
  gemms = projection_gemms(inventory)
  assert kinds(gemms) == {'convolution s8 x s8 -> s32'}     # the MXU's int8 path
  assert total_flops(gemms) == 3 * projection_forward_flops(config)
  assert report['steps']['train']['memory']['generated_code'] > 0


def test_tpu_int8_routed_low_cost_branch_is_int8():
  config, _, inventory = compiled('v5e-1', 'gnmr', 'int8')
  flops = 3 * projection_forward_flops(config)
  low_cost = projection_gemms(inventory, branch=0)
  assert kinds(low_cost) == {'convolution s8 x s8 -> s32'}
  assert total_flops(low_cost) == flops
  recovered = projection_gemms(inventory, branch=1)
  assert kinds(recovered) <= {'convolution bf16 x bf16 -> f32', 'convolution bf16 x bf16 -> bf16'}
  assert total_flops(recovered) == flops
