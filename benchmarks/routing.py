"""Routed vs static precision paths on a scanned MLP stack (fwd + bwd step).

For each low-cost path: the bf16 step, the static low-cost step, and the routed
(mode='gnmr') step with 0, 1 and max_o layers recovered, both with the layers in
a rolled scan (unroll=1) and unrolled the way routed policies ask
(``policy.scan_unroll``). Ratios are measured side by side in one run. The last
line is the worst path's ``routed_empty_over_static`` for the unrolled design.

  python benchmarks/routing.py               # CPU size
  python benchmarks/routing.py --size gpu    # the GPU probe's size (H200)
"""

import argparse
import datetime
import functools
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # repo root

from benchmarks._timing import compile_stats, interleaved_seconds
from gnmr_jax import precision
from gnmr_jax.precision import testing

SIZES = {  # layers, tokens, d_model, d_ff, max_o
    'cpu': (8, 512, 256, 512, 2),
    'gpu': (16, 8192, 2048, 5632, 2),
}


def _policy(mode, low_cost_path, max_o=0):
  config = precision.default_precision_config()
  config.mode, config.low_cost_path = mode, low_cost_path
  if low_cost_path == 'saved_activation':
    config.recovery_path = 'saved_activation'  # 4/8 bits, recovery residuals in the side buffer
  # A recovered layer is two units (both matmuls share its bit).
  return precision.make_policy(config, max_recovered=2 * max_o)


def _step(policy, unroll):
  return jax.jit(jax.value_and_grad(
      lambda p, x, m: testing.stack_loss(policy, p, x, m, unroll=unroll)))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--size', choices=sorted(SIZES), default='cpu')
  parser.add_argument('--paths', default='int8,fp8,saved_activation,blockwise')
  parser.add_argument('--iters', type=int, default=3, help='timed calls per round')
  parser.add_argument('--rounds', type=int, default=5, help='interleaved rounds')
  parser.add_argument('--compile_only', action='store_true',
                      help='build and compile every step, time nothing (GPU size on a CPU)')
  args = parser.parse_args()
  layers, tokens, d_model, d_ff, max_o = SIZES[args.size]
  init = lambda: (testing.init_stack(jax.random.key(0), layers, d_model, d_ff),
                  (jax.random.normal(jax.random.key(1), (tokens, d_model)) * 0.5
                   ).astype(jnp.bfloat16))
  # Shapes only when nothing runs: the GPU size does not fit a CPU's time.
  params, x = jax.eval_shape(init) if args.compile_only else jax.jit(init)()
  masks = {k: jnp.arange(layers) % (layers // max(k, 1)) == 0 if k else
           jnp.zeros((layers,), bool) for k in (0, 1, max_o)}
  masks = {k: m & (jnp.cumsum(m) <= k) for k, m in masks.items()}

  print(f'# {datetime.date.today()} {platform.node()} jax {jax.__version__} '
        f'backend {jax.default_backend()} ({jax.devices()[0].device_kind}); '
        f'size {args.size}: L={layers} T={tokens} D={d_model} F={d_ff} max_o={max_o}')
  bf16_step = _step(_policy('static', 'bf16'), 1)
  _, bf16_compile, bf16_hlo = compile_stats(bf16_step, params, x, masks[0])
  print(f'bf16 static: compile {bf16_compile:.1f} s  hlo {bf16_hlo / 1e3:.0f} kB')
  header = ('path', 'design', 'compile_s', 'hlo_kB', 'ms', 'x_bf16_tok/s',
            'rec0/static_same_unroll', 'rec1/interp', f'rec{max_o}/interp')
  print(' | '.join(header))
  worst_unrolled = float('nan') if args.compile_only else 0.0
  for path in args.paths.split(','):
    routed = _policy('gnmr', path, max_o)
    full = routed.scan_unroll(layers, jax.devices()[0].platform)
    steps = {('bf16', 1): bf16_step}
    for unroll in (1, full):
      steps[('static', unroll)] = _step(_policy('static', path), unroll)
      steps[('routed', unroll)] = _step(routed, unroll)
    compiled = {key: compile_stats(step, params, x, masks[0]) for key, step in steps.items()}
    stats = {key: c[1:] for key, c in compiled.items()}
    # The timed calls reuse the compiled executables (no second compile).
    calls = {(kind, unroll, k): functools.partial(compiled[kind, unroll][0], params, x, masks[k])
             for kind, unroll in steps for k in (masks if kind == 'routed' else (0,))}
    t = ({key: float('nan') for key in calls} if args.compile_only else
         interleaved_seconds(calls, rounds=args.rounds, iters=args.iters))
    t_bf16 = t['bf16', 1, 0]
    for unroll in (1, full):
      t_static = t['static', unroll, 0]
      c, h = stats['static', unroll]
      print(f'{path} | static unroll={unroll} | {c:.1f} | {h / 1e3:.0f} | '
            f'{t_static * 1e3:.2f} | {t_bf16 / t_static:.2f} | - | - | -')
    for unroll in (1, full):
      # Compared with the static step of the same unroll: isolates routing's cost.
      t_static = t['static', unroll, 0]
      c, h = stats['routed', unroll]
      interp = lambda k: t_static + (t_bf16 - t_static) * k / layers
      ratios = [t['routed', unroll, 0] / t_static, t['routed', unroll, 1] / interp(1),
                t['routed', unroll, max_o] / interp(max_o)]
      print(f'{path} | routed unroll={unroll} | {c:.1f} | {h / 1e3:.0f} | '
            f'{t["routed", unroll, 0] * 1e3:.2f} | {t_bf16 / t["routed", unroll, 0]:.2f} | '
            + ' | '.join(f'{r:.3f}' for r in ratios))
      if unroll == full:
        worst_unrolled = max(worst_unrolled, ratios[0])
    print(f'{path} | bf16 static (same run) | - | - | {t_bf16 * 1e3:.2f} | 1.00 | - | - | -')
  print(f'routed_empty_over_static: {worst_unrolled:.3f}')


if __name__ == '__main__':
  main()
