"""Reads the raw text of one split of any TFDS dataset, ours included.

TensorFlow Datasets is imported lazily so that `import gnmr_jax.data` stays
cheap; failures come back as ValueError/RuntimeError naming the config field.
"""

import os

OUR_BUILDER = 'gnmr_shakespeare'


def _is_ours(dataset: str) -> bool:
  return dataset.split('/')[0].split(':')[0] == OUR_BUILDER


def load_builder(config):
  """Returns the prepared TFDS builder of `config.dataset`."""
  import tensorflow_datasets as tfds  # Lazy: heavy (TensorFlow).
  builder_kwargs = {}
  if _is_ours(config.dataset):
    from gnmr_jax.data import shakespeare_builder  # Registers the builder.
    del shakespeare_builder
    builder_kwargs = dict(sdist_path=config.sdist_path,
                          corpus_cache_dir=config.corpus_cache_dir)
  data_dir = os.path.expanduser(config.data_dir)
  try:
    builder = tfds.builder(config.dataset, data_dir=data_dir, **builder_kwargs)
  except tfds.core.registered.DatasetNotFoundError:
    raise ValueError(
        f'data.dataset={config.dataset!r} is not a TFDS dataset; use a TFDS '
        f"name such as 'lm1b' or 'c4/en', or '{OUR_BUILDER}/shakespeare', "
        f"'{OUR_BUILDER}/milton', '{OUR_BUILDER}/all'.") from None
  except ValueError as e:
    raise ValueError(f'data.dataset={config.dataset!r}: '
                     f'{str(e).splitlines()[0]}') from None
  try:
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  except (ValueError, FileNotFoundError):
    raise  # Our own clear errors (checksum, missing sdist).
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(
        f'Could not download/prepare TFDS dataset data.dataset='
        f'{config.dataset!r} in data.data_dir={data_dir!r}: '
        f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}. '
        'Datasets other than gnmr_shakespeare need network access or an '
        'already prepared data_dir.') from e
  return builder


def _check_split_and_key(builder, config, split: str, field: str) -> None:
  features = builder.info.features
  if config.text_key not in features:
    raise ValueError(
        f'data.text_key={config.text_key!r} is not a feature of '
        f'{config.dataset!r}; features: {sorted(features.keys())}.')
  splits = builder.info.splits
  base = split.split('[')[0]
  if splits and base not in splits:  # Mocked builders list no splits.
    raise ValueError(f'data.{field}={split!r} is not a split of '
                     f'{config.dataset!r}; splits: {sorted(splits.keys())}.')


def read_texts(builder, config, split: str, field: str,
               max_examples: int = 0) -> list[str]:
  """Returns the `config.text_key` strings of `split` in dataset order.

  Args:
    builder: a prepared builder from `load_builder`.
    config: the data config.
    split: a TFDS split spec ('train', 'validation[:50%]').
    field: the config field that named `split`, for error messages.
    max_examples: read at most this many examples; 0 = all.
  """
  import tensorflow_datasets as tfds  # Lazy: heavy (TensorFlow).
  _check_split_and_key(builder, config, split, field)
  dataset = builder.as_dataset(split=split, shuffle_files=False)
  if max_examples:
    dataset = dataset.take(max_examples)
  texts = []
  for example in tfds.as_numpy(dataset):
    value = example[config.text_key]
    texts.append(value.decode('utf-8') if isinstance(value, bytes) else str(value))
  return texts
