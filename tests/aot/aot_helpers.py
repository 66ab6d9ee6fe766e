"""Shared by the AOT tier: the small config every test compiles, compiled once per file."""

from __future__ import annotations

import functools
import importlib.util
import os

from gnmr_jax.aot import compile as compile_lib
from gnmr_jax.aot import inventory as inventory_lib
from gnmr_jax.model import unit_kernel_shapes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROJECTIONS = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')


def load_config(name: str, arg=None):
  """configs/<name>.py:get_config(arg), as train.py --config reads it."""
  spec = importlib.util.spec_from_file_location(f'aot_config_{name}',
                                                os.path.join(REPO, 'configs', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def tier_config(mode: str = 'static', path: str = 'int8', batch=None, recovery: str = 'bf16',
                scaling: str = 'row', **model):
  """configs/tiny.py:runlocal (2 layers, d_model 64, batch 4 x 32): seconds to compile.

  `batch` = (batch_size, seq_len) replaces the data shape; `recovery` is the recovery path;
  `scaling` the int8 / fp8 scaling recipe; `model` fields replace the model's.
  """
  config = load_config('tiny', 'runlocal')
  config.precision.mode, config.precision.low_cost_path = mode, path
  config.precision.recovery_path, config.precision.scaling = recovery, scaling
  if batch is not None:
    config.data.batch_size, config.data.seq_len = batch
  for field, value in model.items():
    config.model[field] = value
  return config


@functools.lru_cache(maxsize=None)
def compiled(target: str, mode: str = 'static', path: str = 'int8', step: str = 'train',
             batch=None, recovery: str = 'bf16', scaling: str = 'row', **model):
  """(config, report, inventory) of the tier config's `step` compiled for `target`."""
  config = tier_config(mode, path, batch, recovery, scaling, **dict(model))
  report = compile_lib.compile_config(config, target, steps=(step,), keep_hlo=True)
  inventory = inventory_lib.parse(report['steps'][step].pop('hlo'))
  return config, report, inventory


def projection_forward_flops(config, num_devices: int = 1) -> int:
  """FLOPs of the projections' forward matmuls in one step, per device (no tensor axis)."""
  tokens = config.data.batch_size * config.data.seq_len
  per_layer = sum(k * n for k, n in unit_kernel_shapes(config.model))
  return 2 * tokens * per_layer * config.model.num_layers // num_devices


def projection_gemms(inventory, branch=0):
  """The projections' GEMMs a step runs with every conditional on `branch`."""
  return [g for g in inventory.taken(branch) if g.projection is not None]


def total_flops(gemms) -> int:
  return sum(g.total_flops for g in gemms)


def kinds(gemms) -> set:
  return {f'{g.kind} {g.lhs} x {g.rhs} -> {g.result}' for g in gemms}


FP8_KINDS = {'cublaslt_fp8 f8e4m3fn x f8e4m3fn -> f32', 'cublaslt_fp8 f8e5m2 x f8e4m3fn -> f32',
             'cublaslt_fp8 f8e4m3fn x f8e5m2 -> f32', 'cublaslt_fp8 f8e4m3fn x f8e4m3fn -> bf16',
             'cublaslt_fp8 f8e5m2 x f8e4m3fn -> bf16', 'cublaslt_fp8 f8e4m3fn x f8e5m2 -> bf16'}
