"""The step-time model on the H200 anchors' programs, compiled for an H200 here.

The issue's goal, held as a test: the model's fp8 / bf16, int8 / bf16 and unrolled routed /
static ratios of the 16-layer MLP stack are within 15% of those measured on the H200
(benchmarks/anchor_programs.py holds the probes' programs and measurements).
"""

import os
import sys

import pytest

from gnmr_jax.aot import compile as compile_lib
from gnmr_jax.aot import device_specs
from gnmr_jax.aot import inventory
from gnmr_jax.aot import step_time
from gnmr_jax.aot import targets

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'benchmarks'))
import anchor_programs  # pylint: disable=g-import-not-at-top,wrong-import-position

PROGRAMS = ('stack_bf16_static', 'stack_int8_static', 'stack_fp8_static',
            'stack_fp8_cond_unrolled')


@pytest.fixture(scope='module')
def priced():
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  compile_lib.prepare_environment()
  target = targets.get_target('h200')
  mesh = Mesh(compile_lib.topology_devices(target)[:1], ('x',))
  programs = anchor_programs.programs(NamedSharding(mesh, PartitionSpec()))
  spec = device_specs.get_spec('h200')
  out = {}
  for name in PROGRAMS:
    jitted, args = programs[name]
    program, _ = compile_lib.compile_step(jitted, args, mesh, target,
                                          os.environ.get('GNMR_AOT_CACHE_DIR'))
    kernels = step_time.summarize(inventory.parse(program.hlo_text))
    out[name] = step_time.price(kernels, spec).total_s
  return out


@pytest.mark.parametrize('numerator,denominator', [
    ('stack_bf16_static', 'stack_fp8_static'),
    ('stack_bf16_static', 'stack_int8_static'),
    ('stack_fp8_cond_unrolled', 'stack_fp8_static')])
def test_anchor_ratio_within_15_percent(priced, numerator, denominator):
  measured = anchor_programs.MEASURED[numerator] / anchor_programs.MEASURED[denominator]
  model = priced[numerator] / priced[denominator]
  assert abs(model / measured - 1) <= 0.15, (numerator, denominator, model, measured)


def test_bf16_step_prices_its_float32_gemms_as_float32(priced):
  # gpu-anchors.md: 63 of the bf16 step's 95 GEMMs are float32 x float32; priced at the TF32
  # rate the step is within 15% of the measured time (at the bf16 rate it would be ~40% low)
  assert abs(priced['stack_bf16_static'] * 1e3 / anchor_programs.MEASURED[
      'stack_bf16_static'] - 1) <= 0.15
