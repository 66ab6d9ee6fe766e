"""The scaling recipes (precision.scaling) in the compiled program: every projection leg stays
an 8-bit GEMM, the scale rides in the cuBLASLt call (a bf16 result, no float32 [M, N] pass),
and a routed delayed-scaling dot quantizes outside its conditional.

Shapes as test_gemms.py (H100: 128 x 128 tokens, 4 layers, remat 'full', bf16). Each recipe's
quantization is shown cheaper than the one before by the bytes the step moves outside its GEMMs
(at this size launches decide the time; BENCHMARKS.md "Scaling recipes" prices the 1b-7b
steps).
"""

import pytest

from aot_helpers import FP8_KINDS, compiled, kinds, projection_forward_flops
from aot_helpers import projection_gemms, total_flops
from gnmr_jax.aot import inventory as inventory_lib, step_time

SHAPE = dict(batch=(128, 128), remat='full', num_layers=4, dtype='bfloat16')
TPU_SHAPE = dict(SHAPE, batch=(32, 64))


def _non_gemm_bytes(inventory):
  """HBM bytes the step's kernels other than GEMMs and attention move (what quantizing adds at
  scale: at this tier's size launches, not bytes, decide the time)."""
  return sum(k['bytes'] * k['executions'] * k['count'] for k in step_time.summarize(inventory)
             if not k['flops'] and k['category'] != 'attention')


@pytest.mark.xdist_group('h100_scaling')  # beside test_gemms.py's h100_fp8 group, in parallel
@pytest.mark.parametrize('scaling', ['tensor', 'delayed'])
def test_h100_fp8_recipes_keep_fp8_gemms_and_write_bf16(scaling):
  config, report, inventory = compiled('h100', 'static', 'fp8', scaling=scaling, **SHAPE)
  gemms = projection_gemms(inventory)
  assert kinds(gemms) <= FP8_KINDS, kinds(gemms)
  assert total_flops(gemms) >= 3 * projection_forward_flops(config)    # remat recomputes
  # The forward and input-gradient legs ask the GEMM for bf16 with the scale folded in; only
  # the weight gradient (a float32 kernel's) returns float32.
  bf16_result = sum(g.total_flops for g in gemms if g.result == 'bf16')
  assert bf16_result >= 2 * projection_forward_flops(config), kinds(gemms)
  assert report['steps']['train']['conditionals'] == 0


@pytest.mark.xdist_group('h100_scaling')  # beside test_gemms.py's h100_fp8 group, in parallel
def test_h100_each_recipe_spends_less_around_its_gemms_than_the_one_before():
  # 'row' is the default: compiled as test_gemms.py does (a cache hit on one worker)
  recipe = lambda scaling: {} if scaling == 'row' else {'scaling': scaling}
  moved = {scaling: _non_gemm_bytes(compiled('h100', 'static', 'fp8', **recipe(scaling),
                                              **SHAPE)[2])
           for scaling in ('row', 'tensor', 'delayed')}
  assert moved['delayed'] < moved['tensor'] < moved['row'], moved


@pytest.mark.xdist_group('h100_scaling')  # beside test_gemms.py's h100_fp8 group, in parallel
def test_h100_routed_delayed_quantizes_outside_the_conditional():
  config, _, inventory = compiled('h100', 'gnmr', 'fp8', scaling='delayed', **SHAPE)
  low_cost = projection_gemms(inventory, branch=0)
  assert kinds(low_cost) <= FP8_KINDS, kinds(low_cost)
  assert total_flops(low_cost) >= 3 * projection_forward_flops(config)
  recovered = projection_gemms(inventory, branch=1)
  assert kinds(recovered) <= {'cublaslt bf16 x bf16 -> f32', 'cublaslt bf16 x bf16 -> bf16'}
  # Inside the low-cost branches no kernel casts an activation or gradient to fp8: those casts
  # are made outside the conditional, in the operand's producer. (XLA may still lay codes out
  # there, 8-bit transposes reading and writing codes only; and the backward recasts the
  # weight from its float32 master, [K, N], far below a token-sized tensor.)
  tokens = config.data.batch_size * config.data.seq_len
  casts_inside = [(k.name, sorted(k.dtypes)) for k in inventory_lib.kernels(inventory)
                  if k.branches and any(index == 0 for _, index in k.branches) and not k.flops
                  and any(d.startswith('f8') for d in k.dtypes)
                  and {'bf16', 'f32'} & set(k.dtypes)
                  and k.bytes_written >= tokens * config.model.d_model]
  assert not casts_inside, casts_inside


@pytest.mark.xdist_group('v5e_int8')
def test_tpu_int8_tensor_recipe_keeps_s8_convolutions():
  config, _, inventory = compiled('v5e-1', 'static', 'int8', scaling='tensor', **TPU_SHAPE)
  gemms = projection_gemms(inventory)
  assert kinds(gemms) == {'convolution s8 x s8 -> s32'}
  assert total_flops(gemms) >= 3 * projection_forward_flops(config)


def test_auto_scaling_resolves_for_the_targets_devices():
  from gnmr_jax.aot import compile as compile_lib, targets  # pylint: disable=g-import-not-at-top
  from gnmr_jax.precision import scaling  # pylint: disable=g-import-not-at-top
  resolved = {name: {path: scaling.resolve('auto', path, compile_lib.topology_devices(
      targets.get_target(name))[0]) for path in ('fp8', 'int8')} for name in ('h100', 'v5e-1')}
  assert resolved == {'h100': {'fp8': 'delayed', 'int8': 'tensor'},
                      'v5e-1': {'fp8': 'row', 'int8': 'tensor'}}


@pytest.mark.xdist_group('h100_scaling')  # beside test_gemms.py's h100_fp8 group, in parallel
def test_the_report_names_the_scaling_recipe():
  from gnmr_jax.aot import report as report_lib  # pylint: disable=g-import-not-at-top
  _, report, _ = compiled('h100', 'static', 'fp8', scaling='delayed', **SHAPE)
  assert report['precision']['scaling'] == 'delayed'
  assert '(scaling delayed)' in report_lib.format_report(report)
