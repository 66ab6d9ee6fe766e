"""The tool itself: every config compiles for a target it is meant for, the command line's
report and exit codes, and `train_loop.build` on a topology mesh."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import pytest

from aot_helpers import REPO, load_config
from gnmr_jax import sharding, train_loop
from gnmr_jax.aot import compile as compile_lib
from gnmr_jax.aot import targets as targets_lib

# configs/<file>:<arg> -> a target it is meant for. GPUs here: XLA:TPU takes a minute or more
# per multi-chip compile on 2 cores, so the TPU slices (v5e-4, v5p-64) are in BENCHMARKS.md's
# "Compiled for" (scripts/aot_report.py) and the tier keeps one v5e-4 compile (the CLI test).
# The llama sizes differ in width and depth only: the tier compiles three of them; BENCHMARKS.md
# has every size at full depth.
CONFIGS = {('tiny', None): 't4', ('small', None): 'h100', ('llama', '60m'): 'l4',
           ('llama', '1b'): 'a100', ('llama', '13b'): 'h100:2x8'}


def test_every_config_file_and_variant_is_listed():
  files = {name[:-3] for name in os.listdir(os.path.join(REPO, 'configs'))
           if name.endswith('.py') and not name.startswith('_')}
  assert files == {name for name, _ in CONFIGS}
  spec = importlib.util.spec_from_file_location('llama_sizes', os.path.join(REPO, 'configs',
                                                                            'llama.py'))
  llama = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(llama)
  assert {arg for name, arg in CONFIGS if name == 'llama'} <= set(llama.PAPER_SIZES)


@pytest.mark.parametrize('name,arg', sorted(CONFIGS, key=str))
def test_every_config_compiles_for_its_target(name, arg):
  """Each config's eval step at one layer, its own width, sequence, vocabulary and batch, on its
  mesh over the target (BENCHMARKS.md "Compiled for" has the train steps at full depth)."""
  config = load_config(name, arg)
  config.model.num_layers = 1
  target = targets_lib.get_target(CONFIGS[name, arg])
  if target.num_hosts > 1:  # fsdp over hosts, tensor parallel inside a host
    per_host = target.num_devices // target.num_hosts
    config.mesh.tensor, config.mesh.fsdp = min(per_host, 8), -1
  report = compile_lib.compile_config(config, target, steps=('eval',))
  step = report['steps']['eval']
  assert step['fits'], step['memory']
  assert report['num_hosts'] == target.num_hosts
  if target.num_devices > 1:
    assert step['collectives'], 'a sharded step moves data between devices'


def test_build_on_a_topology_mesh_is_abstract():
  devices = compile_lib.topology_devices(targets_lib.get_target('v5e-4'))
  config = load_config('tiny', 'runlocal')
  mesh = sharding.make_mesh(config.mesh, devices)
  run, state, batch = compile_lib.build_abstract(config, devices)
  assert run.mesh.devices.size == 4 and dict(run.mesh.shape)['fsdp'] == 4
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree_util.tree_leaves(state))
  assert batch['inputs'].sharding.mesh.devices.size == 4
  assert mesh.devices.size == 4


def _cli(*args):
  env = {**os.environ, 'PYTHONPATH': REPO}
  return subprocess.run([sys.executable, '-m', 'gnmr_jax.aot', *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=600, check=False)


def test_cli_report_json_and_exit_codes(tmp_path):
  out = tmp_path / 'report.json'
  ok = _cli('--config=configs/tiny.py:runlocal', '--target=v5e-4', '--steps=eval',
            '--config.precision.mode=static', f'--json={out}')
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert 'eval step: fits' in ok.stdout and 'convolution s8 x s8 -> s32' in ok.stdout
  report = json.loads(out.read_text())
  assert report['target'] == 'v5e-4' and report['versions']['jax'] == jax.__version__
  assert report['mesh'] == {'data': 1, 'fsdp': 4, 'tensor': 1}
  assert 'all-gather' in report['steps']['eval']['collectives']   # FSDP gathers the weights


def test_a_batch_the_device_cannot_hold_is_reported_and_the_largest_fitting_one_found(tmp_path):
  out = tmp_path / 'big.json'
  big = _cli('--config=configs/tiny.py:runlocal', '--target=t4', '--steps=eval',
             '--config.precision.mode=static', '--config.data.seq_len=4096',
             '--config.model.max_seq_len=4096', '--config.data.batch_size=64', '--fit_batch',
             f'--json={out}')
  assert big.returncode == 3, big.stderr[-2000:]       # gnmr_jax.aot's EXIT_DOES_NOT_FIT
  assert 'eval step: DOES NOT FIT' in big.stdout and 'largest batch that fits: ' in big.stdout
  report = json.loads(out.read_text())
  assert report['steps']['eval']['margin_bytes'] < 0 and not compile_lib.fits(report)
  found = report['largest_fitting_batch']
  assert found and found < 64 and compile_lib.fits(report['fitting_report'])
  assert report['fitting_report']['batch_size'] == found


def test_cli_bad_input_names_what_is_wrong():
  bad = _cli('--config=configs/tiny.py:runlocal', '--target=h900')
  assert bad.returncode == 2 and "unknown target 'h900'" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.parametrize('target,mesh,expect', [
    ('v5e-3', {}, 'v5e slices come in sizes'),
    ('v5e-4', {'fsdp': 3}, "config.mesh does not fit the target's 4 devices"),
    ('h100', {'tensor': 2}, "config.mesh does not fit the target's 1 devices")])
def test_bad_targets_and_meshes_are_refused_before_compiling(target, mesh, expect):
  config = load_config('tiny', 'runlocal')
  config.mesh.update(mesh)
  with pytest.raises(ValueError, match=expect):
    compile_lib.compile_config(config, target)


def test_cli_step_time_prices_the_train_step_with_its_flash_attention(tmp_path):
  """--step_time: the train step's price on paper, cuDNN flash attention counted (tiny, bf16)."""
  out = tmp_path / 'step_time.json'
  run = _cli('--config=configs/tiny.py:runlocal', '--target=h100', '--steps=train',
             '--step_time', '--config.precision.mode=static',
             '--config.precision.low_cost_path=bf16', '--config.model.dtype=bfloat16',
             '--config.model.attention=cudnn', '--config.data.seq_len=128',
             '--config.model.max_seq_len=128', f'--json={out}')
  assert run.returncode == 0, run.stderr[-2000:]
  assert 'step time on paper (h100 roofline, per device): ' in run.stdout
  assert 'calibration: bf16 step -8.1%' in run.stdout
  report = json.loads(out.read_text())
  projection = report['steps']['train']['step_time']
  config = load_config('tiny', 'runlocal').model
  batch, seq, layers = report['batch_size'], 128, config.num_layers
  heads, head_dim = config.num_heads, config.d_model // config.num_heads
  # per layer a causal forward (QK^T, PV) and backward (5 GEMMs): (4 + 10) B H S^2 D / 2
  assert projection['attention_kernel_flops'] == layers * 7 * batch * heads * seq ** 2 * head_dim
  assert projection['shares']['attention'] > 0
  assert projection['tokens_per_s'] == pytest.approx(batch * seq / projection['step_s'])
  assert projection['mfu'] == pytest.approx(
      projection['model_flops'] / projection['step_s'] / 989.4e12)
