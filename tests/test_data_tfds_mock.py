"""The generic TFDS path (lm1b here) with tfds.testing.mock_data: no network."""

import numpy as np
import pytest
import tensorflow_datasets as tfds

from gnmr_jax import data as data_lib


def test_lm1b_through_the_same_code_path(tmp_path):
  config = data_lib.default_data_config()
  config.update(dataset='lm1b', text_key='text', eval_split='test',
                data_dir=str(tmp_path), seq_len=16, batch_size=4,
                num_eval_batches=1, max_train_examples=40)
  with tfds.testing.mock_data(num_examples=60):
    data = data_lib.make_data(config)
    texts = [ex['text'].decode() for ex in tfds.as_numpy(
        tfds.builder('lm1b', data_dir=str(tmp_path)).as_dataset(
            split='train', shuffle_files=False).take(40))]
  expected = np.concatenate([list(t.encode()) + [256] for t in texts])
  assert data.stats['train_examples'] == 40
  np.testing.assert_array_equal(data.train_tokens, expected)
  batch = next(data.train_iterator())
  assert batch['inputs'].shape == (4, 16)
  assert 1.0 < data.unigram_perplexity < 257


def test_mocked_dataset_without_the_text_key(tmp_path):
  config = data_lib.default_data_config()
  config.update(dataset='lm1b', text_key='sentence', data_dir=str(tmp_path))
  with tfds.testing.mock_data(num_examples=5):
    with pytest.raises(ValueError, match="data.text_key='sentence' is not a feature of 'lm1b'; features: \\['text'\\]"):
      data_lib.make_data(config)
