"""Saved-activation bytes per token of a train step, from XLA's memory analysis.

Two programs, each compiled at T and 2T tokens; bytes per token are the slopes
(bytes(2T) - bytes(T)) / T of (a) the residuals the forward pass keeps for the
backward pass (output of the compiled ``jax.vjp`` forward) and (b) the temp
memory of the compiled fwd+bwd step:

* stack: a scanned linear residual stack (h <- h + h W, every saved activation is
  a matmul input, so the path's storage is all that is measured);
* model: the LLaMA model's train step (``--model``, default the tiny config, in
  ``--dtype`` bfloat16), where attention, norms and the SwiGLU product keep their
  own residuals too; a benchmark-only path whose projections keep nothing gives
  the baseline, so the projections' own bytes are the difference to it.

Rows: bf16, static saved activations at 8, 4 and 2 bits, and routed
(mode='gnmr') 4-bit/8-bit, 4-bit/bf16-stored and 4-bit/bf16-path, each with the
recovery residuals in the side buffer for ``--max_o`` units (the default
storage) and in per-unit slots. Nothing is recovered (the buffer's bytes are
allocated whatever the mask). Last lines: at the model, the routed
side-buffer 4/8-bit residual bytes over static 4-bit minus the side buffer's
bytes (goal <= 1: nothing beyond the max_o-unit buffer), the routed over static
4-bit bytes, the model's whole residual ratio 4-bit/bf16; and the stack's
saved-activation bytes at 4 bits over bf16's (goal <= 0.3).

  python benchmarks/activation_memory.py               # CPU size
  python benchmarks/activation_memory.py --size gpu --model 1b   # compile-only: fine on a CPU
"""

import argparse
import datetime
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # repo root

from benchmarks.model_step import init_params, mask_tree  # noqa: E402
from gnmr_jax import precision  # noqa: E402
from gnmr_jax.model import UNITS_PER_LAYER, Transformer, unit_kernel_shapes  # noqa: E402
from gnmr_jax.model_configs import model_config  # noqa: E402
from gnmr_jax.precision import path as path_lib, quantize, registry, testing  # noqa: E402

SIZES = {'cpu': (8, 1024, 1024), 'gpu': (16, 8192, 2048)}  # stack: layers, tokens, width
MODEL_TOKENS = {'cpu': (4, 256), 'gpu': (8, 1024)}  # model: batch, seq at T

_SA = dict(low_cost_path='saved_activation', saved_activation_bits=4)
VARIANTS = {  # name -> precision config fields
    'bf16': dict(mode='static', low_cost_path='bf16'),
    'static 8-bit': dict(mode='static', low_cost_path='saved_activation',
                         saved_activation_bits=8),
    'static 4-bit': dict(mode='static', **_SA),
    'static 2-bit': dict(mode='static', low_cost_path='saved_activation',
                         saved_activation_bits=2),
}
for _storage in ('side_buffer', 'per_unit'):
  _tag = 'side buffer' if _storage == 'side_buffer' else 'per-unit'
  VARIANTS.update({
      f'routed 4/8-bit, {_tag}': dict(mode='gnmr', recovery_path='saved_activation',
                                      recovery_saved_activation_bits=8,
                                      recovery_storage=_storage, **_SA),
      f'routed 4-bit/bf16, {_tag}': dict(mode='gnmr', recovery_path='saved_activation',
                                         recovery_saved_activation_bits=16,
                                         recovery_storage=_storage, **_SA),
      f'routed 4-bit/bf16 path, {_tag}': dict(mode='gnmr', recovery_path='bf16',
                                              recovery_storage=_storage, **_SA),
  })
SIDE_4_8 = 'routed 4/8-bit, side buffer'

# A benchmark-only path that keeps nothing for the backward pass (its weight
# gradient is zero): the model's bytes minus this baseline's are the bytes the
# projections' saved activations take.
NOTHING = 'benchmark_keeps_nothing'
registry.register_path(NOTHING, registry.fixed_path(path_lib.Path(
    forward=lambda x, kernel: (quantize.bf16_matmul(x, kernel, x.dtype), ()),
    backward=lambda res, x, kernel, g: (quantize.bf16_matmul(g, kernel.T, g.dtype),
                                        jnp.zeros(kernel.shape, kernel.dtype)),
    saves_input=False)))


def _analyse(loss, args):
  """(residual bytes, step temp bytes) of loss(params, *rest) compiled on avals."""
  forward = jax.jit(lambda p, *rest: jax.vjp(lambda p: loss(p, *rest), p)[1])
  step = jax.jit(jax.value_and_grad(loss))
  params_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(args[0]))
  residual = forward.lower(*args).compile().memory_analysis().output_size_in_bytes
  temp = step.lower(*args).compile().memory_analysis().temp_size_in_bytes
  return residual - params_bytes, temp


