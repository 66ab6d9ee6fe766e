"""`make_data`: config -> tokenizer, cached packed token streams, iterators.

The first call reads both splits through TFDS, trains the tokenizer if needed,
and writes `<data_dir>/gnmr_jax_tokens/<key>/{train.npy, eval.npy,
tokenizer.model, meta.json}` (atomically, so processes sharing a data dir can
race safely). Later calls with the same dataset/split/tokenizer fields only
load those arrays and import no TensorFlow.

Example:
  >>> config = default_data_config()
  >>> config.data_dir = '/tmp/tfds'
  >>> data = make_data(config)
  >>> batch = next(data.train_iterator())
  >>> batch['inputs'].shape
  (16, 256)
"""

import copy
import hashlib
import json
import os
import shutil
import tempfile

import ml_collections
import numpy as np

from gnmr_jax.data import config as config_lib
from gnmr_jax.data import iterator as iterator_lib
from gnmr_jax.data import tfds_text
from gnmr_jax.data import tokenizers

CACHE_FORMAT = 1
# Fields that change the cached tokens; seq_len, batch_size and seed do not.
_CACHE_FIELDS = ('dataset', 'text_key', 'tokenizer', 'train_split', 'eval_split',
                 'max_train_examples', 'max_eval_examples')
_SENTENCEPIECE_FIELDS = ('vocab_size', 'sentencepiece_model_type')


def cache_dir_for(config) -> str:
  """The token cache directory of `config` (a function of _CACHE_FIELDS)."""
  fields = _CACHE_FIELDS + (
      _SENTENCEPIECE_FIELDS if config.tokenizer == 'sentencepiece' else ())
  key = {f: config[f] for f in fields}
  key['format'] = CACHE_FORMAT
  digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
  slug = ''.join(c if c.isalnum() else '_' for c in config.dataset)
  return os.path.join(os.path.expanduser(config.data_dir), 'gnmr_jax_tokens',
                      f'{slug}-{config.tokenizer}-{digest[:12]}')


def _pack(tokenizer, texts) -> np.ndarray:
  """Concatenates encode(text) + [eos] for every text."""
  pieces = []
  eos = np.array([tokenizer.eos_id])
  for text in texts:
    pieces.append(tokenizer.encode_to_array(text))
    pieces.append(eos)
  if not pieces:
    return np.zeros((0,), np.uint16)
  return np.concatenate(pieces).astype(np.uint16)


def _prepare(config, target: str) -> None:
  """Reads the splits through TFDS and writes the token cache into `target`."""
  builder = tfds_text.load_builder(config)
  train_texts = tfds_text.read_texts(builder, config, config.train_split,
                                     'train_split', config.max_train_examples)
  eval_texts = tfds_text.read_texts(builder, config, config.eval_split,
                                    'eval_split', config.max_eval_examples)
  if config.tokenizer == 'sentencepiece':
    model_proto = tokenizers.train_sentencepiece(
        train_texts, config.vocab_size, config.sentencepiece_model_type)
    tokenizer = tokenizers.SentencePieceTokenizer(model_proto)
  else:
    model_proto, tokenizer = b'', tokenizers.ByteTokenizer()
  train_tokens = _pack(tokenizer, train_texts)
  eval_tokens = _pack(tokenizer, eval_texts)
  parent = os.path.dirname(target)
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix='.staging-', dir=parent)
  np.save(os.path.join(staging, 'train.npy'), train_tokens)
  np.save(os.path.join(staging, 'eval.npy'), eval_tokens)
  with open(os.path.join(staging, 'tokenizer.model'), 'wb') as f:
    f.write(model_proto)
  meta = {
      'dataset': config.dataset, 'tokenizer': config.tokenizer,
      'vocab_size': tokenizer.vocab_size,
      'train_examples': len(train_texts), 'eval_examples': len(eval_texts),
      'train_chars': sum(map(len, train_texts)),
      'eval_chars': sum(map(len, eval_texts)),
      'train_tokens': int(train_tokens.size), 'eval_tokens': int(eval_tokens.size),
  }
  with open(os.path.join(staging, 'meta.json'), 'w') as f:
    json.dump(meta, f, indent=1)
  try:
    os.rename(staging, target)
  except OSError:  # Another process finished first; its cache is identical.
    shutil.rmtree(staging, ignore_errors=True)


def unigram_perplexity(train_tokens, eval_targets, vocab_size: int) -> float:
  """exp(-mean log p(t)) over `eval_targets`, p = add-one train unigram freqs.

  p(v) = (count_train(v) + 1) / (N_train + V).
  """
  counts = np.bincount(np.asarray(train_tokens, np.int64).ravel(),
                       minlength=vocab_size).astype(np.float64)
  log_probs = np.log(counts + 1.0) - np.log(counts.sum() + vocab_size)
  return float(np.exp(-log_probs[np.asarray(eval_targets).ravel()].mean()))


# Fields that say where files live: they never change a batch.
LOCATION_FIELDS = ('data_dir', 'corpus_cache_dir', 'sdist_path')


