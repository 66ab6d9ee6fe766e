"""A compile report (gnmr_jax.aot.compile_config) as text a person reads."""

from __future__ import annotations

GB = 1e9


def gb(n: float) -> str:
  return f'{n / GB:.2f} GB'


def format_step_time(projection: dict) -> list[str]:
  """A train step's projection (step_time.project, under the step's 'step_time') as lines."""
  if 'error' in projection:
    return [f"  step time on paper: not priced ({projection['error']})"]
  shares = ', '.join(f'{name} {100 * share:.0f}%' for name, share in
                     sorted(projection['shares'].items(), key=lambda kv: -kv[1])
                     if share >= 0.005)
  lines = [
      f"  step time on paper ({projection['device']} roofline, per device): "
      f"{projection['step_s'] * 1e3:.2f} ms, {projection['tokens_per_s']:,.0f} tokens/s, MFU "
      f"{100 * projection['mfu']:.1f}% (model FLOPs 6N + causal attention "
      f"{projection['model_flops'] / 1e12:.3g} TFLOP per step, against the datasheet bf16 "
      'rate)',
      f'    where the time goes: {shares}',
      f"    calibration: {projection['calibration']}"
      + ('' if projection['calibration'].startswith('no anchor')
         else ' (H200 anchors, BENCHMARKS.md "Step time on paper")')
      + ('; routed: priced with nothing recovered' if projection.get('mode') == 'gnmr' else '')]
  if projection.get('attention_anchor'):
    lines.append(f"    attention: {projection['attention_kernel_flops'] / 1e12:.3g} TFLOP in "
                 f"flash-attention kernels, anchor {projection['attention_anchor']}")
  return lines


def format_report(report: dict) -> str:
  """Lines: target and config, then per step memory, fit, compile time, GEMMs, collectives,
  and the train step's projection when the report has one (compile_config(step_time=True))."""
  precision = report['precision']
  lines = [
      f"target {report['target']}: {report['description']}; {report['num_devices']} device(s) "
      f"on {report['num_hosts']} host(s), {gb(report['device_memory_bytes'])} each",
      f"model {report['model']}, batch {report['batch_size']} x {report['seq_len']}, mesh "
      + ' x '.join(f'{k}={v}' for k, v in report['mesh'].items())
      + f"; precision {precision['mode']} {precision['low_cost_path']}"
      + (f" / {precision['recovery_path']}" if precision['mode'] == 'gnmr' else '')
      + (f" (microscaling {precision['microscaling_impl']})"
         if precision.get('microscaling_impl', 'auto') != 'auto' else '')
      + (f" (scaling {precision['scaling']})" if precision['low_cost_path'] in ('int8', 'fp8')
         and 'scaling' in precision else '')
      + (f"; attention {report['attention']}" if 'attention' in report else ''),
  ]
  for step, entry in report['steps'].items():
    if 'error' in entry:
      lines.append(f"{step} step: DOES NOT FIT ({entry['error']})")
      continue
    memory = entry['memory']
    verdict = 'fits' if entry['fits'] else 'DOES NOT FIT'
    lines.append(
        f"{step} step: {verdict}: peak {gb(memory['peak_bytes'])} per device (arguments "
        f"{gb(memory['argument'])}, temporaries {gb(memory['temp'])}, outputs "
        f"{gb(memory['output'])} of which {gb(memory['alias'])} donated, program "
        f"{gb(memory['generated_code'])}), margin {gb(entry['margin_bytes'])}; compiled in "
        f"{entry['compile_s']:.1f} s (+{entry['lower_s']:.1f} s tracing)")
    flops = entry['gemm_flops']
    total = sum(flops.values()) or 1
    for name, count in sorted(entry['gemms'].items(), key=lambda kv: -flops.get(kv[0], 0)):
      lines.append(f"  {count:5d} x {name:45s} {100 * flops.get(name, 0) / total:5.1f}% of "
                   'GEMM FLOPs')
    loops = entry['loops']
    lines.append(f"  conditionals {entry['conditionals']}, loops {len(loops)} (trip counts "
                 f"{sorted(set(v for v in loops.values() if v))})")
    for kind, c in sorted(entry['collectives'].items()):
      lines.append(f"  {kind}: {c['count']} in the program, {gb(c['bytes'])} per step")
    if 'step_time' in entry:
      lines += format_step_time(entry['step_time'])
  versions = report['versions']
  lines.append('versions: ' + ', '.join(f'{k} {v}' for k, v in sorted(versions.items())))
  return '\n'.join(lines)
