"""The paper's LLaMA sizes: --config=configs/llama.py:60m (also 130m, 350m, 1b, 7b, 13b).

SentencePiece vocabulary trained on the training split (set --config.data.dataset=c4/en or lm1b
with internet); sequence length 256 as in the low-precision pretraining literature.
"""

from gnmr_jax.config import base_config
from gnmr_jax.model_configs import MODEL_NAMES

PAPER_SIZES = ("60m", "130m", "350m", "1b", "7b", "13b")


def get_config(arg="60m"):
  arg = arg or "60m"
  if arg not in PAPER_SIZES:
    raise ValueError(f"configs/llama.py:<size> must be one of {PAPER_SIZES}, got {arg!r} "
                     f"(all model names: {MODEL_NAMES}).")
  config = base_config(arg)
  config.data.tokenizer = "sentencepiece"
  config.data.vocab_size = 8192
  config.data.seq_len = 256
  config.data.batch_size = 256
  config.train.steps = 10000
  config.train.eval_every = 1000
  config.optimizer.learning_rate = {"60m": 1e-3, "130m": 1e-3, "350m": 1e-3}.get(arg, 5e-4)
  config.optimizer.warmup_steps = 1000
  config.precision.mode = "gnmr"
  config.precision.low_cost_path = "int8"
  config.gnmr.warmup = 200
  config.checkpoint.every_steps = 1000
  config.logging.log_every = 50
  config.logging.unit_log_every = 25
  return config
