"""Cost of the GNMR controller on top of an optimizer step, measured side by side.

For each parameter tree (a ~100M-parameter LLaMA-shaped tree, plus the model
configs given by --configs) it times, interleaved in one run, jitted and with
donated state:
  adamw                      optax.adamw
  gnmr+adamw                 optax.chain(gnmr, adamw)
  clip+adamw                 optax.chain(clip_by_global_norm, adamw)
  gnmr+clip+adamw            optax.chain(gnmr, clip_by_global_norm, adamw)  (the train chain)
and prints the ratios. The last line is `controller_over_adamw: <ratio>` =
time(gnmr+adamw) / time(adamw) for the ~100M tree (goal: < 1.02).

Usage: python benchmarks/controller_overhead.py [--configs tiny,60m] [--repeats 15]
"""
import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import gnmr_jax
from gnmr_jax.config import gnmr_config

UNITS = gnmr_config().units  # the projections' kernels (from gnmr_jax.model.PROJECTIONS)


def llama_shapes(d_model, num_layers, ffn_dim, vocab, num_kv_heads_dim=None):
  """Param shapes of a layer-stacked LLaMA (as gnmr_jax.model lays them out)."""
  kv = num_kv_heads_dim or d_model
  L = num_layers
  return {
      "embed": {"embedding": (vocab, d_model)},
      "layers": {
          "attn": {"q": {"kernel": (L, d_model, d_model)}, "k": {"kernel": (L, d_model, kv)},
                   "v": {"kernel": (L, d_model, kv)}, "o": {"kernel": (L, d_model, d_model)}},
          "mlp": {"gate": {"kernel": (L, d_model, ffn_dim)}, "up": {"kernel": (L, d_model, ffn_dim)},
                  "down": {"kernel": (L, ffn_dim, d_model)}},
          "attn_norm": {"scale": (L, d_model)}, "mlp_norm": {"scale": (L, d_model)}},
      "final_norm": {"scale": (d_model,)},
      "head": {"kernel": (d_model, vocab)},
  }


TREES = {
    # ~100M parameters: 12 layers, d=768, ffn=2048, vocab 8192.
    "100m_cpu": dict(d_model=768, num_layers=12, ffn_dim=2048, vocab=8192),
    "tiny": dict(d_model=256, num_layers=4, ffn_dim=688, vocab=256),
    "60m": dict(d_model=512, num_layers=8, ffn_dim=1376, vocab=32000),
    "130m": dict(d_model=768, num_layers=12, ffn_dim=2048, vocab=32000),
}


def make_tree(shapes, key):
  leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(key, len(leaves))
  return jax.tree_util.tree_unflatten(
      treedef, [jax.random.normal(k, s, jnp.float32) * 0.02 for k, s in zip(keys, leaves)])


def chains():
  ctl = lambda: gnmr_jax.gnmr(alpha=3.0, beta=2.0, delta=4, max_o=4, t_lock=2,
                              units=UNITS, layer_axis=r"layers/")
  return {
      "adamw": optax.adamw(1e-3),
      "gnmr+adamw": optax.chain(ctl(), optax.adamw(1e-3)),
      "clip+adamw": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
      "gnmr+clip+adamw": optax.chain(ctl(), optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
  }


def bench_tree(name, repeats):
  shapes = llama_shapes(**TREES[name])
  params = make_tree(shapes, jax.random.key(0))
  grads = make_tree(shapes, jax.random.key(1))
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  runners = {}
  for label, tx in chains().items():
    def step(params, state, grads, tx=tx):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    fn = jax.jit(step, donate_argnums=(0, 1))
    p = jax.tree.map(jnp.copy, params)
    s = tx.init(p)
    for _ in range(2):  # compile + warm
      p, s = fn(p, s, grads)
    jax.block_until_ready(p)
    runners[label] = [fn, p, s, []]
  for _ in range(repeats):  # interleaved: every chain sees the same machine noise
    for label, r in runners.items():
      fn, p, s, times = r
      t0 = time.perf_counter()
      p, s = fn(p, s, grads)
      jax.block_until_ready((p, s))
      times.append(time.perf_counter() - t0)
      r[1], r[2] = p, s
  med = {label: statistics.median(r[3]) for label, r in runners.items()}
  return n_params, med


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", default="100m_cpu,tiny,60m,130m",
                      help=f"comma-separated trees from {sorted(TREES)}")
  parser.add_argument("--repeats", type=int, default=15)
  args = parser.parse_args()
  print(f"# controller overhead, {time.strftime('%Y-%m-%d')}, {platform.node()}, "
        f"jax {jax.__version__}, optax {optax.__version__}, devices {jax.devices()}")
  print(f"{'tree':10s} {'params':>10s} {'adamw ms':>9s} {'gnmr+adamw':>11s} "
        f"{'clip+adamw':>11s} {'gnmr+clip+adamw':>16s} {'ratio g+a/a':>12s} {'ratio g+c+a/c+a':>16s}")
  headline = None
  for name in args.configs.split(","):
    n_params, med = bench_tree(name, args.repeats)
    r1 = med["gnmr+adamw"] / med["adamw"]
    r2 = med["gnmr+clip+adamw"] / med["clip+adamw"]
    print(f"{name:10s} {n_params / 1e6:9.1f}M {med['adamw'] * 1e3:9.2f} "
          f"{med['gnmr+adamw'] * 1e3:11.2f} {med['clip+adamw'] * 1e3:11.2f} "
          f"{med['gnmr+clip+adamw'] * 1e3:16.2f} {r1:12.4f} {r2:16.4f}")
    if headline is None:
      headline = r1
  print(f"controller_over_adamw: {headline:.4f}")


if __name__ == "__main__":
  main()
