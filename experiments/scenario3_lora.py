"""Scenario 3: LoRA fine-tuning with INT8 frozen base weights (paper claim 3), reduced.

    python experiments/scenario3_lora.py --scale cpu            # ~12 min, 2 cores
    python experiments/scenario3_lora.py --scale gpu            # 60M base, one GPU
    python experiments/scenario3_lora.py --scale gpu --dry_run  # build + 1 step here

1. Pretrain a base model on the Shakespeare split (bf16, seed 0; reused from
   experiments/runs/scenario3/<scale>/pretrain if present).
2. LoRA fine-tune (rank 8, alpha 16, on all seven projections; gnmr_jax.lora) on
   the Milton split, seeds 0..n-1 (adapter init and data order):
   * lora_bf16: float32 base weights, bf16 compute (the reference);
   * lora_int8: INT8-stored base weights (per-output-channel absmax), static INT8
     compute in forward, dlhs and drhs;
   * lora_gnmr: INT8-stored base weights, GNMR routing INT8 / BF16 per unit.
3. Report validation perplexity on held-out Milton and a cloze accuracy on held-out
   Milton lines: the line's last word (>= 3 letters) against 3 distractors drawn
   from other lines' last words, picked by the summed log-probability of its bytes
   after the rest of the line.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from experiments import common
from experiments import scenario1_saved_activation as scenario1
from gnmr_jax import lora, metrics_log, sharding, train_loop
from gnmr_jax.data import eval_texts, make_data
from gnmr_jax.control import from_config
from gnmr_jax.optim import learning_rate_schedule
from gnmr_jax.control.units import path_to_str

SCENARIO = "scenario3"
RANK, LORA_ALPHA = 8, 16.0
NUM_CLOZE = 200
CLOZE_CHOICES = 4


def base(scale: str, steps: int = 0):
  """Fine-tuning config (Milton); the pretraining config is derived from it."""
  config = scenario1.base(scale, steps)
  config.precision.saved_activation_scale = "token"
  config.precision.saved_activation_forward = False
  config.data.dataset = "gnmr_shakespeare/milton"
  config.optimizer.learning_rate = 2e-3
  config.optimizer.weight_decay = 0.0
  if not steps:
    config.train.steps = 200 if scale == "cpu" else 400
    config.train.eval_every = config.train.steps // 4
  return config


def pretrain_config(config):
  pre = ml_collections.ConfigDict(config.to_dict())
  pre.data.dataset = "gnmr_shakespeare/shakespeare"
  pre.precision.update(mode="static", low_cost_path="bf16")
  pre.optimizer.learning_rate = 3e-3
  pre.optimizer.weight_decay = 0.1
  pre.train.steps = 2 * config.train.steps
  pre.train.seed = pre.data.seed = 0
  return pre


A = common.Arm
ARMS = [
    A("lora_bf16", "LoRA, bf16 base weights and compute (reference)", "reference",
      {"mode": "static", "low_cost_path": "bf16"}),
    A("lora_int8", "LoRA, INT8 base weights, static INT8 compute", "static",
      {"mode": "static", "low_cost_path": "int8"}),
    A("lora_gnmr", "LoRA, INT8 base weights, GNMR INT8/BF16", "gnmr",
      {"mode": "gnmr", "low_cost_path": "int8", "recovery_path": "bf16"}),
]
NOTES = {
    "regime": f"LoRA rank {RANK}, alpha {LORA_ALPHA:g} on the 7 projections; base pretrained on "
              "Shakespeare (bf16, 2x the fine-tuning steps), fine-tuned on Milton; INT8 arms "
              "store the frozen base projections as per-output-channel int8; the GNMR units are "
              "the merged projection kernels",
    "low_cost_arm": "lora_int8",
}


def _save_params(params, path):
  flat = {path_to_str(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  np.savez(path, **flat)


def _load_params(template, path):
  stored = np.load(path)
  return jax.tree_util.tree_map_with_path(
      lambda p, leaf: jnp.asarray(stored[path_to_str(p)], leaf.dtype), template)


def pretrain(config, scale, data):
  """Trains (or loads) the Shakespeare base model; returns (params, its Milton-free ppl)."""
  workdir = os.path.join(common.RUNS_DIR, SCENARIO, scale, "pretrain")
  path = os.path.join(workdir, "params.npz")
  run = train_loop.build(config, data=data)
  with sharding.activation_sharding(run.mesh):
    state = run.init_state(jax.random.key(0))
    if os.path.exists(path):
      return _load_params(state.params, path), json.load(open(os.path.join(workdir, "eval.json")))
    os.makedirs(workdir, exist_ok=True)
    it = run.data.train_iterator()
    t0 = time.time()
    for _ in range(config.train.steps):
      state, metrics = run.train_step(state, train_loop.device_batch(run, next(it)))
    result = train_loop.evaluate(run, state)
    result["seconds"] = time.time() - t0
  _save_params(state.params, path)
  with open(os.path.join(workdir, "eval.json"), "w", encoding="utf-8") as f:
    json.dump(result, f)
  print(f"[{SCENARIO}/{scale}] pretrained: Shakespeare validation ppl "
        f"{result['eval_perplexity']:.3f} ({result['seconds']:.0f} s)", flush=True)
  return state.params, result


def cloze_items(data_config, tokenizer, seq_len, num=NUM_CLOZE, seed=0):
  """(tokens [num*C, seq_len+1], weights, answer index per item), deterministic."""
  lines = eval_texts(data_config, lines=True)
  items = []
  for line in lines:
    words = line.strip().split()
    if len(words) < 4:
      continue
    last = words[-1].strip(".,;:!?'\"()-")
    if len(last) < 3 or not last.isalpha():
      continue
    context = line.strip()[:line.strip().rfind(words[-1])]
    items.append((context, last))
  rng = np.random.default_rng(seed)
  pool = sorted({w for _, w in items})
  picks = rng.choice(len(items), size=min(num, len(items)), replace=False)
  tokens, weights, answers = [], [], []
  for i in sorted(picks):
    context, word = items[i]
    distractors = [w for w in rng.choice(pool, size=CLOZE_CHOICES * 3, replace=False)
                   if w != word][:CLOZE_CHOICES - 1]
    choices = distractors + [word]
    order = rng.permutation(CLOZE_CHOICES)
    choices = [choices[j] for j in order]
    answers.append(int(np.argmax(order == CLOZE_CHOICES - 1)))
    for choice in choices:
      ctx = list(tokenizer.encode(context))
      cand = list(tokenizer.encode(choice))
      ctx = ctx[-(seq_len + 1 - len(cand)):]
      seq = ctx + cand
      w = [0.0] * len(ctx) + [1.0] * len(cand)
      pad = seq_len + 1 - len(seq)
      tokens.append(seq + [0] * pad)
      weights.append(w + [0.0] * pad)
  return (np.asarray(tokens, np.int32), np.asarray(weights, np.float32),
          np.asarray(answers, np.int32))


def finetune(config, arm, seed, workdir, base_params, data, cloze, batch=64):
  """One LoRA run through the library's loop (gnmr_jax.lora.LoraTask in train_and_evaluate):
  the same logs, checkpoints and summary as pretraining, plus the cloze scores."""
  scale = LORA_ALPHA / RANK
  frozen = lora.quantize_base_int8(base_params) if arm.name != "lora_bf16" else base_params
  schedule = learning_rate_schedule(config.optimizer, config.train.steps)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(schedule, weight_decay=config.optimizer.weight_decay))

  def cloze_accuracy(run, state):
    logprob_fn = jax.jit(lora.make_sequence_logprob_fn(run.model, frozen, scale,
                                                       run.policy.routed))
    tokens, weights, answers = cloze
    scores = []
    for i in range(0, len(tokens), batch):
      tb, wb = tokens[i:i + batch], weights[i:i + batch]
      pad = batch - len(tb)
      if pad:
        tb = np.concatenate([tb, np.zeros((pad,) + tb.shape[1:], tb.dtype)])
        wb = np.concatenate([wb, np.zeros((pad,) + wb.shape[1:], wb.dtype)])
      scores.append(np.asarray(logprob_fn(state, jnp.asarray(tb), jnp.asarray(wb)))[:batch - pad])
    scores = np.concatenate(scores).reshape(-1, CLOZE_CHOICES)
    return float(np.mean(np.argmax(scores, axis=1) == answers))

  def summary_fn(run, state, final):
    if final:
      return {"cloze_accuracy": cloze_accuracy(run, state)}
    # Before fine-tuning (B = 0: the frozen base model itself, on Milton).
    return {"base_perplexity": train_loop.evaluate(run, state)["eval_perplexity"],
            "base_cloze_accuracy": cloze_accuracy(run, state)}

  task = lora.LoraTask(frozen, RANK, scale, optimizer, from_config(config.gnmr),
                       adapter_seed=1000 + seed, summary_fn=summary_fn)
  return train_loop.train_and_evaluate(config, workdir, data=data, task=task)


def main(argv=None):
  args = common.parse_args(argv, __doc__)
  arms = common.select_arms(ARMS, args.arms)
  config = base(args.scale, args.steps)
  common.enable_compilation_cache()
  if args.dry_run:
    config.data.batch_size, config.data.num_eval_batches = 2, 1
    config.train.steps, config.train.eval_every, config.logging.log_every = 1, 1, 1
  pre = pretrain_config(config)
  pre_data = make_data(pre.data)
  if args.dry_run:
    pre.train.steps = 1
    run = train_loop.build(pre, data=pre_data)
    with sharding.activation_sharding(run.mesh):
      params = run.init_state(jax.random.key(0)).params
  else:
    params, pre_eval = pretrain(pre, args.scale, pre_data)
  data = make_data(config.data)
  cloze = cloze_items(config.data, data.tokenizer, config.data.seq_len,
                      num=8 if args.dry_run else NUM_CLOZE)
  if args.dry_run:
    for arm in arms:
      workdir = os.path.join(common.RUNS_DIR, SCENARIO, "dry_run", arm.name)
      s = finetune(common.arm_config(config, arm, 0), arm, 0, workdir, params, data, cloze, batch=8)
      print(f"dry run {arm.name}: ppl {s['eval_perplexity']:.1f} cloze {s['cloze_accuracy']:.2f}")
    return

  def train_fn(cfg, workdir, arm, seed):
    summary = finetune(cfg, arm, seed, workdir, params, data, cloze)
    summary["pretrain_perplexity"] = pre_eval["eval_perplexity"]
    with open(os.path.join(workdir, metrics_log.SUMMARY_FILE), "w", encoding="utf-8") as f:
      json.dump(summary, f, indent=2)
    return summary

  notes = dict(NOTES, pretrain=f"Shakespeare validation perplexity of the base model "
                               f"{pre_eval['eval_perplexity']:.3f} after {pre.train.steps} steps",
               cloze=f"{len(cloze[2])} held-out Milton lines, {CLOZE_CHOICES} choices "
                     f"(chance {1 / CLOZE_CHOICES:.2f})")
  common.run_scenario(SCENARIO, args, arms, config, "lora_gnmr", notes, train_fn=train_fn)


if __name__ == "__main__":
  main()
