"""Gradient accumulation in the compiled program, and --fit choosing from compiled programs.

The tiny model at 2048 tokens a sequence: its activations (XLA attention keeps float32 scores
with two sequence axes) dominate the step, as a large model's do on a small chip.
"""

import json
import os
import subprocess
import sys

import pytest

from aot_helpers import REPO, load_config
from gnmr_jax.aot import compile as compile_lib
from gnmr_jax.aot import fit as fit_lib

SEQ = 2048


def _long_sequences(batch: int, accum: int = 1):
  config = load_config('tiny', 'runlocal')
  config.precision.mode = 'static'
  config.data.seq_len = config.model.max_seq_len = SEQ
  config.data.batch_size = batch
  config.train.grad_accum_steps = accum
  config.model.attention = 'xla'  # float32 [B, H, S, S] scores: what a small chip runs out of
  return config


@pytest.mark.parametrize('target', ['t4', 'v5e-1'])
def test_the_accumulated_step_holds_one_micro_batch_of_activations(target):
  micro = compile_lib.compile_config(_long_sequences(4), target, ('train',))
  accumulated = compile_lib.compile_config(_long_sequences(16, accum=4), target, ('train',))
  reports = {'micro': micro, 'accumulated': accumulated}
  if target == 't4':  # what accumulation saves, once (a TPU compile costs ~3x a GPU one here)
    reports['whole'] = compile_lib.compile_config(_long_sequences(16), target, ('train',))
  temp = {name: report['steps']['train']['memory']['temp'] for name, report in reports.items()}
  # One micro-batch's activations, plus the float32 gradient sum the scan carries.
  assert temp['accumulated'] <= 1.2 * temp['micro'], temp
  assert temp.get('whole', 4 * temp['micro']) > 3 * temp['micro'], temp
  step = accumulated['steps']['train']
  assert 4 in step['loops'].values(), step['loops']  # the micro-batch scan, 4 trips


def test_accumulation_choices_keep_the_micro_batch_on_the_mesh():
  assert fit_lib.accumulation_choices(256, 1) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
  assert fit_lib.accumulation_choices(24, 4) == [1, 2]
  assert fit_lib.accumulation_choices(6, 4) == []


def test_the_next_accumulation_comes_from_the_compiled_memory():
  choices = [1, 2, 4, 8, 16, 32]
  device = 16 * 2 ** 30
  # libtpu 0.0.42's refusal names the temporaries: 134 GiB at k = 1 needs k >= 8.4 -> 16.
  refusal = ('RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO '
             'temporaries (134.16G) exceeds available HBM (15.75G).')
  tried = fit_lib._candidate({'steps': {'train': {'fits': False, 'error': refusal}}}, 1, 'none',
                             256)
  assert tried.refused_bytes == int(134.16 * 2 ** 30)
  assert fit_lib._next_choice(choices, tried, device) == 16
  # A compiled program's figures: 6 GiB fixed, 20 GiB of temporaries at k = 2 -> k >= 4.
  compiled = fit_lib.Candidate(2, 128, 'none', False, 26 * 2 ** 30, 20 * 2 ** 30, None, 1.0)
  assert fit_lib._next_choice(choices, compiled, device) == 4
  # Params and optimizer state alone past the device: no accumulation helps.
  hopeless = fit_lib.Candidate(1, 256, 'none', False, 40 * 2 ** 30, 20 * 2 ** 30, None, 1.0)
  assert fit_lib._next_choice(choices, hopeless, device) is None
  # Refused without a figure: the next k.
  silent = fit_lib.Candidate(4, 64, 'full', False, None, None, None, None)
  assert fit_lib._next_choice(choices, silent, device) == 8


def test_fit_cli_compiles_candidates_and_chooses_the_fastest_that_fits(tmp_path):
  out = tmp_path / 'fit.json'
  env = {**os.environ, 'PYTHONPATH': REPO}
  run = subprocess.run(
      [sys.executable, '-m', 'gnmr_jax.aot', '--config=configs/tiny.py:runlocal',
       '--target=h100', '--fit', '--config.precision.mode=static',
       f'--config.data.seq_len={SEQ}', f'--config.model.max_seq_len={SEQ}',
       '--config.model.attention=xla', '--config.data.batch_size=512', '--fit_remat=none,full',
       f'--json={out}'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  result = json.loads(out.read_text())
  candidates = result['candidates']
  by_remat = {}
  for c in candidates:
    by_remat.setdefault(c['remat'], []).append(c)
  # Each policy stops at its first accumulation that fits; what it tried before did not.
  for remat, tried in by_remat.items():
    assert [c['fits'] for c in tried][:-1] == [False] * (len(tried) - 1), (remat, tried)
    assert [c['grad_accum_steps'] for c in tried] == sorted(c['grad_accum_steps'] for c in tried)
  assert not candidates[0]['fits'], 'the whole batch should not fit: the test shows nothing'
  assert {c['remat'] for c in candidates} == {'none', 'full'}
  chosen = result['chosen']
  assert result['priced'] and chosen['fits']
  fitting = [c for c in candidates if c['fits']]
  assert chosen['tokens_per_s'] == max(c['tokens_per_s'] for c in fitting)
  assert result['overrides'] == [f"--config.train.grad_accum_steps={chosen['grad_accum_steps']}",
                                 f"--config.model.remat={chosen['remat']}"]
  assert f"chosen (the fastest by the step-time model): accumulation " \
         f"{chosen['grad_accum_steps']} x micro-batch {chosen['micro_batch']}" in run.stdout
