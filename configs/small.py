"""Small byte-level LLaMA (25M parameters) with GNMR: a few minutes on one GPU.

On a GPU with fp8 support (H100/H200) set --config.precision.low_cost_path=fp8; on TPU keep int8.
"""

from gnmr_jax.config import base_config


def get_config(arg=None):
  config = base_config("small")
  config.data.tokenizer = "bytes"
  config.data.seq_len = 512
  config.data.batch_size = 64
  config.train.steps = 2000
  config.train.eval_every = 250
  config.optimizer.learning_rate = 2e-3
  config.optimizer.warmup_steps = 200
  config.precision.mode = "gnmr"
  config.precision.low_cost_path = "int8"
  config.gnmr.warmup = 100
  config.checkpoint.every_steps = 500
  config.logging.log_every = 25
  config.logging.unit_log_every = 10
  if arg == "runlocal":
    config.train.steps = 4
    config.data.batch_size = 2
    config.data.seq_len = 64
  return config
