"""Data for gnmr_jax: TFDS text -> tokenizer -> packed, resumable batches.

Public API:
  default_data_config() -> ml_collections.ConfigDict
  make_data(data_config, process_index=0, process_count=1) -> Data
  eval_texts(data_config, lines=False) -> list[str]  (held-out raw text)
The TFDS builder `gnmr_shakespeare/{shakespeare,milton,all}` lives in
`gnmr_jax.data.shakespeare_builder` (importing it registers it; make_data does).
"""

from gnmr_jax.data.config import default_data_config
from gnmr_jax.data.config import validate_data_config
from gnmr_jax.data.corpus import CorpusChecksumError
from gnmr_jax.data.corpus import ensure_sdist
from gnmr_jax.data.pipeline import Data
from gnmr_jax.data.pipeline import eval_texts
from gnmr_jax.data.pipeline import make_data
from gnmr_jax.data.pipeline import unigram_perplexity
from gnmr_jax.data.tokenizers import ByteTokenizer
from gnmr_jax.data.tokenizers import SentencePieceTokenizer

__all__ = [
    'ByteTokenizer', 'CorpusChecksumError', 'Data', 'SentencePieceTokenizer',
    'default_data_config', 'ensure_sdist', 'eval_texts', 'make_data',
    'unigram_perplexity', 'validate_data_config',
]
