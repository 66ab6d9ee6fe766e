"""Compiled for TPUs and GPUs on this CPU host: one JSON per (target, config, path, mode), tables.

  .venv-aot/bin/python benchmarks/aot_compiled.py --matrix compiled_for   # BENCHMARKS.md table
  .venv-aot/bin/python benchmarks/aot_compiled.py --matrix routed_cost    # routed / static ratios
  .venv-aot/bin/python benchmarks/aot_compiled.py --matrix routed_cost --only h100

Each cell compiles the train step (gnmr_jax.aot.compile_config) and writes
benchmarks/results/aot/<cell>.json; a cell whose JSON exists is read, not compiled again (a
matrix longer than a session resumes), `--redo` recompiles. The table is made from the JSONs
only, with the versions and date each was compiled with. Needs the aot extra (make aot-venv).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, 'benchmarks', 'results', 'aot')
GB = 1e9


def load_config(spec: str):
  """'llama:1b' -> configs/llama.py:get_config('1b')."""
  name, _, arg = spec.partition(':')
  module_spec = importlib.util.spec_from_file_location(
      f'aot_bench_{name}', os.path.join(ROOT, 'configs', f'{name}.py'))
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg or None)


def cell(target, config, path, mode, per_device_batch=None, mesh=None, note='', **overrides):
  """One compile: config spec on target, precision path and mode, optional overrides."""
  return dict(target=target, config=config, path=path, mode=mode,
              per_device_batch=per_device_batch, mesh=mesh or {}, note=note, overrides=overrides)


def _pair(target, config, path, per_device_batch=None, mesh=None, **overrides):
  return [cell(target, config, path, mode, per_device_batch, mesh, **overrides)
          for mode in ('static', 'gnmr')]


FSDP_TENSOR_8 = {'fsdp': -1, 'tensor': 8}
MATRICES = {
    # issue 36: GEMM proofs, every config on a target it is meant for, Colab's runtimes, scale.
    'compiled_for': (
        _pair('h100', 'small', 'bf16')[:1] + _pair('h100', 'small', 'fp8')
        + _pair('h100', 'small', 'int8') + _pair('v5e-4', 'small', 'int8')
        + _pair('v6e-4', 'small', 'int8')
        + [cell(t, 'small', p, 'gnmr', note='Colab') for t, p in
           (('v5e-1', 'int8'), ('v6e-1', 'int8'), ('t4', 'int8'), ('l4', 'fp8'),
            ('a100', 'int8'))]
        + [cell('t4', 'tiny', 'int8', 'gnmr'), cell('l4', 'llama:60m', 'fp8', 'gnmr'),
           cell('a100', 'llama:130m', 'int8', 'gnmr'), cell('h200', 'llama:350m', 'fp8', 'gnmr')]
        + _pair('h100', 'llama:1b', 'fp8', 64) + _pair('v5e-4', 'llama:1b', 'int8', 64)
        + [cell('v5p-64', 'llama:7b', 'int8', 'gnmr', 8),
           cell('h100:2x8', 'llama:7b', 'fp8', 'gnmr', 16, FSDP_TENSOR_8),
           cell('v5p-64', 'llama:13b', 'int8', 'gnmr', 8),
           cell('h100:2x8', 'llama:13b', 'fp8', 'gnmr', 16, FSDP_TENSOR_8)]
        # issue 38: NVFP4 / MXFP8 native on Blackwell ('auto'), emulated on Hopper.
        + _pair('b200', 'small', 'nvfp4') + _pair('b200', 'small', 'mxfp8')
        + [cell('h100', 'small', 'nvfp4', 'static', note='emulated')]
        + _pair('b200', 'llama:1b', 'nvfp4', 64)),
    # issue 37: the routed step against the static one, at the sizes (batch 64 / device).
    'routed_cost': (
        _pair('h100', 'llama:1b', 'fp8', 64) + _pair('v5e-4', 'llama:1b', 'int8', 64)
        + _pair('h100', 'small', 'fp8') + _pair('v5e-4', 'small', 'int8')
        + [cell('h100', 'llama:1b', 'fp8', 'gnmr', 64, routed_scan_unroll=k) for k in (1, 4)]
        + [cell('v5e-4', 'llama:1b', 'int8', 'gnmr', 64, routed_scan_unroll=0)]),
}


def cell_name(c) -> str:
  parts = [c['target'], c['config'].replace(':', '-'), c['path'], c['mode']]
  if c['per_device_batch']:
    parts.append(f"b{c['per_device_batch']}")
  parts += [f'{k}{v}' for k, v in sorted(c['mesh'].items())]
  parts += [f'{k}{v}' for k, v in sorted(c['overrides'].items())]
  return '__'.join(parts).replace('/', '-')


def compile_cell(c) -> dict:
  from gnmr_jax.aot import compile as compile_lib  # pylint: disable=g-import-not-at-top
  from gnmr_jax.aot import targets as targets_lib  # pylint: disable=g-import-not-at-top
  config = load_config(c['config'])
  target = targets_lib.get_target(c['target'])
  config.precision.mode, config.precision.low_cost_path = c['mode'], c['path']
  for axis, size in c['mesh'].items():
    config.mesh[axis] = size
  if c['per_device_batch']:
    config.data.batch_size = c['per_device_batch'] * target.num_devices
  for field, value in c['overrides'].items():
    config.precision[field] = value
  start = time.perf_counter()
  report = compile_lib.compile_config(config, target, steps=('train',))
  report['cell'] = c
  report['wall_s'] = round(time.perf_counter() - start, 1)
  report['compiled_on'] = {'date': str(datetime.date.today()), 'host': platform.node(),
                           'cpus': os.cpu_count(), 'machine': platform.machine()}
  return report


def run(matrix, only='', redo=False, compile_missing=True) -> tuple[list, list]:
  """(reports of the matrix's cells, names of the cells with no JSON that were not compiled)."""
  os.makedirs(RESULTS, exist_ok=True)
  reports, missing = [], []
  for c in MATRICES[matrix]:
    name = cell_name(c)
    if only and only not in name:
      continue
    path = os.path.join(RESULTS, name + '.json')
    if os.path.exists(path) and not redo:
      with open(path) as f:
        reports.append(json.load(f))
      continue
    if not compile_missing:
      missing.append(name)
      continue
    print(f'compiling {name} ...', file=sys.stderr, flush=True)
    report = compile_cell(c)
    with open(path + '.tmp', 'w') as f:
      json.dump(report, f, indent=1, sort_keys=True)
    os.replace(path + '.tmp', path)  # a killed run leaves no half-written cell
    reports.append(report)
  return reports, missing


def _gemms(step) -> str:
  """GEMM FLOPs of the projections (nothing recovered) by operand dtype, as shares."""
  flops = step.get('projection_gemm_flops', {})
  total = sum(flops.values()) or 1
  shares = {}
  for kind, value in flops.items():
    name, operands = kind.split(' ', 1)
    lhs, _, rest = operands.partition(' x ')
    rhs, _, result = rest.partition(' -> ')
    if name == 'cudnn_block_scaled':
      label = 'native ' + ('nvfp4' if lhs.startswith('f4') else 'mxfp8')
    else:
      label = ('fp8' if lhs.startswith('f8') or rhs.startswith('f8') else
               'int8' if lhs == 's8' else lhs)
    shares[label] = shares.get(label, 0) + value
  return ', '.join(f'{k} {100 * v / total:.0f}%' for k, v in sorted(shares.items(),
                                                                     key=lambda kv: -kv[1]))


def _collectives(step) -> str:
  coll = step.get('collectives', {})
  return ', '.join(f"{k} {v['bytes'] / GB:.1f}" for k, v in sorted(coll.items())) or '-'


def compiled_for_table(reports) -> list:
  lines = ['| target | config | path / mode | batch | compile s | args GB | temp GB | program MB '
           '| peak / device GB | fits (margin GB) | projection GEMM FLOPs | GEMMs | conds '
           '| collectives GB/step |', '|' + '---|' * 14]
  for r in reports:
    step = r['steps']['train']
    c = r['cell']
    name = f"{c['config']}" + (f" ({c['note']})" if c['note'] else '')
    if 'error' in step:
      lines.append(f"| {r['target']} | {name} | {c['path']} {c['mode']} | {r['batch_size']} "
                   f"| - | - | - | - | - | no ({step['error'][:60]}) | - | - | - | - |")
      continue
    m = step['memory']
    gemm_count = sum(step['gemms'].values())
    lines.append(
        f"| {r['target']} | {name} | {c['path']} {c['mode']} | {r['batch_size']} "
        f"| {step['compile_s']:.0f} | {m['argument'] / GB:.2f} | {m['temp'] / GB:.2f} "
        f"| {m['generated_code'] / 1e6:.0f} | {m['peak_bytes'] / GB:.2f} "
        f"| {'yes' if step['fits'] else 'NO'} ({step['margin_bytes'] / GB:.1f}) "
        f"| {_gemms(step)} | {gemm_count} | {step['conditionals']} | {_collectives(step)} |")
  return lines


def routed_cost_table(reports) -> list:
  static = {}
  for r in reports:
    c = r['cell']
    if c['mode'] == 'static':
      static[(r['target'], c['config'], c['path'])] = r['steps']['train']
  lines = ['| target | config | path | routed variant | temp GB static / routed (ratio) '
           '| program MB static / routed (ratio) | compile s static / routed (ratio) | conds '
           '| loops |', '|' + '---|' * 9]
  for r in reports:
    c = r['cell']
    base = static.get((r['target'], c['config'], c['path']))
    if c['mode'] == 'static' or base is None:
      continue
    step = r['steps']['train']
    variant = (', '.join(f'{k}={v}' for k, v in c['overrides'].items())
               or 'default (routed_scan_unroll=-1)')

    def ratio(a, b):
      return f'{a:.2f} / {b:.2f} ({b / a:.2f}x)' if a else f'- / {b:.2f}'

    lines.append(
        f"| {r['target']} | {c['config']} | {c['path']} | {variant} "
        f"| {ratio(base['memory']['temp'] / GB, step['memory']['temp'] / GB)} "
        f"| {ratio(base['memory']['generated_code'] / 1e6, step['memory']['generated_code'] / 1e6)} "
        f"| {ratio(base['compile_s'], step['compile_s'])} | {step['conditionals']} "
        f"| {len(step['loops'])} |")
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--matrix', choices=sorted(MATRICES), default='compiled_for')
  parser.add_argument('--only', default='', help='cells whose name contains this text')
  parser.add_argument('--redo', action='store_true', help='recompile cells that have a JSON')
  parser.add_argument('--no_compile', action='store_true',
                      help='tables from the JSONs there are; list the cells still to compile')
  args = parser.parse_args()
  reports, missing = run(args.matrix, args.only, args.redo, not args.no_compile)
  table = (compiled_for_table if args.matrix == 'compiled_for' else routed_cost_table)(reports)
  stamps = sorted({(r['compiled_on']['date'], r['compiled_on']['cpus'],
                    r['compiled_on']['machine'],
                    ', '.join(f'{k} {v}' for k, v in sorted(r['versions'].items())))
                   for r in reports})
  print(f'# deviceless compiles on a CPU host; train step, per device; {len(reports)} cells '
        'from benchmarks/results/aot/*.json. Compile seconds: wall clock on that host, which '
        'other work shared (ratios are leads, not measurements side by side)')
  for date, cpus, machine, versions in stamps:
    print(f'# compiled {date} on {cpus} {machine} cores: {versions}')
  print('\n'.join(table))
  if missing:
    print(f'# {len(missing)} cells not compiled yet (the command without --no_compile resumes '
          f'them): {", ".join(missing)}')


if __name__ == '__main__':
  main()
