"""The low-cost GEMMs are really 8-bit in the compiled program, and the routed step costs what
the static one does: fp8 / int8 on H100, int8 on TPU v5e.

FLOPs, not names: XLA merges the GEMMs that share an operand (q, k, v; gate, up), so each test
sums the projections' GEMM FLOPs of one kind and compares with the model's shape: forward and
both backward legs are 3 x 2 x tokens x layers x sum(K x N) per step.

With remat the backward pass recomputes the forward projections it needs, so those steps run
at least (not exactly) 3 x; without remat exactly 3 x.

Routed temporaries, the derived bound: under remat 'full' both steps save only each layer's
input and recompute a layer at a time in the backward pass; routing adds, per projection, a
conditional whose recovery branch holds bf16 copies of its operands. Those live for one layer
(in the forward and again in the backward pass) whatever the depth, so
  routed temp <= static temp + 2 passes x tokens x (6 d + f) x 2 bytes (one layer's bf16
  operands of q, k, v, o, gate, up (width d) and down (width f)),
with 25% slack for XLA's buffer packing. At 1B that is <= 1.15 x static (the routed-step
issue's goal; measured 1.10x on TPU v5e-4, 0.61x on H100, BENCHMARKS.md). What breaks it: a
fully unrolled routed step in which XLA merges the recomputation into the forward pass (no CSE
prevention) keeps every layer's activations: +165 MB here on H100 against a bound of 42 MB
(313 vs 148 MB), 3.2x static at 1B. H100: 128 x 128 tokens and 4 layers, so that activations,
not cuBLAS's fixed 32 MB workspace, decide the temporaries; v5e: 32 x 64 tokens (XLA:TPU
compiles large shapes slowly). Every compile here serves several tests.
"""

import pytest

from aot_helpers import FP8_KINDS, compiled, kinds, projection_forward_flops
from aot_helpers import projection_gemms, total_flops

SHAPE = dict(batch=(128, 128), remat='full', num_layers=4, dtype='bfloat16')
# 64 x 128 tokens: enough that both TPU steps keep their temporaries in HBM, where the memory
# analysis counts them. At 32 x 64 the static step's fit the on-chip memory it does not count
# (temp 0 B) while the routed step's conditionals kept 9.2 MB of them in HBM, so the bound
# below compared on-chip with HBM bytes; at 64 x 128 (libtpu 0.0.42.1, 2026-12-07): static
# 26.7 MB, routed 28.5 MB, bound 47.7 MB.
TPU_SHAPE = dict(SHAPE, batch=(64, 128))
SLACK = 1.25


@pytest.mark.xdist_group('h100_fp8')
def test_h100_fp8_static_runs_every_projection_leg_as_an_fp8_gemm():
  config, report, inventory = compiled('h100', 'static', 'fp8', **SHAPE)
  gemms = projection_gemms(inventory)
  assert kinds(gemms) <= FP8_KINDS, kinds(gemms)            # no bf16 GEMM for a projection
  assert total_flops(gemms) >= 3 * projection_forward_flops(config)    # remat recomputes
  # e4m3 x e4m3 forward; the backward legs take the e5m2 gradient on one side (both sides).
  by_kind = inventory.flops_by_kind(projection=True)
  gradient_legs = sum(v for k, v in by_kind.items() if 'f8e5m2' in k)
  assert gradient_legs == 2 * projection_forward_flops(config)
  assert report['steps']['train']['conditionals'] == 0


@pytest.mark.xdist_group('h100_fp8')
def test_h100_fp8_routed_low_cost_branch_is_fp8_and_recovery_branch_bf16():
  config, report, inventory = compiled('h100', 'gnmr', 'fp8', **SHAPE)
  layers = config.model.num_layers
  projection_conds = [c for c in inventory.conditionals
                      if any(g.projection for branch in inventory.branch_gemms(c)
                             for g in branch)]
  # One conditional per projection per layer in the forward pass, its recomputation (remat)
  # and the backward pass.
  assert len(projection_conds) >= 2 * 7 * layers
  for cond in projection_conds:
    low_cost, recovery = inventory.branch_gemms(cond)
    assert low_cost and kinds(low_cost) <= FP8_KINDS, (cond, kinds(low_cost))
    assert recovery and kinds(recovery) <= {'cublaslt bf16 x bf16 -> f32',
                                             'cublaslt bf16 x bf16 -> bf16'}, cond
  nothing, everything = (total_flops(projection_gemms(inventory, branch=b)) for b in (0, 1))
  assert nothing == everything >= 3 * projection_forward_flops(config)   # remat recomputes
  assert report['steps']['train']['fits']


