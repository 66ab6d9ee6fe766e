"""Tiny byte-level LLaMA with GNMR (int8 low-cost path, bf16 recovery) on the embedded
Shakespeare corpus: `make train` runs this in a few minutes on 2 CPU cores.

Override anything from the command line, e.g. --config.gnmr.max_o=5 --config.train.steps=200.
"""

from gnmr_jax.config import base_config


def get_config(arg=None):
  config = base_config("tiny")
  config.data.tokenizer = "bytes"
  config.data.seq_len = 128
  config.data.batch_size = 16
  config.train.steps = 300
  config.train.eval_every = 100
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 30
  config.precision.mode = "gnmr"
  config.precision.low_cost_path = "int8"
  config.precision.recovery_path = "bf16"
  config.gnmr.warmup = 20
  config.checkpoint.every_steps = 100
  if arg == "runlocal":  # seconds, for tests
    config.model.d_model = 64
    config.model.num_layers = 2
    config.model.num_heads = 2
    config.model.num_kv_heads = 2
    config.model.ffn_dim = 128
    config.data.seq_len = 32
    config.data.batch_size = 4
    config.data.num_eval_batches = 2
    config.train.steps = 8
    config.train.eval_every = 4
    config.gnmr.warmup = 2
    config.optimizer.warmup_steps = 2
    config.checkpoint.every_steps = 4
    config.logging.log_every = 2
    config.logging.unit_log_every = 1
    config.logging.progress_bar = False
  return config
