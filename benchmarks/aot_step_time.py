"""Step time on paper: the roofline model (gnmr_jax.aot.step_time) calibrated on the H200 anchors.

  .venv-aot/bin/python benchmarks/aot_step_time.py --part calibration   # anchors' programs
  .venv-aot/bin/python benchmarks/aot_step_time.py --part projections   # llama configs
  .venv-aot/bin/python benchmarks/aot_step_time.py --part quantization  # scaling recipes
  .venv-aot/bin/python benchmarks/aot_step_time.py --no_compile         # tables from the JSONs

Calibration compiles the programs timed on the lent H200 (benchmarks/anchor_programs.py, from
../shared/reference/probes/) deviceless for the 'h200' target, prices them and compares with
the measured milliseconds and ratios. Projections compile configs/llama.py's sizes for each
target, path and mode (the train step). Each cell writes benchmarks/results/step_time/<cell>.json
holding the program's kernel summary (step_time.summarize), not its HLO; a cell whose JSON
exists is read, not compiled (a matrix longer than a session resumes; --redo recompiles). Every
figure below is read from those JSONs and priced here: nothing is typed by hand.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
RESULTS = os.path.join(ROOT, 'benchmarks', 'results', 'step_time')
GOAL = 0.15  # the issue's bound on the anchors' ratio errors

import aot_compiled  # pylint: disable=g-import-not-at-top,wrong-import-position
from gnmr_jax.aot import device_specs  # pylint: disable=g-import-not-at-top,wrong-import-position
from gnmr_jax.aot import step_time  # pylint: disable=g-import-not-at-top,wrong-import-position
from gnmr_jax.model import UNITS_PER_LAYER  # pylint: disable=g-import-not-at-top,wrong-import-position

# The anchors' ratios: (label, numerator program, denominator program), time / time.
RATIOS = (
    ('bf16 / fp8 static (fp8 speed-up)', 'stack_bf16_static', 'stack_fp8_static'),
    ('bf16 / int8 static (int8 speed-up)', 'stack_bf16_static', 'stack_int8_static'),
    ('fp8 routed unrolled / static (D / A)', 'stack_fp8_cond_unrolled', 'stack_fp8_static'),
    ('fp8 routed cond per matmul in scan / static (B / A)', 'stack_fp8_cond_scan',
     'stack_fp8_static'),
    ('fp8 routed cond per layer in scan / static (E / A)', 'stack_fp8_cond_layer_scan',
     'stack_fp8_static'),
    ('int8 routed cond per matmul in scan / static', 'stack_int8_cond_scan', 'stack_int8_static'),
)
GOAL_RATIOS = RATIOS[:3]  # the goal: fp8/bf16, int8/bf16, unrolled routed/static
# routed-in-scan programs that fit the per-conditional cost: (routed, static)
COND_FIT = (('stack_fp8_cond_scan', 'stack_fp8_static'),
            ('stack_fp8_cond_layer_scan', 'stack_fp8_static'),
            ('stack_int8_cond_scan', 'stack_int8_static'))

CONFIGS = ('llama:60m', 'llama:350m', 'llama:1b', 'llama:7b')
GPU_PATHS = (('bf16', 'static'), ('int8', 'static'), ('int8', 'gnmr'), ('fp8', 'static'),
             ('fp8', 'gnmr'), ('nvfp4', 'static'), ('mxfp8', 'static'))
TPU_PATHS = (('bf16', 'static'), ('int8', 'static'), ('int8', 'gnmr'))


def projection_cells() -> list:
  """The projection matrix in the order it is compiled (most wanted first)."""
  cells = []
  for config in CONFIGS:
    for target in ('h200', 'h100', 'b200', 'v6e-1', 'v5p-8'):
      paths = GPU_PATHS if target[0] in 'hb' else TPU_PATHS
      if target == 'v6e-1' and config in ('llama:350m', 'llama:1b'):
        # 256 sequences do not fit a v6e's 32 GiB at these sizes (XLA refuses): 32 do
        cells += [aot_compiled.cell(target, config, path, mode, 32) for path, mode in paths]
      for path, mode in paths:
        if target == 'b200' and path in ('nvfp4', 'mxfp8'):
          # 'auto' is native on a B200: compile both implementations, named
          cells += [aot_compiled.cell(target, config, path, mode, microscaling_impl=impl)
                    for impl in ('emulated', 'native')]
        else:
          cells.append(aot_compiled.cell(target, config, path, mode))
      if target == 'h200':
        # the static step with its layers unrolled, as the routed step's are on a GPU
        # (precision.routed_scan_unroll=-1): what the scan costs, apart from the precision
        cells += [aot_compiled.cell(target, config, path, 'static', scan_layers=False)
                  for path in ('bf16', 'fp8')]
  size = {c: i for i, c in enumerate(CONFIGS)}
  tier = {'h200': 0, 'h100': 0, 'b200': 0, 'v6e-1': 1, 'v5p-8': 2}
  # 60m-1b on the GPUs, then one TPU, then 7b, then the other TPU
  return sorted(cells, key=lambda c: (c['target'] == 'v5p-8', c['config'] == 'llama:7b',
                                      tier[c['target']]
                                      + 0.5 * ('scan_layers' in c['overrides']),
                                      size[c['config']]))


# Issue 44, the step around the GEMMs: the train step as it is compiled since (attention 'auto':
# cuDNN flash attention on a GPU, splash on a TPU; the fused chunked loss; bf16 GEMM results;
# the static step's layers unrolled on a GPU). Named with attention='auto' so that they
# stand apart from the projection cells compiled before (main b11f6ea), their "before".
FAST = {'attention': 'auto'}
# Sequences of 2048 tokens (LLaMA-2 trains at 4096): per-device batches that fit (--fit_batch).
LONG = {'attention': 'auto', 'seq_len': 2048}


def fast_step_cells() -> list:
  """Issue 44's matrix: the goals' configs first (1b and 7b on the GPUs, 1b on v6e-1), then
  the low-cost paths on the fast step, the small sizes, and 2048-token sequences."""
  cell = aot_compiled.cell
  cells = []
  for target in ('h100', 'h200', 'b200'):
    cells += [cell(target, 'llama:1b', 'bf16', 'static', **FAST),
              cell(target, 'llama:7b', 'bf16', 'static', **FAST)]
  cells += [cell('v6e-1', 'llama:1b', path, 'static', 32, **FAST) for path in ('bf16', 'int8')]
  for target in ('h100', 'h200'):
    cells += [cell(target, config, path, mode, **FAST)
              for config in ('llama:1b', 'llama:7b')
              for path, mode in (('fp8', 'static'), ('int8', 'static'), ('fp8', 'gnmr'))]
  cells += [cell('h100', config, path, 'static', **FAST)
            for config in ('llama:60m', 'llama:350m') for path in ('bf16', 'fp8')]
  cells += [cell('h100', 'llama:1b', 'bf16', 'static', 16, **LONG),
            cell('v6e-8', 'llama:1b', 'bf16', 'static', 4, {'fsdp': -1}, **LONG),
            cell('v5p-8', 'llama:1b', 'bf16', 'static', 4, {'fsdp': -1}, **LONG)]
  return cells


# Issue 45, quantization that pays: the scaling recipes (precision.scaling) on the fast step.
# 'row' is the fast-step cells' recipe (their names carry no scaling); tensor and delayed here.
RECIPE_TARGETS = ('h100', 'h200')


def quantization_cells() -> list:
  """Issue 45's matrix: the goals' configs (1b, 7b on H100 / H200; 1b on v6e-1), each recipe
  static and routed with nothing recovered, then 350m and a B200."""
  cell = aot_compiled.cell
  cells = []
  for target in RECIPE_TARGETS:
    for config in ('llama:1b', 'llama:7b'):
      cells += [cell(target, config, 'fp8', 'static', scaling=scaling, **FAST)
                for scaling in ('tensor', 'delayed')]
      cells += [cell(target, config, 'fp8', 'gnmr', scaling='delayed', **FAST),
                cell(target, config, 'int8', 'static', scaling='tensor', **FAST)]
  cells += [cell('v6e-1', 'llama:1b', 'int8', mode, 32, scaling='tensor', **FAST)
            for mode in ('static', 'gnmr')]
  cells += [cell('v6e-1', 'llama:1b', 'int8', 'gnmr', 32, **FAST)]
  cells += [cell('h100', 'llama:350m', 'fp8', 'static', scaling=scaling, **FAST)
            for scaling in ('tensor', 'delayed')]
  cells += [cell('b200', 'llama:7b', 'fp8', 'static', scaling='delayed', **FAST)]
  return cells


def _gemm_seconds(step: step_time.StepTime) -> float:
  return sum(v for k, v in step.by_category.items() if k.startswith('gemm'))


def quantization_table(recipe_reports, fast_reports) -> list:
  """Issue 45: per (target, config, batch), bf16 and each recipe's step; the quantization's
  cost against what its GEMMs save, two ways."""
  by_key = {}
  for r in list(fast_reports) + list(recipe_reports):
    if not r['kernels']:
      continue
    c = r['cell']
    scaling = c['overrides'].get('scaling', 'row' if c['path'] in ('fp8', 'int8') else '')
    by_key[(r['target'], c['config'], r['batch_size'], c['path'], scaling, c['mode'])] = r
  lines = ['### Scaling recipes (issue 45): model output, the fast step of issue 44', '',
           "Each row prices one compiled train step (device and fitted constants as calibrated "
           "below, unchanged). recipe: precision.scaling ('row': per-row current scales, the "
           "recipe before; 'tensor': one current scale per tensor, each operand quantized once "
           "a step; 'delayed': per tensor from an amax history). \"quant. / saving\": the "
           "model's quantization category (every kernel that writes or reads 8-bit data and is "
           "no GEMM: a cast fused into its producer is priced there whole, producer included) "
           "over the time its GEMMs save against bf16's; \"overhead / saving\": everything but "
           "GEMMs against the bf16 step's same (what quantizing really adds: a fused producer "
           "counts once in each step) over that saving. A scale folded into the cuBLASLt call "
           "is priced with its GEMM. routed: mode gnmr with nothing recovered, over static.", '',
           '| target | config | batch | path | recipe | model ms | vs bf16 | quant. / saving '
           '| overhead / saving | routed ms (vs static) | where the time goes |',
           '|' + '---|' * 11]
  for (target, config, batch, path, scaling, mode), r in sorted(by_key.items()):
    if mode != 'static' or path == 'bf16':
      continue
    base_r = by_key.get((target, config, batch, 'bf16', '', 'static'))
    if base_r is None:
      continue
    spec = device_specs.get_spec(target)
    base = step_time.price(base_r['kernels'], spec)
    step = step_time.price(r['kernels'], spec)
    saving = _gemm_seconds(base) - _gemm_seconds(step)
    overhead = (step.total_s - _gemm_seconds(step)) - (base.total_s - _gemm_seconds(base))
    quant = step.by_category['quantization']
    routed_r = by_key.get((target, config, batch, path, scaling, 'gnmr'))
    routed = '-'
    if routed_r is not None:
      zero = step_time.price(routed_r['kernels'], spec).total_s
      routed = f'{zero * 1e3:.1f} ({step.total_s / zero:.2f}x)'
    share = (lambda v: f'{100 * v / saving:.0f}%') if saving > 0 else (lambda v: '-')
    lines.append(f'| {target} | {config} | {batch} | {path} | {scaling} '
                 f'| {step.total_s * 1e3:.1f} | {base.total_s / step.total_s:.2f}x '
                 f'| {share(quant)} | {share(overhead)} | {routed} | {_shares(step)} |')
  return lines + ['']


def _print_model_header(reports, kind: str) -> None:
  """What the figures are, and the date and versions each set of cells was compiled with."""
  print('# The roofline model (gnmr_jax/aot/step_time.py, device constants and fitted constant '
        'as calibrated in "Step time on paper" below) over deviceless-compiled programs; every '
        'figure is a model output priced from benchmarks/results/step_time/*.json')
  for date, versions in sorted({(r['compiled_on']['date'], ', '.join(
      f'{k} {v}' for k, v in sorted(r['versions'].items()))) for r in reports}):
    print(f'# {kind} cells compiled {date}: {versions}')


def quantization(args) -> None:
  """Issue 45's cells (compiled where missing unless --no_compile), beside the fast step's."""
  recipes, missing = projections(args.redo, not args.no_compile, args.only,
                                 quantization_cells())
  fast, _ = projections(compile_missing=False, cells=fast_step_cells())
  _print_model_header(recipes, 'recipe')
  print()
  print('\n'.join(quantization_table(recipes, fast)))
  if missing:
    print(f'# {len(missing)} recipe cells not compiled yet (--part quantization resumes them): '
          f'{", ".join(missing)}')


def _stamp() -> dict:
  return {'date': str(datetime.date.today()), 'host': platform.node(), 'cpus': os.cpu_count(),
          'machine': platform.machine()}


def _write(path, report):
  with open(path + '.tmp', 'w') as f:
    json.dump(report, f, indent=0, sort_keys=True)
  os.replace(path + '.tmp', path)  # a killed run leaves no half-written cell


def compile_calibration(redo=False) -> None:
  from gnmr_jax.aot import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from gnmr_jax import versions as versions_lib  # pylint: disable=g-import-not-at-top
  from gnmr_jax.aot import inventory  # pylint: disable=g-import-not-at-top
  from gnmr_jax.aot import targets  # pylint: disable=g-import-not-at-top
  compile_lib.prepare_environment()
  import anchor_programs  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  target = targets.get_target('h200')
  mesh = Mesh(compile_lib.topology_devices(target)[:1], ('x',))
  for name, (jitted, args) in anchor_programs.programs(NamedSharding(mesh, PartitionSpec())).items():
    path = os.path.join(RESULTS, f'calibration__{name}.json')
    if os.path.exists(path) and not redo:
      continue
    print(f'compiling {name} ...', file=sys.stderr, flush=True)
    program, _ = compile_lib.compile_step(jitted, args, mesh, target)
    _write(path, {'name': name, 'target': 'h200', 'measured_ms': anchor_programs.MEASURED[name],
                  'kernels': step_time.summarize(inventory.parse(program.hlo_text)),
                  'memory': program.memory, 'compile_s': program.compile_s,
                  'versions': versions_lib.package_versions(versions_lib.COMPILERS),
                  'compiled_on': _stamp()})


def compile_projection(c) -> dict:
  from gnmr_jax.aot import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from gnmr_jax.aot import inventory  # pylint: disable=g-import-not-at-top
  from gnmr_jax.aot import targets  # pylint: disable=g-import-not-at-top
  config = aot_compiled.load_config(c['config'])
  config.precision.mode, config.precision.low_cost_path = c['mode'], c['path']
  target = targets.get_target(c['target'])
  if c['per_device_batch']:
    config.data.batch_size = c['per_device_batch'] * target.num_devices
  for axis, size in c['mesh'].items():
    config.mesh[axis] = size
  for field, value in c['overrides'].items():
    section = next((group for group in (config.model, config.data, config.precision)
                    if field in group), None)
    if section is None:
      raise ValueError(f'config.model / data / precision have no field {field!r} yet')
    section[field] = value
  start = time.perf_counter()
  report = compile_lib.compile_config(config, target, steps=('train',), keep_hlo=True)
  step = report['steps']['train']
  hlo = step.pop('hlo', None)
  out = {key: report[key] for key in ('target', 'platform', 'num_devices', 'batch_size',
                                      'seq_len', 'model', 'versions')}
  out.update(cell=c, fits=step['fits'], memory=step.get('memory'), error=step.get('error'),
             compile_s=step.get('compile_s'), conditionals=step.get('conditionals', 0),
             units=UNITS_PER_LAYER * int(config.model.num_layers), max_o=int(config.gnmr.max_o),
             kernels=step_time.summarize(inventory.parse(hlo)) if hlo else [],
             wall_s=round(time.perf_counter() - start, 1), compiled_on=_stamp())
  return out


def projections(redo=False, compile_missing=True, only='', cells=None) -> tuple[list, list]:
  reports, missing = [], []
  for c in projection_cells() if cells is None else cells:
    name = 'projection__' + aot_compiled.cell_name(c)
    if only and only not in name:
      continue
    path = os.path.join(RESULTS, name + '.json')
    if os.path.exists(path) and not redo:
      with open(path) as f:
        reports.append(json.load(f))
      continue
    if not compile_missing:
      missing.append(name.removeprefix('projection__'))
      continue
    print(f'compiling {name} ...', file=sys.stderr, flush=True)
    try:
      report = compile_projection(c)
    except ValueError as e:  # a field the checkout does not have yet (microscaling_impl)
      print(f'  skipped: {e}', file=sys.stderr, flush=True)
      missing.append(name.removeprefix('projection__') + f' ({e})')
      continue
    _write(path, report)
    reports.append(report)
  return reports, missing


# --- calibration tables ----------------------------------------------------------------------
def _load_calibration() -> dict:
  out = {}
  for fname in sorted(os.listdir(RESULTS)) if os.path.isdir(RESULTS) else []:
    if fname.startswith('calibration__') and fname.endswith('.json'):
      with open(os.path.join(RESULTS, fname)) as f:
        report = json.load(f)
      out[report['name']] = report
  return out


def _cond_executions_in_loops(kernels, recovered=0.0) -> float:
  return sum(k['executions'] * k['count'] for k in kernels
             if k['opcode'] == 'conditional' and k['in_loop'])


def fit_cond_cost(calibration, spec) -> float:
  """Seconds per conditional execution in a loop: the measured routed-minus-static time the
  roofline leaves unexplained, per such execution, averaged over COND_FIT (>= 0)."""
  fits = []
  for routed, static in COND_FIT:
    if routed not in calibration or static not in calibration:
      continue
    measured = (calibration[routed]['measured_ms'] - calibration[static]['measured_ms']) / 1e3
    model = (step_time.price(calibration[routed]['kernels'], spec).total_s
             - step_time.price(calibration[static]['kernels'], spec).total_s)
    executions = _cond_executions_in_loops(calibration[routed]['kernels'])
    if executions:
      fits.append((measured - model) / executions)
  return max(0.0, sum(fits) / len(fits)) if fits else 0.0


def calibrate(calibration) -> dict:
  """Predicted ms (roofline, roofline + fitted cond cost) of every anchor, and ratio errors."""
  import anchor_programs  # pylint: disable=g-import-not-at-top
  spec = device_specs.get_spec('h200')
  cond_s = fit_cond_cost(calibration, spec)
  rows = {}
  for name, report in calibration.items():
    for suffix, recovered in (('', 0.0), ('_mask2', 2 / 16)):  # mask2: 2 of 16 layers recovered
      key = name + suffix
      if key not in anchor_programs.MEASURED:
        continue
      plain = step_time.price(report['kernels'], spec, recovered)
      fitted = step_time.price(report['kernels'], spec, recovered, cond_in_loop_s=cond_s)
      rows[key] = {'measured_ms': anchor_programs.MEASURED[key],
                   'roofline_ms': plain.total_s * 1e3, 'fitted_ms': fitted.total_s * 1e3,
                   'breakdown': plain.by_category}
  ratios = []
  for label, num, den in RATIOS:
    if num in rows and den in rows:
      measured = rows[num]['measured_ms'] / rows[den]['measured_ms']
      ratios.append((label, measured, rows[num]['roofline_ms'] / rows[den]['roofline_ms'],
                     rows[num]['fitted_ms'] / rows[den]['fitted_ms'],
                     (label, num, den) in GOAL_RATIOS))
  goal_errors = [abs(model / measured - 1) for _, measured, model, _, goal in ratios if goal]
  return {'rows': rows, 'ratios': ratios, 'cond_s': cond_s,
          'within_goal': len(goal_errors) == len(GOAL_RATIOS) and max(goal_errors) <= GOAL,
          'ratio_error': {label: model / measured - 1
                          for label, measured, model, _, _ in ratios}}


def _pct(x) -> str:
  return f'{100 * x:+.1f}%'


def calibration_tables(cal) -> list:
  lines = ['### Calibration: the anchors\' programs compiled for an H200, priced, against the '
           'H200 measurements', '',
           f"Fitted constant: conditional execution inside a loop = "
           f"{cal['cond_s'] * 1e6:.1f} us (fitted: the routed-in-scan programs' measured "
           "routed-minus-static time the roofline leaves unexplained, per conditional "
           "execution, mean of fp8 B, fp8 E, int8 B; the projections do not use it). No other "
           "constant is fitted: GEMM rates are the H200's measured raw-GEMM rates, bandwidth "
           "the datasheet's, launch 2 us assumed.", '',
           '| program | measured ms | model ms (error) | model + fitted cond cost ms (error) '
           '| model: where the time goes (ms) |', '|---|---|---|---|---|']
  for name, row in cal['rows'].items():
    parts = ', '.join(f'{k} {v * 1e3:.1f}' for k, v in row['breakdown'].items() if v * 1e3 >= 0.05)
    lines.append(f"| {name} | {row['measured_ms']:.2f} | {row['roofline_ms']:.2f} "
                 f"({_pct(row['roofline_ms'] / row['measured_ms'] - 1)}) "
                 f"| {row['fitted_ms']:.2f} ({_pct(row['fitted_ms'] / row['measured_ms'] - 1)}) "
                 f"| {parts} |")
  lines += ['', '| ratio | measured | model (error) | model + fitted cond cost (error) '
            '| goal (within 15%) |', '|---|---|---|---|---|']
  for label, measured, model, fitted, goal in cal['ratios']:
    lines.append(f'| {label} | {measured:.3f} | {model:.3f} ({_pct(model / measured - 1)}) '
                 f'| {fitted:.3f} ({_pct(fitted / measured - 1)}) '
                 f"| {('yes' if abs(model / measured - 1) <= GOAL else 'NO') if goal else '-'} |")
  verdict = ('within' if cal['within_goal'] else 'NOT within')
  lines += ['', f"The model's ratios on the anchors' goal figures (first three) are {verdict} "
            f"15% of the measured ones"
            + ('.' if cal['within_goal'] else ': the projections below are not predictions.'),
            '']
  return lines


# --- projections -----------------------------------------------------------------------------
def _shares(step: step_time.StepTime) -> str:
  merged = {}
  for name, seconds in step.by_category.items():
    key = 'other' if name in ('launch', 'conditionals') else name
    merged[key] = merged.get(key, 0.0) + seconds
  return ', '.join(f'{k} {100 * v / step.total_s:.0f}%' for k, v in
                   sorted(merged.items(), key=lambda kv: -kv[1]) if v / step.total_s >= 0.01)


def _error_label(cal, path, mode, platform='gpu') -> str:
  if platform == 'tpu':
    return 'no anchor (TPU)'
  errors = cal['ratio_error']
  label = {'fp8': 'bf16 / fp8 static (fp8 speed-up)',
           'int8': 'bf16 / int8 static (int8 speed-up)'}.get(path)
  parts = []
  if path == 'bf16':
    parts.append('bf16 step ' + _pct(cal['rows']['stack_bf16_static']['roofline_ms']
                                     / cal['rows']['stack_bf16_static']['measured_ms'] - 1))
  elif label in errors:
    parts.append('ratio ' + _pct(errors[label]))
  else:
    parts.append('no anchor')
  if mode == 'gnmr':
    parts.append('routed ' + _pct(errors.get('fp8 routed unrolled / static (D / A)', 0.0)))
  return '; '.join(parts)


def _path_label(c) -> str:
  label = c['path']
  if 'microscaling_impl' in c['overrides']:
    label += f" {c['overrides']['microscaling_impl']}"
  if c['overrides'].get('scan_layers') is False:
    label += ' (layers unrolled)'
  return label


def projection_table(reports, cal) -> list:
  prefix = 'model output' if cal['within_goal'] else 'model output, NOT a prediction'
  lines = [f'### Projections ({prefix}): train step of configs/llama.py, per device', '',
           'Each figure is the roofline model\'s price of the compiled train step (no fitted '
           'constant); "calibration error" is the anchors\' error of the figure it rests on '
           '(the bf16 step, the path\'s speed-up over bf16, routed unrolled / static); '
           '"no anchor": NVFP4 / MXFP8 and every TPU rate carry the H200\'s measured GEMM '
           'efficiency, an assumption. Routed "max_o" prices max_o of the units recovered '
           '(every conditional taking the recovery branch max_o / units of the time). batch: '
           'the config\'s batch of 256-token sequences ("on N": over N devices, data '
           'parallel, figures per device); fits: '
           'the compiled step\'s peak memory fits the device (priced either way). On a GPU the '
           'routed step\'s layers are unrolled (precision.routed_scan_unroll=-1) and a static '
           'step\'s are a scan unless marked "layers unrolled": compare those rows for the '
           'precision\'s gain at equal structure.', '',
           '| target | config | batch | path | mode | fits | model ms: static or routed 0 '
           '/ routed max_o | speed-up vs bf16 (model) | where the time goes (model) '
           '| calibration error |', '|' + '---|' * 10]
  bf16 = {}
  for r in reports:
    c = r['cell']
    if c['path'] == 'bf16' and not c['overrides'] and r['kernels']:
      bf16[(r['target'], c['config'])] = step_time.price(
          r['kernels'], device_specs.get_spec(r['target'])).total_s
  for r in reports:
    c = r['cell']
    path = _path_label(c)
    batch = r['batch_size'] if r['num_devices'] == 1 else (
        f"{r['batch_size']} on {r['num_devices']}")
    if not r['kernels']:
      lines.append(f"| {r['target']} | {c['config']} | {batch} | {path} | {c['mode']} "
                   f"| no ({(r['error'] or '')[:50]}) | - | - | - | - |")
      continue
    spec = device_specs.get_spec(r['target'])
    step = step_time.price(r['kernels'], spec)
    times = f'{step.total_s * 1e3:.2f}'
    speed = ''
    base = bf16.get((r['target'], c['config']))
    if c['mode'] == 'gnmr':
      share = min(1.0, r['max_o'] / r['units'])
      full = step_time.price(r['kernels'], spec, share)
      times += f" / {full.total_s * 1e3:.2f} ({r['max_o']} of {r['units']})"
      if base:
        speed = f'{base / step.total_s:.2f}x / {base / full.total_s:.2f}x'
    elif base:
      speed = f'{base / step.total_s:.2f}x'
    lines.append(f"| {r['target']} | {c['config']} | {batch} | {path} | {c['mode']} "
                 f"| {'yes' if r['fits'] else 'no'} | {times} | {speed or '-'} | {_shares(step)} "
                 f"| {_error_label(cal, c['path'], c['mode'], r['platform'])} |")
  return lines


def _gemm_share(step: step_time.StepTime) -> float:
  return sum(v for k, v in step.by_category.items() if k.startswith('gemm')) / step.total_s


def fast_step_table(fast_reports, before_reports) -> list:
  """Issue 44: each fast-step cell beside the projection cell of main b11f6ea it replaces."""
  before = {}
  for r in before_reports:
    c = r['cell']
    if not c['overrides'] and r['kernels']:
      before[(r['target'], c['config'], c['path'], c['mode'], c['per_device_batch'])] = r
  lines = ['### The step around the GEMMs (issue 44): model output, today\'s step beside main '
           'b11f6ea\'s', '',
           'Each row prices the train step compiled as it is built now (attention \'auto\': '
           'cuDNN flash attention on a GPU, Pallas splash on a TPU; the fused chunked loss; bf16 '
           'GEMM results; the static step\'s layers unrolled on a GPU) beside the same cell '
           'compiled at main b11f6ea (XLA attention with '
           'float32 scores, float32 [B, S, V] logits into optax\'s loss, float32 GEMM results, '
           'layers in a scan). Same device constants and no fitted constant; flash-attention '
           'kernels are priced at published efficiencies (device_specs.ATTENTION_EFFICIENCY): '
           'attention has no measured anchor. "gemm" = every GEMM category; "attn + other" = '
           'attention, other, launch, conditionals. temp: XLA\'s temporaries per device.', '',
           '| target | config | batch x seq | path | mode | fits | model ms before -> now '
           '| speed-up | gemm share before -> now | attn + other before -> now '
           '| temp GB before -> now | where the time goes now |', '|' + '---|' * 12]
  for r in fast_reports:
    c = r['cell']
    batch = f"{r['batch_size']} x {r['seq_len']}" + (
        f" on {r['num_devices']}" if r['num_devices'] > 1 else '')
    if not r['kernels']:
      lines.append(f"| {r['target']} | {c['config']} | {batch} | {c['path']} | {c['mode']} "
                   f"| no ({(r['error'] or '')[:50]}) |" + ' - |' * 6)
      continue
    spec = device_specs.get_spec(r['target'])
    now = step_time.price(r['kernels'], spec)
    old = before.get((r['target'], c['config'], c['path'], c['mode'], c['per_device_batch']))
    rest = lambda t: sum(t.by_category[k] for k in ('attention', 'other', 'launch',
                                                    'conditionals')) / t.total_s
    if old:
      was = step_time.price(old['kernels'], spec)
      cols = (f'{was.total_s * 1e3:.1f} -> {now.total_s * 1e3:.1f}',
              f'{was.total_s / now.total_s:.2f}x',
              f'{100 * _gemm_share(was):.0f}% -> {100 * _gemm_share(now):.0f}%',
              f'{100 * rest(was):.0f}% -> {100 * rest(now):.0f}%',
              f"{old['memory']['temp'] / 1e9:.2f} -> {r['memory']['temp'] / 1e9:.2f}")
    else:
      cols = (f'- -> {now.total_s * 1e3:.1f}', '-', f'- -> {100 * _gemm_share(now):.0f}%',
              f'- -> {100 * rest(now):.0f}%', f"- -> {r['memory']['temp'] / 1e9:.2f}")
    lines.append(f"| {r['target']} | {c['config']} | {batch} | {c['path']} | {c['mode']} "
                 f"| {'yes' if r['fits'] else 'no'} | " + ' | '.join(cols)
                 + f' | {_shares(now)} |')
  return lines + ['']


def design_notes(reports) -> list:
  """What the projection says: per (target, config), the low-cost paths' gain and what eats it."""
  by_key = {}
  for r in reports:
    if r['kernels']:
      c = r['cell']
      by_key[(r['target'], c['config'], _path_label(c), c['mode'])] = r
  lines = ['### What the model says about the design (model output, computed from the table)',
           '']
  for (target, config, path, mode), r in by_key.items():
    if (mode != 'static' or path == 'bf16' or 'unrolled' in path
        or (target, config, 'bf16', 'static') not in by_key):
      continue
    spec = device_specs.get_spec(target)
    base = step_time.price(by_key[(target, config, 'bf16', 'static')]['kernels'], spec).total_s
    static = step_time.price(r['kernels'], spec)
    quant = static.by_category['quantization']
    gemm_saved = sum(step_time.price(by_key[(target, config, 'bf16', 'static')]['kernels'],
                                     spec).by_category[k] for k in step_time.CATEGORIES
                     if k.startswith('gemm')) - sum(static.by_category[k] for k in
                                                    step_time.CATEGORIES if k.startswith('gemm'))
    text = (f'- {target} {config} {path}: static {base / static.total_s:.2f}x bf16; GEMMs save '
            f'{gemm_saved * 1e3:.2f} ms, quantization fusions cost {quant * 1e3:.2f} ms '
            f'({100 * quant / gemm_saved:.0f}% of the saving)' if gemm_saved > 1e-3 * base else
            f'- {target} {config} {path}: static {base / static.total_s:.2f}x bf16; its GEMMs '
            f'save nothing over bf16 here')
    routed = by_key.get((target, config, path, 'gnmr'))
    if routed:
      zero = step_time.price(routed['kernels'], spec).total_s
      text += (f'; routed with nothing recovered {base / zero:.2f}x bf16 '
               f'({_pct(zero / static.total_s - 1)} over static)')
    lines.append(text)
  for (target, config, path, mode), r in by_key.items():
    if path != 'bf16 (layers unrolled)':
      continue
    spec = device_specs.get_spec(target)
    base = step_time.price(r['kernels'], spec).total_s
    rolled = by_key.get((target, config, 'bf16', 'static'))
    parts = [f'- {target} {config}, layers unrolled: bf16 static '
             + (f"{step_time.price(rolled['kernels'], spec).total_s / base:.2f}x faster "
                'than with its layers in a scan' if rolled else '')]
    for label, key in (('fp8 static', 'fp8 (layers unrolled)'), ('fp8 routed', 'fp8')):
      other = by_key.get((target, config, key, 'static' if 'static' in label else 'gnmr'))
      if other:
        parts.append(f'{label} {base / step_time.price(other["kernels"], spec).total_s:.2f}x '
                     'the unrolled bf16 step')
    lines.append('; '.join(parts))
  return lines + ['']


