"""Saved-activation bytes per token of a train step, from XLA's memory analysis.

A scanned linear residual stack (h <- h + h W, every saved activation is a
matmul input, so the path's storage is all that is measured) is compiled at T
and 2T tokens; bytes per token are the slopes
(bytes(2T) - bytes(T)) / T of (a) the residuals the forward pass keeps for the
backward pass (output of the compiled ``jax.vjp`` forward) and (b) the temp
memory of the compiled fwd+bwd step. Rows: bf16, static saved activations at 8,
4 and 2 bits, and routed (mode='gnmr') 4-bit/8-bit and 4-bit/bf16 storage. The
last line is the 4-bit residual bytes per token over bf16's.

  python benchmarks/activation_memory.py               # CPU size
  python benchmarks/activation_memory.py --size gpu    # compile-only on a CPU is fine
"""

import argparse
import datetime
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # repo root

from gnmr_jax import precision
from gnmr_jax.precision import testing

SIZES = {'cpu': (8, 1024, 1024), 'gpu': (16, 8192, 2048)}  # layers, tokens, width

VARIANTS = {  # name -> config fields
    'bf16': dict(mode='static', low_cost_path='bf16'),
    'static 8-bit': dict(mode='static', low_cost_path='saved_activation',
                         saved_activation_bits=8),
    'static 4-bit': dict(mode='static', low_cost_path='saved_activation',
                         saved_activation_bits=4),
    'static 2-bit': dict(mode='static', low_cost_path='saved_activation',
                         saved_activation_bits=2),
    'routed 4/8-bit': dict(mode='gnmr', low_cost_path='saved_activation',
                           recovery_path='saved_activation',
                           recovery_saved_activation_bits=8),
    'routed 4-bit/bf16': dict(mode='gnmr', low_cost_path='saved_activation',
                              recovery_path='saved_activation',
                              recovery_saved_activation_bits=16),
    'routed 4-bit/bf16 path': dict(mode='gnmr', low_cost_path='saved_activation',
                                   recovery_path='bf16'),
}


def _bytes(policy, layers, tokens, width):
  params = jax.eval_shape(lambda: testing.init_stack(jax.random.key(0), layers, width, width))
  x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)
  mask = jax.ShapeDtypeStruct((layers,), jnp.bool_)
  # A linear loss head keeps nothing for the backward pass (a squared loss would
  # save the float32 output), so only the stack's saved activations are counted.
  loss = lambda p, x, m: jnp.mean(
      testing.stack_apply(policy, p, x, m, activation=None).astype(jnp.float32))
  forward = jax.jit(lambda p, x, m: jax.vjp(lambda p: loss(p, x, m), p)[1])
  step = jax.jit(jax.value_and_grad(loss))
  residual = forward.lower(params, x, mask).compile().memory_analysis().output_size_in_bytes
  temp = step.lower(params, x, mask).compile().memory_analysis().temp_size_in_bytes
  return residual, temp


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--size', choices=sorted(SIZES), default='cpu')
  args = parser.parse_args()
  layers, tokens, width = SIZES[args.size]
  print(f'# {datetime.date.today()} {platform.node()} jax {jax.__version__} backend '
        f'{jax.default_backend()}; size {args.size}: L={layers} T={tokens} D={width}, '
        f'{2 * layers} matmuls (one routed unit per layer, both matmuls), nothing recovered')
  print('variant | residual B/token | x bf16 | step temp B/token | x bf16 | '
        'step temp MiB at T')
  rows = {}
  for name, fields in VARIANTS.items():
    config = precision.default_precision_config()
    config.update(fields)
    policy = precision.make_policy(config)
    r1, t1 = _bytes(policy, layers, tokens, width)
    r2, t2 = _bytes(policy, layers, 2 * tokens, width)
    rows[name] = ((r2 - r1) / tokens, (t2 - t1) / tokens, t1 / 2**20)
  ref = rows['bf16']
  for name, (res, temp, temp_mib) in rows.items():
    print(f'{name} | {res:.0f} | {res / ref[0]:.3f} | {temp:.0f} | {temp / ref[1]:.3f} | '
          f'{temp_mib:.1f}')
  extra = rows['routed 4/8-bit'][0] - rows['static 4-bit'][0]
  per_unit_8bit = (rows['static 8-bit'][0] - rows['static 4-bit'][0]) / layers
  print(f'routed 4/8-bit extra residual bytes/token over static 4-bit: {extra:.0f} '
        f'= {extra / per_unit_8bit:.2f} units of 4 extra bits (of {layers} units)')
  print(f'routed_4_8_over_static_4bit: {rows["routed 4/8-bit"][0] / rows["static 4-bit"][0]:.3f}')
  print(f'saved_activation_4bit_over_bf16: {rows["static 4-bit"][0] / ref[0]:.3f}')


if __name__ == '__main__':
  main()