def stack_bytes(policy, tokens, size):
  layers, _, width = SIZES[size]
  params = jax.eval_shape(lambda: testing.init_stack(jax.random.key(0), layers, width, width))
  x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16)
  mask = jax.ShapeDtypeStruct((layers,), jnp.bool_)
  # A linear loss head keeps nothing for the backward pass (a squared loss would
  # save the float32 output), so only the stack's saved activations are counted.
  loss = lambda p, x, m: jnp.mean(
      testing.stack_apply(policy, p, x, m, activation=None).astype(jnp.float32))
  return _analyse(loss, (params, x, mask))


def model_bytes(policy, batch, seq, model_name, dtype):
  cfg = model_config(model_name)
  cfg.dtype = dtype
  cfg.max_seq_len = max(cfg.max_seq_len, seq)
  cfg.scan_unroll = policy.scan_unroll(cfg.num_layers, jax.devices()[0].platform)
  model = Transformer(cfg, policy)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  params = init_params(model, seq, abstract=True)
  mask = jax.eval_shape(lambda: mask_tree(cfg.num_layers, 0))

  def loss(p, tokens, mask):
    logits = model.apply({'params': p}, tokens, mask)
    # A linear readout, as for the stack: the loss itself keeps nothing.
    return jnp.mean(logits[..., 0])
  return _analyse(loss, (params, tokens, mask))


def _config(fields):
  config = precision.default_precision_config()
  config.update(fields)
  return config


def table(title, measure, tokens, max_o, variants=VARIANTS):
  """Per-variant (residual B/token, temp B/token, temp MiB at T) for measure(policy, T)."""
  rows = {}
  for name, fields in variants.items():
    policy = precision.make_policy(_config(fields), max_recovered=max_o)
    r1, t1 = measure(policy, 1)
    r2, t2 = measure(policy, 2)
    rows[name] = ((r2 - r1) / tokens, (t2 - t1) / tokens, t1 / 2**20)
  ref = rows['bf16']
  print(f'\n## {title}')
  print('variant | residual B/token | x bf16 | step temp B/token | x bf16 | step temp MiB at T')
  for name, (res, temp, temp_mib) in rows.items():
    print(f'{name} | {res:.0f} | {res / ref[0]:.3f} | {temp:.0f} | {temp / ref[1]:.3f} | '
          f'{temp_mib:.1f}')
  return rows


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--size', choices=sorted(SIZES), default='cpu')
  parser.add_argument('--model', default='tiny', help='model config name (gnmr_jax.model_configs)')
  parser.add_argument('--dtype', default='bfloat16', help="the model's activation dtype")
  parser.add_argument('--max_o', type=int, default=2,
                      help='units the side buffer holds (the controller max_o)')
  args = parser.parse_args()
  layers, tokens, width = SIZES[args.size]
  batch, seq = MODEL_TOKENS[args.size]
  cfg = model_config(args.model)
  print(f'# {datetime.date.today()} {platform.node()} jax {jax.__version__} backend '
        f'{jax.default_backend()}; size {args.size}; max_o={args.max_o}; nothing recovered')
  stack = table(f'stack: L={layers} T={tokens} D={width}, {2 * layers} matmuls '
        '(one routed bit per layer, both matmuls)',
        lambda p, k: stack_bytes(p, k * tokens, args.size), tokens, args.max_o)
  variants = {'projections keep nothing': dict(mode='static', low_cost_path=NOTHING),
              **VARIANTS}
  rows = table(f'model {args.model} ({args.dtype}): L={cfg.num_layers} d={cfg.d_model} '
               f'ffn={cfg.ffn_dim}, T={batch}x{seq} tokens, {UNITS_PER_LAYER * cfg.num_layers} units',
               lambda p, k: model_bytes(p, k * batch, seq, args.model, args.dtype),
               batch * seq, args.max_o, variants)
  print()
  static4 = rows['static 4-bit'][0]
  policy = precision.make_policy(_config(VARIANTS[SIDE_4_8]), max_recovered=args.max_o)
  buffer = policy.side_words_per_token(unit_kernel_shapes(cfg), jnp.dtype(args.dtype)) * 4
  raw_8bit = cfg.ffn_dim + 4  # the largest unit's 8-bit codes + float32 scale, per token
  extra = rows[SIDE_4_8][0] - static4
  per_unit_extra = rows['routed 4/8-bit, per-unit'][0] - static4
  print(f'model routed 4/8-bit residual bytes/token over static 4-bit: side buffer +{extra:.0f} '
        f'(the buffer: {buffer} = max_o {args.max_o} x largest unit {raw_8bit} B at 8 bits x '
        f'4/3 word packing); per-unit slots +{per_unit_extra:.0f}')
  print(f'model_side_buffer_extra_over_buffer: {extra / buffer:.3f}')
  print(f'routed_4_8_over_static_4bit: {rows[SIDE_4_8][0] / static4:.3f}')
  print(f'model_4bit_over_bf16 (all residuals of the step): {static4 / rows["bf16"][0]:.3f}')
  base = rows['projections keep nothing'][0]
  print('model_saved_activation_4bit_over_bf16 (over the keep-nothing baseline): '
        f'{(static4 - base) / (rows["bf16"][0] - base):.3f}')
  print(f'saved_activation_4bit_over_bf16: {stack["static 4-bit"][0] / stack["bf16"][0]:.3f}')

if __name__ == '__main__':
  main()
