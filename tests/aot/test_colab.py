"""The notebook's config compiles for Colab's runtimes on the path the picker chooses for each
runtime's device."""

import pytest

from aot_helpers import kinds, load_config, projection_gemms
from gnmr_jax.aot import compile as compile_lib
from gnmr_jax.aot import inventory as inventory_lib
from gnmr_jax.aot import targets as targets_lib
from gnmr_jax.precision import default_low_cost_path

# Colab's runtimes: TPU v5e-1 and v6e-1, GPU T4 (free), L4 and A100; the picker's choice on each.
COLAB = {'v5e-1': 'int8', 'v6e-1': 'int8', 't4': 'int8', 'l4': 'fp8', 'a100': 'int8'}
LOW_COST_KINDS = {
    'int8': {'convolution s8 x s8 -> s32', 'cublaslt s8 x s8 -> s32', 'cublas s8 x s8 -> s32'},
    'fp8': {'cublaslt_fp8 f8e4m3fn x f8e4m3fn -> f32', 'cublaslt_fp8 f8e5m2 x f8e4m3fn -> f32',
            'cublaslt_fp8 f8e4m3fn x f8e5m2 -> f32'},
}


@pytest.mark.parametrize('target', sorted(set(COLAB) - {'v5e-1'}))
def test_quickstart_config_compiles_for_colab_runtimes_on_the_picked_path(target):
  """notebooks/quickstart.ipynb's config, routed, with low_cost_path = default_low_cost_path():
  its SMALL size (configs/tiny.py:runlocal) and its eval step here, to keep the tier short
  (XLA:TPU takes minutes per compile of configs/small.py on 2 cores). The train steps: v5e-1
  in test_gemms.py (routed int8), the full-size ones in BENCHMARKS.md "Compiled for"."""
  devices = compile_lib.topology_devices(targets_lib.get_target(target))
  path = default_low_cost_path(devices[0])       # called on the runtime's own device object
  assert path == COLAB[target]                   # never fp8 where there are no fp8 tensor cores
  config = load_config('tiny', 'runlocal')
  config.precision.low_cost_path = path
  report = compile_lib.compile_config(config, target, steps=('eval',), keep_hlo=True)
  step = report['steps']['eval']
  inventory = inventory_lib.parse(step.pop('hlo'))
  low_cost = projection_gemms(inventory, branch=0)
  assert low_cost and kinds(low_cost) <= LOW_COST_KINDS[path], kinds(low_cost)
  assert step['fits'] and step['conditionals'] >= 7   # per projection (TPU: in the rolled loop)


def test_the_picker_picks_int8_on_a_v5e_chip():
  """The v5e-1 runtime's compile: test_gemms.py's routed int8 step (the picker's choice)."""
  devices = compile_lib.topology_devices(targets_lib.get_target('v5e-1'))
  assert default_low_cost_path(devices[0]) == COLAB['v5e-1']