class Data:
  """Tokenizer, packed train/eval streams and batch makers for one process.

  Attributes:
    vocab_size: ids are in [0, vocab_size).
    tokenizer: `encode(str) -> list[int]`, `decode(list[int]) -> str`.
    unigram_perplexity: the add-one train-unigram perplexity of the targets
      of the global eval batches: a trained model must get below it.
    stats: counts from the prepare step (examples, chars, tokens per split).
  """

  def __init__(self, config, tokenizer, train_tokens, eval_tokens, stats,
               process_index: int = 0, process_count: int = 1):
    self.config = config
    self.tokenizer = tokenizer
    self.vocab_size = int(tokenizer.vocab_size)
    self.train_tokens = train_tokens
    self.eval_tokens = eval_tokens
    self.stats = stats
    self.process_index = process_index
    self.process_count = process_count
    available = (iterator_lib.num_windows(len(eval_tokens), config.seq_len)
                 // config.batch_size)
    num_eval = config.num_eval_batches or available
    if available < max(num_eval, 1):
      raise ValueError(
          f'data.num_eval_batches={config.num_eval_batches} needs {max(num_eval, 1)} '
          f'batches of data.batch_size={config.batch_size} x data.seq_len='
          f'{config.seq_len}, but data.eval_split={config.eval_split!r} holds '
          f'{len(eval_tokens)} tokens ({available} batches).')
    self._eval_batches = iterator_lib.spread_batches(
        eval_tokens, config.seq_len, config.batch_size, num_eval,
        process_index, process_count)
    global_targets = iterator_lib.spread_batches(
        eval_tokens, config.seq_len, config.batch_size, num_eval)
    self.unigram_perplexity = unigram_perplexity(
        train_tokens, np.stack([b['targets'] for b in global_targets]),
        self.vocab_size)

  def for_config(self, data_config) -> 'Data':
    """This data as a run configured with `data_config` must see it.

    A run reuses prebuilt data only if every field that shapes its batches agrees
    (`data.seed` aside: the train iterator of the result draws its order from
    `data_config.seed`, so one prepared corpus serves every seed of an experiment).

    Args:
      data_config: the run's `config.data`.

    Returns:
      `self` when the seeds agree, else a copy sharing the token arrays whose
      config carries the run's seed.

    Raises:
      ValueError: naming every field (other than where files live) in which
        `data_config` differs from the config this data was built from.
    """
    mine, theirs = self.config.to_dict(), data_config.to_dict()
    diffs = [f'data.{k}: the prebuilt data has {mine.get(k, "no such field")!r}, the run '
             f'has {theirs.get(k, "no such field")!r}'
             for k in sorted(set(mine) | set(theirs))
             if k not in LOCATION_FIELDS + ('seed',) and mine.get(k) != theirs.get(k)]
    if diffs:
      raise ValueError('The prebuilt data was made from another data config than the run\'s; '
                       'build it with make_data(config.data) or pass data=None. Mismatches: '
                       + '; '.join(diffs))
    if mine.get('seed') == theirs.get('seed'):
      return self
    reseeded = copy.copy(self)
    reseeded.config = ml_collections.ConfigDict(mine)
    reseeded.config.seed = int(theirs['seed'])
    return reseeded

  def train_iterator(self) -> iterator_lib.PackedBatchIterator:
    """A fresh infinite iterator at epoch 0, step 0 (use set_state to resume)."""
    return iterator_lib.PackedBatchIterator(
        self.train_tokens, self.config.seq_len, self.config.batch_size,
        self.config.seed, self.process_index, self.process_count)

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    """The same fixed validation batches (this process' rows) on every call."""
    return list(self._eval_batches)


def make_data(data_config, process_index: int = 0, process_count: int = 1) -> Data:
  """Builds the data of this process from the data config.

  Args:
    data_config: fields of `default_data_config()`.
    process_index: this process (`jax.process_index()`).
    process_count: number of processes (`jax.process_count()`); each reads
      data_config.batch_size // process_count rows of every global batch.

  Returns:
    A `Data`.
  """
  config_lib.validate_data_config(data_config, process_index, process_count)
  target = cache_dir_for(data_config)
  if not os.path.isfile(os.path.join(target, 'meta.json')):
    _prepare(data_config, target)
  with open(os.path.join(target, 'meta.json')) as f:
    stats = json.load(f)
  if data_config.tokenizer == 'sentencepiece':
    with open(os.path.join(target, 'tokenizer.model'), 'rb') as f:
      tokenizer = tokenizers.SentencePieceTokenizer(f.read())
  else:
    tokenizer = tokenizers.ByteTokenizer()
  train_tokens = np.load(os.path.join(target, 'train.npy'), mmap_mode='r')
  eval_tokens = np.load(os.path.join(target, 'eval.npy'))
  return Data(data_config, tokenizer, train_tokens, eval_tokens, stats,
              process_index, process_count)


def eval_texts(data_config, lines: bool = False) -> list[str]:
  """Held-out raw text of data_config.eval_split, read through TFDS.

  Args:
    data_config: fields of `default_data_config()`.
    lines: return the non-empty lines (for cloze tests) instead of documents
      (for gnmr_shakespeare: one document per held-out work).

  Returns:
    The strings in dataset order (deterministic).
  """
  config_lib.validate_data_config(data_config)
  builder = tfds_text.load_builder(data_config)
  texts = tfds_text.read_texts(builder, data_config, data_config.eval_split,
                               'eval_split', data_config.max_eval_examples)
  if lines:
    return [line for text in texts for line in text.split('\n') if line.strip()]
  return texts
