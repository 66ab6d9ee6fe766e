"""experiments/: arm configs and chains, and the report generated from a results JSON."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gnmr_jax  # pylint: disable=g-import-not-at-top
from experiments import common, report
from experiments import scenario1_saved_activation as scenario1
from experiments import scenario2_blockwise as scenario2


def test_arm_config_applies_overrides_and_seed_and_validates():
  config = common.arm_config(scenario1.base('cpu'), scenario1.ARMS[5], seed=2)  # gnmr2_8
  assert config.precision.mode == 'gnmr' and config.precision.saved_activation_bits == 2
  assert config.precision.recovery_saved_activation_bits == 8
  assert config.precision.saved_activation_scale == 'tensor'
  assert config.train.seed == 2 and config.data.seed == 2
  gnmr_jax.config.validate_config(config, 1)
  for arm in scenario1.ARMS + scenario2.ARMS:
    gnmr_jax.config.validate_config(common.arm_config(scenario1.base('cpu'), arm, 0), 1)
  gpu = scenario1.base('gpu')
  assert (gpu.model.d_model, gpu.model.num_layers) == (512, 8)


def test_scenario1_has_every_arm_the_issue_asks_for():
  names = {a.name for a in scenario1.ARMS}
  assert {'bf16', 'static8', 'static4', 'gnmr4_8', 'static2', 'gnmr2_8', 'random2_8',
          'gnmr2_8_score_only', 'gnmr2_8_delta_only', 'gnmr2_8_no_lock', 'gnmr2_8_max_o2',
          'gnmr2_8_max_o8', 'static2_global_clip', 'static2_zclip', 'static2_adagc'} <= names
  assert {a.name for a in scenario2.ARMS} == {'bf16', 'block8', 'block6', 'gnmr6_8'}


@pytest.mark.parametrize('name,state_type', [
    ('gnmr2_8', None), ('random2_8', None), ('static2_zclip', 'ZClipState'),
    ('static2_adagc', 'AdaGCState'), ('static2_global_clip', 'EmptyState')])
def test_arm_chain_holds_one_gnmr_state_and_the_configured_clip(name, state_type):
  arm = next(a for a in scenario1.ARMS if a.name == name)
  config = common.arm_config(scenario1.base('cpu'), arm, 0)
  config.gnmr.units, config.gnmr.layer_axis, config.gnmr.warmup = r'^w$', r'^w$', 2
  tx = common.make_tx_for(arm, 0)(config)
  params = {'w': jnp.zeros((6, 4, 4)), 'b': jnp.zeros(4)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  rng = np.random.default_rng(0)
  for _ in range(4):
    grads = {'w': jnp.asarray(rng.standard_normal((6, 4, 4)), jnp.float32), 'b': jnp.zeros(4)}
    _, state = update(grads, state, params)
  ctl = gnmr_jax.controller_state(state)
  if name == 'random2_8':  # max_o (4) of the 6 layer units every step after warmup
    assert int(np.sum(ctl.mask['w'])) == config.gnmr.max_o
    assert int(ctl.telemetry.active_unit_steps) == 2 * config.gnmr.max_o
  # chain(controller, apply_if_finite(chain([clip,] adamw))): the guarded inner chain.
  inner = state[1].inner_state
  assert len(inner) == (2 if state_type else 1)
  if state_type:
    assert type(inner[0]).__name__ == state_type


def _fake_results(tmp_path):
  def run(seed, ppl, steps_s, rec=0.0, exc=1.0):
    return {'seed': seed, 'eval_perplexity': ppl, 'eval_loss': float(np.log(ppl)),
            'recovered_unit_steps_pct': rec, 'threshold_exceedance_pct': exc,
            'step_seconds': steps_s, 'num_nonfinite_steps': 0,
            'train_curve': [[10, 3.0], [20, 2.5]], 'eval_curve': [[20, float(np.log(ppl))]]}

  def arm(label, role, ppls, steps_s=0.1, rec=0.0, exc=1.0):
    return {'label': label, 'role': role, 'overrides': {'controller': 'gnmr'},
            'runs': [run(i, p, steps_s, rec, exc) for i, p in enumerate(ppls)]}

  heat = {'units': ['layers/attn/q/kernel[0]', 'layers/attn/q/kernel[1]'], 'steps': [5, 10],
          'mask': [[1, 0], [0, 1]]}
  arms = {'bf16': arm('bf16', 'reference', [8.0, 8.2, 8.1]),
          'static8': arm('static 8', 'static', [8.1, 8.1, 8.1]),
          'static4': arm('static 4', 'static', [10.0, 10.2, 10.4], steps_s=0.2),
          'gnmr4_8': arm('GNMR 4/8', 'gnmr', [8.1, 8.2, 8.0], steps_s=0.22, rec=3.5,
                         exc=0.1)}
  arms['gnmr4_8']['runs'][0]['heatmap'] = heat
  payload = {'scenario': 'scenario1', 'scale': 'cpu', 'date': '2026-01-01', 'device': 'CPU',
             'versions': {'jax': '0', 'flax': '0', 'optax': '0'}, 'wall_seconds': 60.0,
             'command': 'python x', 'notes': {'low_cost_arm': 'static4'},
             'base_config': scenario1.base('cpu').to_dict(), 'arms': arms}
  results = tmp_path / 'results'
  results.mkdir()
  (results / 'scenario1_cpu.json').write_text(json.dumps(payload))
  before = dict(payload, arms={'static4': arm('static 4', 'static', [10.0, 10.0, 10.0])})
  (results / 'scenario1_cpu_shared_data.json').write_text(json.dumps(before))
  return results


def test_report_regenerates_tables_claims_figures_and_not_run_sections(tmp_path, monkeypatch):
  monkeypatch.setattr(report, 'RESULTS_DIR', str(_fake_results(tmp_path)))
  monkeypatch.setattr(report, 'FIGURES_DIR', str(tmp_path / 'figures'))
  monkeypatch.setattr(report, 'REPORT', str(tmp_path / 'RESULTS.md'))
  report.main([])
  text = (tmp_path / 'RESULTS.md').read_text()
  # mean ± sample std over the three seeds, and the step-time ratio to static4 (0.22 / 0.2).
  # The 'before' column: the shared-data-order run of the same arm, and how far the mean moved.
  assert '| `static4` | static 4 | 10.20 ± 0.20 | 10.00 ± 0.00 (+0.20) | 3 |' in text
  assert '| `gnmr4_8` | GNMR 4/8 | 8.10 ± 0.10 | not run | 3 | 3.50 | 0.10 | 1.10 | 0 |' in text
  assert '4-bit: **reproduced**' in text and '+25.9% vs bf16' in text
  assert 'closing +100% of the static-to-bf16 gap' in text
  assert 'paired per-seed difference GNMR - static -2.10 ± 0.26' in text
  assert 'Not run yet. Run: `python experiments/scenario2_blockwise.py --scale cpu`' in text
  assert 'Not run yet. Run: `python experiments/scenario1_saved_activation.py --scale gpu`' in text
  assert (tmp_path / 'figures' / 'scenario1_cpu_loss.png').stat().st_size > 1000
  assert (tmp_path / 'figures' / 'scenario1_cpu_heatmap.png').stat().st_size > 1000


def test_seeds_of_an_experiment_arm_see_different_batches_and_one_seed_the_same(data_dirs):
  """The experiments prepare the corpus once and pass it to every run: each run's batches must
  still follow its own config.data.seed (they all followed seed 0 before issue 18)."""
  from experiments import selection  # pylint: disable=g-import-not-at-top
  from gnmr_jax import train_loop  # pylint: disable=g-import-not-at-top
  from gnmr_jax.data import make_data  # pylint: disable=g-import-not-at-top

  def config_of(arm, seed):
    config = selection.arm_config('tensor4', arm, seed, steps=2)
    config.data.data_dir, config.data.sdist_path = data_dirs
    return config

  shared = make_data(config_of('norm', 0).data)

  def first_batch(arm, seed, data=shared):
    run = train_loop.build(config_of(arm, seed), data=data, devices=jax.devices()[:1])
    return next(run.data.train_iterator())['inputs']

  seed0, seed0_other_arm, seed1 = first_batch('norm', 0), first_batch('static_low', 0), \
      first_batch('norm', 1)
  np.testing.assert_array_equal(seed0, seed0_other_arm)
  assert np.mean(seed0 != seed1) > 0.5
  # The same batches as data built for that seed alone.
  np.testing.assert_array_equal(seed1, first_batch('norm', 1, make_data(config_of('norm', 1).data)))
  # A scenario arm (experiments/common.arm_config) likewise.
  base = scenario1.base('cpu', 2)
  base.data.data_dir, base.data.sdist_path = data_dirs
  arm = scenario1.ARMS[0]
  batches = [next(train_loop.build(common.arm_config(base, arm, s), data=shared,
                                   devices=jax.devices()[:1]).data.train_iterator())['inputs']
             for s in (0, 1)]
  np.testing.assert_array_equal(batches[0], seed0)
  np.testing.assert_array_equal(batches[1], seed1)
  # Any other field that shapes the batches must agree: a clear error, never silent reuse.
  longer = config_of('norm', 0)
  longer.data.seq_len = 32
  with pytest.raises(ValueError, match=r"data.seq_len: the prebuilt data has 64, the run has 32"):
    train_loop.build(longer, data=shared, devices=jax.devices()[:1])


def test_selection_report_noise_floor_before_column_and_paired_refresh_lines():
  from experiments import selection_report as sr  # pylint: disable=g-import-not-at-top
  runs = lambda *losses, **extra: [dict(seed=i, eval_loss=l, recovered_unit_steps_pct=12.8,
                                        **extra) for i, l in enumerate(losses)]
  arms = {'static_low': runs(2.30, 2.20), 'static_rec': runs(2.10, 2.10),
          'norm': runs(2.20, 2.15), 'norm_perturb': runs(2.22, 2.15),
          'gaprec_every50_from0': runs(2.18, 2.12,
                                       mask_changes={'measurements': 3, 'changes': 0})}
  floor = sr.noise_floor(arms)
  # |2.22 - 2.20| = 0.02 nats, a tenth of seed 0's static gap (0.20); seed 1 moved by nothing.
  assert [sd for sd, _, _ in floor['norm']] == [0, 1]
  np.testing.assert_allclose([d for _, d, _ in floor['norm']], [0.02, 0.0], atol=1e-12)
  np.testing.assert_allclose([sh for _, _, sh in floor['norm']], [0.1, 0.0], atol=1e-12)
  table, worst = sr.noise_floor_table(floor, 1e-7)
  assert abs(worst - 0.1) < 1e-12 and '| 0.10 |' in table
  # Closed: seed 0 (2.30 - 2.20) / 0.20 = 0.5, seed 1 (2.20 - 2.15) / 0.10 = 0.5; before: 0.25.
  old = {'static_low': runs(2.30, 2.20), 'static_rec': runs(2.10, 2.10), 'norm': runs(2.25, 2.175)}
  text = sr.e2e_table(arms, old)
  assert 'closed 0.25 (+0.25)' in text and 'norm_perturb' not in text
  # Pooled: mean(2.30 - 2.20, 2.20 - 2.15) / mean(0.20, 0.10) = 0.075 / 0.15 = 0.5; before 0.25.
  assert abs(sr.pooled_closed(arms, 'norm') - 0.5) < 1e-12 and 'pooled 0.25 (+0.25)' in text
  lines = sr.comparisons(arms)
  assert "minus norm level (priority 'norm'): -0.0250 ± 0.0050 (n=2" in lines
  assert 'changed 0/2, 0/2 times' in lines


def test_selection_report_noise_goal_needs_the_paired_seeds_to_agree_not_only_the_floor():
  from experiments import selection_report as sr  # pylint: disable=g-import-not-at-top
  runs = lambda *losses: [dict(seed=i, eval_loss=l, recovered_unit_steps_pct=12.8)
                          for i, l in enumerate(losses)]
  base = {'static_low': runs(2.30, 2.30, 2.30), 'static_rec': runs(2.10, 2.10, 2.10),
          'norm': runs(2.20, 2.20, 2.20), 'norm_perturb': runs(2.21, 2.20, 2.20)}
  verdict = lambda noise, floor: sr.goals_noise(
      dict(base, noise=runs(*noise), noise_perturb=runs(*floor)), 'noise').splitlines()[1]
  # +0.04 on every seed (diffs 0.039, 0.040, 0.041: SE 0.00058, 69 SE) inside a 0.05 floor: a
  # result, not chaos.
  assert verdict((2.239, 2.240, 2.241), (2.289, 2.24, 2.241)).startswith('- NOT met')
  # +0.01 +- 0.01 (diffs 0.0, 0.0, 0.03: 1 SE) inside the 0.05 floor: chaos, met.
  assert verdict((2.20, 2.20, 2.23), (2.25, 2.20, 2.23)).startswith('- met')
  # The same spread outside its floor (0.001 and 'norm''s 0.01): NOT met.
  assert verdict((2.20, 2.20, 2.23), (2.201, 2.20, 2.23)).startswith('- NOT met')
  # Lower than 'norm' on average: met whatever the floor.
  assert verdict((2.19, 2.19, 2.20), (2.19, 2.19, 2.20)).startswith('- met')


def test_noise_fraction_report_goal_where_nothing_hurts():
  from experiments import noise_fraction as nf  # pylint: disable=g-import-not-at-top
  runs = lambda losses, pct=0.0: {i: dict(seed=i, eval_loss=l, recovered_unit_steps_pct=pct)
                                  for i, l in enumerate(losses)}
  low = (2.10, 2.12, 2.14)  # seed SD 0.02
  goal = nf._nothing_hurts_lines  # pylint: disable=protected-access
  met, spends = goal({'static_low': runs(low), 'alarm': runs((2.11, 2.11, 2.15), 0.5),
                      'noise': runs((2.10, 2.12, 2.14), 1.5)})
  drifts, = goal({'static_low': runs(low), 'alarm': runs((2.13, 2.15, 2.17), 0.5)})
  # alarm - static_low: diffs +0.01, -0.01, +0.01: mean +0.0033 <= 0.02 at 0.5%.
  assert met.startswith('- goal (issue 23, where nothing hurts): MET by \'alarm\'') \
      and '+0.0033' in met and 'seed SD of static_low 0.0200' in met
  assert spends.startswith('- goal (issue 23, where nothing hurts): NOT met by \'noise\'') \
      and '<= 1% of unit-steps: no' in spends
  # +0.03 on every seed: more than the seed SD.
  assert 'NOT met' in drifts and 'within the seed SD of static_low: no' in drifts


def test_noise_fraction_report_gives_shares_of_a_resolved_static_gap_only():
  from experiments import noise_fraction as nf  # pylint: disable=g-import-not-at-top
  runs = lambda losses, pct=0.0: {i: dict(seed=i, eval_loss=l, recovered_unit_steps_pct=pct)
                                  for i, l in enumerate(losses)}
  closed = nf._closed_lines  # pylint: disable=protected-access
  # Gap +0.10, +0.10, +0.13 (0.11 +- 0.01: 11 SE): shares given; the arm closes
  # (0.03 + 0.05 + 0.07) / (0.10 + 0.10 + 0.13) = 0.4545.
  resolved = {'static_low': runs((2.30, 2.20, 2.33)), 'static_rec': runs((2.20, 2.10, 2.20)),
              'norm': runs((2.27, 2.15, 2.26), 12.5)}
  assert closed(resolved) == [
      '- norm: closes 0.45 of the static gap (pooled over 3 seeds) at 12.50% of unit-steps']
  # Gap +0.02, -0.02, +0.03: 0.01 +- 0.015, under 2 SE: no shares.
  noise = dict(resolved, static_rec=runs((2.28, 2.22, 2.30)))
  lines = closed(noise)
  assert len(lines) == 1 and lines[0].startswith('- shares of the static gap not given')


def test_noise_fraction_same_budget_baselines_run_the_named_controller_at_norms_budget():
  # Issue 23's list of arms at equal budget: the paper's rule at its thresholds, random and the
  # measured gap, each at the regime's cap and 'norm''s lock, and a config train.py accepts.
  from experiments import noise_fraction as nf  # pylint: disable=g-import-not-at-top
  from gnmr_jax.config import validate_config  # pylint: disable=g-import-not-at-top
  norm = nf.arm_config('wsd8long', 'norm', seed=3)
  for arm, every in (('gnmr', 0), ('random', 0), ('gap', 50)):
    config = nf.arm_config('wsd8long', arm, seed=3)
    validate_config(config)
    assert config.gnmr.priority == arm and config.diagnostics.recovery_gap_every == every
    for field in ('max_o', 't_lock', 'alpha', 'beta', 'warmup'):
      assert config.gnmr[field] == norm.gnmr[field], (arm, field)
    assert config.train.seed == config.data.seed == 3 and config.train.steps == 1600
  assert nf.arm_config('wsd8long', 'gap', 0).diagnostics.recovery_gap_pass == 'recovery'


def test_noise_fraction_gpu_regime_is_wsd8_at_the_60m_size_and_smoke_runs_elsewhere(tmp_path):
  # Issue 23 item 5 (scripts/gpu_noise_fraction.sh): the wsd8 arms at 25M parameters besides the
  # embeddings, every arm a config train.py accepts; the late switch at the last eighth; --smoke
  # (the CPU dry run) shrinks the same arm and never writes beside the committed results.
  from experiments import noise_fraction as nf  # pylint: disable=g-import-not-at-top
  from gnmr_jax.config import validate_config  # pylint: disable=g-import-not-at-top
  for arm in ('static_low', 'static_rec', 'late_switch', 'late_switch_fwd', 'last_blocks',
              'noise', 'norm'):
    config, wsd8 = nf.arm_config('wsd8gpu', arm, seed=0), nf.arm_config('wsd8', arm, seed=0)
    validate_config(config)
    m = config.model
    assert (m.d_model, m.num_layers, m.ffn_dim) == (512, 8, 1376), arm
    assert 8 * (4 * m.d_model ** 2 + 3 * m.d_model * m.ffn_dim) == 25_296_896  # q k v o, mlp
    assert (config.data.seq_len, config.data.batch_size, config.train.steps) == (256, 64, 1000)
    # The arm itself is wsd8's: precision, controller (but the switch step), schedule shape.
    assert config.precision.to_dict() == wsd8.precision.to_dict(), arm
    mine, theirs = config.gnmr.to_dict(), wsd8.gnmr.to_dict()
    mine.pop('switch_step'), theirs.pop('switch_step')
    assert mine == theirs, arm
    assert (config.optimizer.schedule, config.optimizer.decay_fraction) == ('wsd', 0.2)
    assert config.diagnostics.to_dict() == wsd8.diagnostics.to_dict(), arm
  assert nf.arm_config('wsd8gpu', 'late_switch', 0).gnmr.switch_step == 1000 - 125 + 1
  assert nf.arm_config('wsd8gpu', 'static_low', 0).precision.low_cost_path == 'nvfp4'
  try:
    nf.SMOKE['on'] = True
    small = nf.arm_config('wsd8gpu', 'late_switch', seed=0)
  finally:
    nf.SMOKE['on'] = False
  validate_config(small)
  assert small.model.d_model == 64 and small.train.steps == 16 and small.gnmr.switch_step == 15
  with pytest.raises(SystemExit, match='--smoke writes no results'):
    nf.main(['--smoke', '--regimes', 'wsd8gpu', '--runs', str(tmp_path)])
  with pytest.raises(SystemExit, match='--smoke writes no results'):  # inside the committed dir
    nf.main(['--smoke', '--regimes', 'wsd8gpu', '--runs', str(tmp_path),
             '--results', os.path.join(nf.COMMITTED_RESULTS, 'elsewhere')])
  # A dry run's JSON copied among the results is refused by every reader (the report).
  smoke_json = tmp_path / 'wsd8gpu' / 'noise' / 'seed0.json'
  smoke_json.parent.mkdir(parents=True)
  smoke_json.write_text(json.dumps({'seed': 0, 'eval_loss': 3.5, 'smoke': True}))
  results = nf.RESULTS
  try:
    nf.RESULTS = str(tmp_path)
    with pytest.raises(SystemExit, match='is a --smoke dry run'):
      nf.load('wsd8gpu')
  finally:
    nf.RESULTS = results


def _write_rows(path, rows):
  with open(path, 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)


def test_delayed_regime_counts_saturation_events_and_their_coverage(tmp_path):
  from experiments import delayed_regime  # pylint: disable=g-import-not-at-top
  from gnmr_jax import metrics_log  # pylint: disable=g-import-not-at-top
  # 3 units, steps 1..5. Unit 0 saturates at steps 3-4 (one event of 2 steps; the mask has it
  # at step 4: covered at t+1); unit 1 at step 2 (1 step; masked at step 4: covered by t+2
  # only; its norm ratio passes the paper's alpha 2 there, not the alarm's 4); unit 2 at step 5
  # (nothing after it: uncovered).
  sat = {3: [0], 4: [0], 2: [1], 5: [2]}
  masked = {4: [0, 1]}
  rows = []
  for step in range(1, 6):
    saturation = [2.0 if u in [k for t, us in sat.items() if t == step for k in us] else 0.5
                  for u in range(3)]
    rows.append({'step': step, 'mask': [int(u in masked.get(step, [])) for u in range(3)],
                 'saturation': saturation, 'gnmr': [3.0 if (step, u) == (2, 1) else 1.0
                                                    for u in range(3)],
                 'delta_gnmr': [1.0, 1.0, 1.0]})
  _write_rows(os.path.join(tmp_path, metrics_log.UNITS_FILE), rows)
  stats = delayed_regime.event_stats(str(tmp_path))
  assert stats == {'unit_steps': 15, 'saturated_unit_steps': 4, 'events': 3, 'events_2plus': 1,
                   'units_with_events': 3, 'events_after_step_50': 0, 'covered_1': 1,
                   'covered_2': 2, 'covered_2plus_at_next': 1, 'norm_alarm_paper': 1,
                   'norm_alarm_default': 0, 'recovered_unit_steps': 2,
                   'events_2plus_after_warmup': 1, 'covered_2plus_after_warmup': 1,
                   'most_units_recovered_in_a_step': 2}
  # After a warmup of 3 steps the 2-step event (from step 3) is not counted.
  late = delayed_regime.event_stats(str(tmp_path), warmup=3)
  assert (late['events_2plus_after_warmup'], late['covered_2plus_after_warmup']) == (0, 0)


def test_delayed_regime_answer_compares_runtime_arms_with_the_best_static_arm_paired(
    tmp_path, monkeypatch):
  from experiments import delayed_regime  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(delayed_regime, 'RESULTS', str(tmp_path))
  losses = {'delayed': [2.00, 2.10, 2.05], 'hindsight': [1.99, 2.09, 2.04],
            'saturation': [1.97, 2.06, 2.02], 'alarm': [1.995, 2.095, 2.035]}
  for arm, values in losses.items():
    for seed, loss in enumerate(values):
      row = {'seed': seed, 'eval_loss': loss}
      if arm in ('saturation', 'hindsight'):  # what each mask spent, 3 seeds of 1000 unit-steps
        row.update(unit_steps=1000, recovered_unit_steps=40 if arm == 'hindsight' else 10 + seed,
                   most_units_recovered_in_a_step=4 if arm == 'hindsight' else 3 + seed)
      if arm == 'saturation':  # 2 events of >= 2 steps a seed, the mask at the 2nd of one
        row.update(events_2plus=2, covered_2plus_at_next=1)
      if arm == 'delayed':
        row.update(events=10, events_2plus=1, unit_steps=1000, norm_alarm_paper=2,
                   norm_alarm_default=1)
      os.makedirs(tmp_path / 'h16' / arm, exist_ok=True)
      common.write_json(str(tmp_path / 'h16' / arm / f'seed{seed}.json'), row)
  lines = delayed_regime.answer('h16')
  assert lines[0] == ("h16: best static arm at the budget: 'hindsight' (lowest mean final loss "
                      "over the 3 seeds [0, 1, 2] of ['hindsight', 'delayed']).")
  # saturation - hindsight: -0.02, -0.03, -0.02 -> mean -0.0233, SE 0.0033: beats it
  assert lines[2] == ("- 'saturation' minus 'hindsight': -0.0233 +- 0.0033 nats (n=3): beats it "
                      "by more than 2 SE; recovers 1.10% of unit-steps, at most 5 units in a step "
                      "('hindsight': recovers 4.00% of unit-steps, at most 4 units in a step); its "
                      "mask reached 3 of the 6 events of >= 2 steps at their 2nd step.")
  # alarm - hindsight: +0.005, +0.005, -0.005 -> mean +0.0017, SE 0.0033: no difference
  assert "'alarm' minus 'hindsight': +0.0017 +- 0.0033 nats (n=3): does not differ" in lines[1]
  assert '30 saturation events, 10.0 per 1000 unit-steps; 90.0% of them last one step' in lines[3]
  assert delayed_regime.answer('h1') == ['h1: not enough runs for an answer yet.']
  # One seed of an arm: no standard error to judge by.
  common.write_json(str(tmp_path / 'h16' / 'paper' / 'seed0.json'), {'seed': 0, 'eval_loss': 1.9})
  one = "- 'paper' minus 'hindsight': -0.0900 +- nan nats (n=1): 1 seed(s): too few to judge yet."
  assert one in delayed_regime.answer('h16')


def test_delayed_regime_arms_validate_and_run_what_they_name(monkeypatch):
  from experiments import delayed_regime  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(delayed_regime, 'hindsight_units', lambda regime: r'^layers/mlp/down')
  for regime, length in delayed_regime.REGIMES.items():
    for arm in delayed_regime.ARMS:
      config = delayed_regime.arm_config(regime, arm, seed=3)
      gnmr_jax.config.validate_config(config, 1)
      assert config.train.seed == config.data.seed == 3
      low = config.precision
      assert (low.low_cost_path, low.scaling) == (('bf16', 'row') if arm == 'bf16' else
                                                  ('fp8', arm) if arm in ('row', 'tensor') else
                                                  ('fp8', 'delayed')), arm
      if low.scaling == 'delayed':
        assert low.amax_history_length == length
      assert (low.mode == 'gnmr') == (arm in delayed_regime.ROUTED + ('hindsight', 'last_blocks'))
  assert delayed_regime.arm_config('h16', 'saturation', 0).gnmr.priority == 'saturation'
  # every saturated unit (56 = 7 projections x 8 layers) for the one step after, from step 1
  everything = delayed_regime.arm_config('h16', 'saturation_all', 0).gnmr
  assert (everything.priority, everything.t_lock, everything.max_o, everything.warmup) == (
      'saturation', 0, 56, 0)


def test_delayed_regime_gpu_regime_is_h16_at_the_60m_size_and_smoke_stays_apart(tmp_path,
                                                                               monkeypatch):
  # scripts/gpu_delayed_regime.sh: the h16 arms at the 60m size, 1000 steps; --smoke (the CPU
  # dry run) shrinks them and never writes beside the committed results; a dry run's JSON among
  # the results is refused by the report.
  from experiments import delayed_regime as dr  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(dr, 'hindsight_units', lambda regime: r'^layers/mlp/down/kernel\[[0-3]\]$')
  for arm in dr.ARMS:
    config, cpu = dr.arm_config('h16gpu', arm, seed=0), dr.arm_config('h16', arm, seed=0)
    gnmr_jax.config.validate_config(config, 1)
    assert (config.model.d_model, config.model.num_layers) == (512, 8), arm
    assert (config.data.seq_len, config.data.batch_size, config.train.steps) == (256, 64, 1000)
    assert config.precision.to_dict() == cpu.precision.to_dict(), arm
    assert config.gnmr.to_dict() == cpu.gnmr.to_dict(), arm
  monkeypatch.setitem(dr.SMOKE, 'on', True)
  small = dr.arm_config('h16gpu', 'saturation', seed=0)
  monkeypatch.setitem(dr.SMOKE, 'on', False)
  gnmr_jax.config.validate_config(small, 1)
  assert small.model.d_model == 64 and small.train.steps == 16
  with pytest.raises(SystemExit, match='--smoke writes no results'):
    dr.main(['--smoke', '--regimes', 'h16gpu', '--runs', str(tmp_path)])
  smoke_json = tmp_path / 'h16gpu' / 'delayed' / 'seed0.json'
  smoke_json.parent.mkdir(parents=True)
  smoke_json.write_text(json.dumps({'seed': 0, 'eval_loss': 3.5, 'smoke': True}))
  monkeypatch.setattr(dr, 'RESULTS', str(tmp_path))
  with pytest.raises(SystemExit, match='is a --smoke dry run'):
    dr.load('h16gpu')


def test_delayed_regime_row_census_agrees_with_the_logged_saturation(tmp_path, monkeypatch,
                                                                     data_dirs):
  # The census recomputes each row's saturation from the histories of the 'delayed' arm's steps;
  # the train loop logged each unit's largest: on the same config, init and data order, a
  # unit-step saturated in some row iff the logged value is over 1.
  from experiments import delayed_regime as dr  # pylint: disable=g-import-not-at-top
  from gnmr_jax import train_loop  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(dr, 'RESULTS', str(tmp_path / 'results'))
  monkeypatch.setitem(dr.SMOKE, 'on', True)
  make = dr.arm_config

  def arm_config(regime, arm, seed):
    config = make(regime, arm, seed)
    config.data.data_dir, config.data.sdist_path = data_dirs
    config.precision.amax_history_length = 1  # events within the smoke run's 16 steps
    return config

  monkeypatch.setattr(dr, 'arm_config', arm_config)
  census = dr.row_census('h16', 0)
  workdir = str(tmp_path / 'run')
  train_loop.train_and_evaluate(arm_config('h16', 'delayed', 0), workdir,
                                devices=jax.devices()[:1])
  logged = np.array([r['saturation'] for r in dr.metrics_rows(workdir)])
  assert census['steps'] == 16 and census['unit_steps'] == logged.size
  assert census['any_row_saturated_unit_steps'] == int((logged > 1).sum()) > 0
  rows = census['rows']
  assert sum(rows[r]['saturated_unit_steps'] for r in dr.ROWS) >= int((logged > 1).sum())
  assert dr.row_census('h16', 0) == census  # read back, not recomputed
