"""Tokenizers: raw UTF-8 bytes, or a SentencePiece model trained on the train split.

Both map text to ids in [0, vocab_size) and reserve `eos_id`, which the packer
puts after every document. Both round-trip any text exactly:
`decode(encode(s)) == s` (SentencePiece uses identity normalisation, keeps
whitespace, has a newline piece and falls back to bytes for unseen characters).

Example:
  >>> tokenizer = ByteTokenizer()
  >>> tokenizer.encode('Hi')
  [72, 105]
  >>> tokenizer.decode([72, 105, tokenizer.eos_id])
  'Hi'
"""

import io

import numpy as np


class ByteTokenizer:
  """Ids 0..255 are UTF-8 bytes; 256 ends a document."""

  vocab_size = 257
  eos_id = 256

  def encode(self, text: str) -> list[int]:
    return list(text.encode('utf-8'))

  def encode_to_array(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode('utf-8'), dtype=np.uint8)

  def decode(self, ids) -> str:
    data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
    return data.decode('utf-8', errors='replace')


class SentencePieceTokenizer:
  """Wraps a serialized SentencePiece model."""

  def __init__(self, model_proto: bytes):
    import sentencepiece  # Lazy: only this tokenizer needs it.
    self.model_proto = model_proto
    self._processor = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
    self.vocab_size = int(self._processor.get_piece_size())
    self.eos_id = int(self._processor.eos_id())

  def encode(self, text: str) -> list[int]:
    return list(self._processor.encode(text))

  def encode_to_array(self, text: str) -> np.ndarray:
    return np.asarray(self._processor.encode(text), dtype=np.int64)

  def decode(self, ids) -> str:
    return self._processor.decode([int(i) for i in ids])


def train_sentencepiece(texts, vocab_size: int, model_type: str = 'unigram',
                        num_threads: int = 2) -> bytes:
  """Trains a SentencePiece model on the non-empty lines of `texts`.

  Args:
    texts: the training documents.
    vocab_size: number of pieces, including 256 byte-fallback pieces,
      <unk>, </s> and the newline piece.
    model_type: 'unigram' or 'bpe'.
    num_threads: trainer threads.

  Returns:
    The serialized model proto.
  """
  import sentencepiece  # Lazy: only this tokenizer needs it.
  lines = [line for text in texts for line in text.split('\n') if line.strip()]
  if not lines:
    raise ValueError('Cannot train SentencePiece: the train split has no text.')
  model = io.BytesIO()
  try:
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model,
        vocab_size=vocab_size, model_type=model_type, byte_fallback=True,
        normalization_rule_name='identity', remove_extra_whitespaces=False,
        user_defined_symbols=['\n'], split_digits=True,
        unk_id=0, eos_id=1, bos_id=-1, pad_id=-1, max_sentence_length=1 << 14,
        num_threads=num_threads, minloglevel=2)
  except RuntimeError as e:
    raise ValueError(
        f'SentencePiece training failed for data.vocab_size={vocab_size} '
        f'({str(e).splitlines()[-1]}); try a smaller data.vocab_size or '
        'more training text.') from None
  return model.getvalue()