def test_h100_int8_static_gemms_are_s8_by_s8_into_s32():
  config, _, inventory = compiled('h100', 'static', 'int8')
  gemms = projection_gemms(inventory)
  assert kinds(gemms) == {'cublaslt s8 x s8 -> s32'}
  assert total_flops(gemms) == 3 * projection_forward_flops(config)


@pytest.mark.xdist_group('v5e_int8')
def test_tpu_int8_static_projections_are_s8_convolutions_into_s32():
  """v5e here; v6e's int8 GEMMs: test_runtimes.py's Colab v6e-1 compile."""
  config, report, inventory = compiled('v5e-1', 'static', 'int8', **TPU_SHAPE)
  gemms = projection_gemms(inventory)
  assert kinds(gemms) == {'convolution s8 x s8 -> s32'}     # the MXU's int8 path
  assert total_flops(gemms) >= 3 * projection_forward_flops(config)    # remat recomputes
  assert report['steps']['train']['memory']['generated_code'] > 0


@pytest.mark.xdist_group('v5e_int8')
def test_tpu_int8_routed_low_cost_branch_is_int8():
  config, _, inventory = compiled('v5e-1', 'gnmr', 'int8', **TPU_SHAPE)
  low_cost = projection_gemms(inventory, branch=0)
  assert kinds(low_cost) == {'convolution s8 x s8 -> s32'}
  assert total_flops(low_cost) >= 3 * projection_forward_flops(config)
  recovered = projection_gemms(inventory, branch=1)
  assert kinds(recovered) <= {'convolution bf16 x bf16 -> f32', 'convolution bf16 x bf16 -> bf16'}
  assert total_flops(recovered) == total_flops(low_cost)


def _temporaries(target, path, shape):
  """(static temp, routed temp, the derived bound on routed temp, static step, routed step)."""
  config, static, _ = compiled(target, 'static', path, **shape)
  _, routed, _ = compiled(target, 'gnmr', path, **shape)
  static_step, routed_step = static['steps']['train'], routed['steps']['train']
  tokens = config.data.batch_size * config.data.seq_len
  model = config.model
  one_layer = 2 * tokens * (6 * model.d_model + model.ffn_dim) * 2
  static_temp = static_step['memory']['temp']
  return (static_temp, routed_step['memory']['temp'], static_temp + SLACK * one_layer,
          static_step, routed_step)


@pytest.mark.xdist_group('h100_fp8')
def test_h100_routed_temporaries_stay_within_the_bound_with_layers_unrolled():
  static, routed, bound, static_step, routed_step = _temporaries('h100', 'fp8', SHAPE)
  assert routed <= bound, (static, routed, bound)
  # GPU defaults: both steps' layers unrolled (model_configs.static_scan_unroll)
  assert not routed_step['loops'] and not static_step['loops']


@pytest.mark.xdist_group('v5e_int8')
def test_tpu_routed_program_stays_within_its_bound_with_the_loop_rolled():
  _, _, _, static_step, routed_step = _temporaries('v5e-1', 'int8', TPU_SHAPE)
  assert len(routed_step['loops']) == len(static_step['loops']) == 2    # TPU default: rolled
  code = routed_step['memory']['generated_code'] / static_step['memory']['generated_code']
  assert code <= 2, code   # the routed-step issue's goal for the program


@pytest.mark.xdist_group('v5e_int8')
def test_tpu_routed_temporaries_stay_within_the_bound_with_the_loop_rolled():
  static, routed, bound, _, _ = _temporaries('v5e-1', 'int8', TPU_SHAPE)
  assert static > 0, 'the static step fits on-chip: the bound would compare on-chip with HBM'
  assert routed <= bound, (static, routed, bound)
