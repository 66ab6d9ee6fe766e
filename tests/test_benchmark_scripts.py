"""Smoke tests of the benchmark scripts a GPU session runs (scripts/gpu_checks.sh).

A broken script costs a device lease, so each one is run here compile-only at a tiny size:
no timing is asserted (benchmarks are never timed tests), only that it runs and prints
its table and last line.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
  out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, 'PYTHONPATH': ROOT}, timeout=600, check=False)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


# Smoke tests: the scripts run and print; no compiled program's speed, memory or value is
# asserted here, so plumbing (no XLA optimizations, conftest.py); the GPU session runs them as is.
@pytest.mark.plumbing
@pytest.mark.parametrize('args,expect', [
    (('benchmarks/model_step.py', '--model', 'tiny', '--batch', '2', '--seq', '32',
      '--paths', 'int8', '--compile_only'), ('int8 | routed |', 'model_routed_empty_over_static')),
    (('benchmarks/routing.py', '--paths', 'int8,saved_activation', '--compile_only'),
     ('saved_activation | routed unroll=8', 'routed_empty_over_static')),
    (('benchmarks/compile_cost.py', '--models', 'tiny', '--seq', '32'), ('tiny | 4 | 28 |',)),
    (('benchmarks/fast_step.py', '--model', 'tiny', '--batch', '2', '--seq', '32', '--paths',
      'fp8:delayed:gnmr', '--compile_only'),
     ('bf16 | reference |', 'fp8:delayed:gnmr | both |', 'fast_step_speedup')),
])
def test_benchmark_script_runs_compile_only(args, expect):
  stdout = _run(*args)
  for text in expect:
    assert text in stdout, stdout


@pytest.mark.parametrize('script', ['gpu_checks.sh', 'gpu_noise_fraction.sh',
                                    'gpu_delayed_regime.sh', 'device_env.sh', 'device_arms.sh'])
def test_gpu_scripts_parse(script):
  out = subprocess.run(['bash', '-n', os.path.join(ROOT, 'scripts', script)],
                       capture_output=True, text=True, check=False)
  assert out.returncode == 0, out.stderr
