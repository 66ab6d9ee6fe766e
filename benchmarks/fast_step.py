"""The step around the GEMMs: attention kernel and fused loss against the reference, side by side.

One train-step program (forward + backward of the LLaMA model and its loss, the optimizer left
out) per variant, timed interleaved in one run:

  reference   model.attention='xla' (float32 scores), float32 logits [B, S, V] and optax's loss
  attention   the kernel 'auto' resolves to on this device (cuDNN on a GPU, splash on a TPU)
  loss        the fused chunked loss (gnmr_jax/loss.py: float32 logits of one chunk at a time)
  both        the two together: the default since issue 44

Columns: compile seconds, XLA's temporaries (MiB), ms per step, and the speed-up over the
reference. Then the same `both` step for the low-cost paths (--paths) against bf16 `both`: what
the GEMM paths buy once the step around them is fast. A path may name its scaling recipe and
mode, `path[:scaling[:gnmr]]` (issue 45: `fp8:delayed`, `fp8:delayed:gnmr` routed with nothing
recovered; a delayed step takes its amax histories and returns the next ones). Last line:
`fast_step_speedup: <reference ms / both ms>`.

  python benchmarks/fast_step.py                                    # tiny config, CPU size
  python benchmarks/fast_step.py --model 1b --batch 16 --seq 2048   # a GPU (scripts/gpu_checks.sh)
"""
import argparse
import datetime
import functools
import os
import platform
import sys

import flax.linen as nn
import jax
import ml_collections
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._timing import compile_stats, interleaved_seconds, temp_mib  # noqa: E402
from gnmr_jax import attention, precision  # noqa: E402
from gnmr_jax.model import PROJECTIONS, Transformer, init_amax_history  # noqa: E402
from gnmr_jax.model_configs import model_config  # noqa: E402

VARIANTS = {  # name: (attention, fused loss)
    'reference': ('xla', False), 'attention': ('auto', False), 'loss': ('xla', True),
    'both': ('auto', True)}


def policy_for(path):
  """'fp8', 'fp8:tensor', 'fp8:delayed:gnmr' -> the policy (routed for ':gnmr')."""
  parts = path.split(':')
  name, scaling, mode = parts[0], (parts[1:2] or ['row'])[0], (parts[2:3] or ['static'])[0]
  cfg = precision.default_precision_config()
  cfg.mode, cfg.low_cost_path, cfg.scaling = mode, name, scaling
  cfg.recovery_storage = 'per_unit'  # the trainer's under remat: nothing kept per unit
  return precision.make_policy(cfg)


def make_step(model_cfg, path, attention_impl, fused_loss):
  cfg = ml_collections.ConfigDict(model_cfg.to_dict())
  cfg.attention = attention_impl
  policy = policy_for(path)
  model = Transformer(cfg, policy)
  extra = {}
  if policy.routed:  # nothing recovered: every bit False
    extra['recovery_mask'] = {'layers': {group: {name: {'kernel': jax.numpy.zeros(
        cfg.num_layers, bool)} for name in names} for group, names in PROJECTIONS.items()}}
  history = (jax.tree.map(lambda h: h + 1.0, init_amax_history(cfg, policy.amax_history_length))
             if policy.takes_history else None)

  def loss(params, tokens, history):
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    kwargs = dict(extra, **({'amax_history': history} if history is not None else {}))
    if fused_loss:
      return model.apply({'params': params}, inputs, targets=targets, **kwargs) / targets.size
    logits = model.apply({'params': params}, inputs, **kwargs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  # A delayed step returns the next histories too (the gradient of its histories).
  grads = jax.value_and_grad(loss, argnums=(0, 2) if history is not None else 0)
  return model, jax.jit(lambda params, tokens: grads(params, tokens, history))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', default='tiny')
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--seq', type=int, default=128, help='tokens per sequence')
  parser.add_argument('--vocab', type=int, default=0, help='vocabulary (0: the model\'s)')
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--remat', default='config', help="model.remat, or 'config'")
  parser.add_argument('--paths', default='fp8,int8', help='low-cost paths timed after bf16')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--iters', type=int, default=3)
  parser.add_argument('--compile_only', action='store_true',
                      help='compile every program, time nothing (a GPU size checked on a CPU)')
  args = parser.parse_args()
  model_cfg = model_config(args.model)
  model_cfg.dtype = args.dtype
  model_cfg.max_seq_len = max(model_cfg.max_seq_len, args.seq)
  if args.vocab:
    model_cfg.vocab_size = args.vocab
  if args.remat != 'config':
    model_cfg.remat = args.remat
  head_dim = model_cfg.d_model // model_cfg.num_heads
  resolved = attention.resolve('auto', seq_len=args.seq, head_dim=head_dim, dtype=args.dtype)
  # +1: the step reads seq tokens and predicts the next of each.
  tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0,
                              model_cfg.vocab_size)
  print(f'# {datetime.date.today()} {platform.node()} jax {jax.__version__} backend '
        f'{jax.default_backend()} ({jax.devices()[0].device_kind}); model {args.model} '
        f'L={model_cfg.num_layers} d={model_cfg.d_model} vocab={model_cfg.vocab_size} '
        f'batch={args.batch} seq={args.seq} dtype={args.dtype} remat={model_cfg.remat} '
        f"loss_chunks={model_cfg.loss_chunks}; 'auto' attention = {resolved}")
  model, _ = make_step(model_cfg, 'bf16', 'xla', False)
  init = lambda k: nn.unbox(model.init(k, tokens[:, :-1])['params'])
  params = (jax.eval_shape(init, jax.random.key(0)) if args.compile_only
            else jax.jit(init)(jax.random.key(0)))
  rows = {}
  for name, (impl, fused) in VARIANTS.items():
    rows[('bf16', name)] = make_step(model_cfg, 'bf16', impl, fused)[1]
  for path in filter(None, args.paths.split(',')):
    rows[(path, 'both')] = make_step(model_cfg, path, 'auto', True)[1]
  compiled = {key: compile_stats(fn, params, tokens) for key, fn in rows.items()}
  if args.compile_only:
    print('path | variant | compile_s | temp_MiB')
    for (path, name), (program, compile_s, _) in compiled.items():
      print(f'{path} | {name} | {compile_s:.1f} | {temp_mib(program):.0f}')
    print('fast_step_speedup: nan')
    return
  seconds = interleaved_seconds(
      {key: functools.partial(c[0], params, tokens) for key, c in compiled.items()},
      rounds=args.rounds, iters=args.iters)
  reference, both = seconds[('bf16', 'reference')], seconds[('bf16', 'both')]
  print('path | variant | compile_s | temp_MiB | ms | x_reference | x_bf16_both')
  for (path, name), (program, compile_s, _) in compiled.items():
    ms = seconds[(path, name)] * 1e3
    print(f'{path} | {name} | {compile_s:.1f} | {temp_mib(program):.0f} | {ms:.2f} | '
          f'{reference * 1e3 / ms:.2f} | {both * 1e3 / ms:.2f}')
  print(f'fast_step_speedup: {reference / both:.3f}')


if __name__ == '__main__':
  main()