def fast_step(args) -> None:
  """Issue 44's cells (compiled where missing unless --no_compile), beside main b11f6ea's."""
  fast, missing = projections(args.redo, not args.no_compile, args.only, fast_step_cells())
  before, _ = projections(compile_missing=False)
  _print_model_header(fast, 'fast-step')
  print('\n### Flash-attention efficiencies (device_specs.ATTENTION_EFFICIENCY: published, no '
        'anchor here)\n')
  print('\n'.join(device_specs.attention_table()))
  print()
  print('\n'.join(fast_step_table(fast, before)))
  if missing:
    print(f'# {len(missing)} fast-step cells not compiled yet (--part fast_step resumes them): '
          f'{", ".join(missing)}')


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--part', choices=('calibration', 'projections', 'both', 'fast_step',
                                         'quantization'), default='both')
  parser.add_argument('--only', default='', help='projection cells whose name contains this')
  parser.add_argument('--redo', action='store_true', help='recompile cells that have a JSON')
  parser.add_argument('--no_compile', action='store_true',
                      help='tables from the JSONs there are; list the cells still to compile')
  args = parser.parse_args()
  os.makedirs(RESULTS, exist_ok=True)
  if args.part == 'fast_step':
    fast_step(args)
    return
  if args.part == 'quantization':
    quantization(args)
    return
  if not args.no_compile and args.part in ('calibration', 'both'):
    compile_calibration(args.redo)
  calibration = _load_calibration()
  if not calibration:
    print('# no calibration cells yet: run with --part calibration')
    return
  cal = calibrate(calibration)
  stamps = sorted({(r['compiled_on']['date'], ', '.join(f'{k} {v}' for k, v in
                                                       sorted(r['versions'].items())))
                   for r in calibration.values()})
  print('# The roofline model (gnmr_jax/aot/step_time.py) over deviceless-compiled programs; '
        'every figure is a model output priced from benchmarks/results/step_time/*.json, '
        'measured figures are the H200 anchors (../shared/reference/gpu-anchors.md, jax 0.11.2; '
        'these programs compiled with the versions below)')
  for date, versions in stamps:
    print(f'# calibration programs compiled {date}: {versions}')
  print('\n### Device constants (gnmr_jax/aot/device_specs.py; model rate = calibrated on the '
        'H200, else datasheet x the H200\'s measured efficiency: per class on a GPU, bf16\'s on '
        'a TPU)\n')
  print('\n'.join(device_specs.table()))
  print(f"\nlaunch: {device_specs.SPECS['h200'].sources['launch_s']}; TPU: "
        f"{device_specs.SPECS['v6e'].sources['launch_s']}. f32: "
        f"{device_specs.SPECS['h200'].sources['f32']}; TPU: {device_specs.SPECS['v6e'].sources['f32']}."
        " fp4 / mxfp8 / fp8 on a chip without them: the bf16 rate.\n")
  print('\n'.join(calibration_tables(cal)))
  reports, missing = projections(args.redo, not args.no_compile and args.part != 'calibration',
                                 args.only)
  if reports:
    for date, versions in sorted({(r['compiled_on']['date'], ', '.join(
        f'{k} {v}' for k, v in sorted(r['versions'].items()))) for r in reports}):
      print(f'# projection cells compiled {date}: {versions}')
    print()
    print('\n'.join(projection_table(reports, cal)))
    print()
    print('\n'.join(design_notes(reports)))
  if missing:
    print(f'# {len(missing)} projection cells not compiled yet (--part projections resumes '
          f'them): {", ".join(missing)}')


if __name__ == '__main__':
  main()
