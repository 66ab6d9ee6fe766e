"""Packed fixed-length batches over one token stream: shuffled, resumable, sliced per process.

The stream of N tokens is cut, per epoch, into W = (N - 1 - offset) // S windows
of S + 1 tokens that overlap by one (inputs = window[:-1], targets = window[1:]),
where offset in [0, S) and the window order are drawn from
`np.random.default_rng([seed, epoch])`. Each step takes the next B windows of the
permutation (the global batch; a remainder smaller than B is skipped) and this
process keeps rows [process_index * B_local, (process_index + 1) * B_local).
The state is two ints (epoch, step in epoch), so resuming is exact.

Example:
  >>> tokens = np.arange(100, dtype=np.uint16)
  >>> it = PackedBatchIterator(tokens, seq_len=4, global_batch_size=2, seed=0)
  >>> batch = next(it)
  >>> batch['inputs'].shape, bool((batch['targets'] == batch['inputs'] + 1).all())
  ((2, 4), True)
"""

import numpy as np

STATE_KEYS = ('epoch', 'step_in_epoch', 'seed', 'seq_len', 'global_batch_size')


def spread_batches(tokens, seq_len: int, global_batch_size: int,
                   num_batches: int, process_index: int = 0,
                   process_count: int = 1) -> list[dict[str, np.ndarray]]:
  """`num_batches` fixed global batches of windows spread evenly over `tokens`.

  Window k of the num_batches * B chosen starts at position
  S * floor(k * W / (num_batches * B)), W = number of windows, so evaluation
  covers the whole split rather than its first document.
  """
  local = global_batch_size // process_count
  total = num_batches * global_batch_size
  windows = (np.arange(total) * num_windows(len(tokens), seq_len)) // total
  batches = []
  for b in range(num_batches):
    first = b * global_batch_size + process_index * local
    batches.append(_gather(tokens, windows[first:first + local] * seq_len, seq_len))
  return batches


def num_windows(num_tokens: int, seq_len: int, offset: int = 0) -> int:
  return max(0, (num_tokens - 1 - offset) // seq_len)


def _gather(tokens, starts, seq_len: int) -> dict[str, np.ndarray]:
  window_BxS1 = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return {'inputs': window_BxS1[:, :-1], 'targets': window_BxS1[:, 1:]}


class PackedBatchIterator:
  """Infinite iterator of {'inputs', 'targets'}: int32[B_local, S] batches."""

  def __init__(self, tokens, seq_len: int, global_batch_size: int, seed: int,
               process_index: int = 0, process_count: int = 1):
    if num_windows(len(tokens), seq_len, seq_len - 1) < global_batch_size:
      raise ValueError(
          f'The train split has {len(tokens)} tokens: too few for one batch of '
          f'data.batch_size={global_batch_size} x data.seq_len={seq_len}.')
    self._tokens = tokens
    self._seq_len = seq_len
    self._global_batch_size = global_batch_size
    self._local_batch_size = global_batch_size // process_count
    self._seed = seed
    self._process_index = process_index
    self._epoch = 0
    self._step_in_epoch = 0
    self._plan_epoch = None  # (epoch, offset, window permutation)

  def __iter__(self):
    return self

  def _plan(self):
    if self._plan_epoch is None or self._plan_epoch[0] != self._epoch:
      rng = np.random.default_rng([self._seed, self._epoch])
      offset = int(rng.integers(0, self._seq_len))
      order = rng.permutation(num_windows(len(self._tokens), self._seq_len, offset))
      self._plan_epoch = (self._epoch, offset, order)
    return self._plan_epoch[1:]

  def __next__(self) -> dict[str, np.ndarray]:
    offset, order = self._plan()
    if (self._step_in_epoch + 1) * self._global_batch_size > len(order):
      self._epoch += 1
      self._step_in_epoch = 0
      offset, order = self._plan()
    first = (self._step_in_epoch * self._global_batch_size
             + self._process_index * self._local_batch_size)
    rows = order[first:first + self._local_batch_size]
    self._step_in_epoch += 1
    return _gather(self._tokens, offset + rows * self._seq_len, self._seq_len)

  def get_state(self) -> dict[str, int]:
    """Position in the stream (plain ints) for the checkpoint."""
    return {'epoch': self._epoch, 'step_in_epoch': self._step_in_epoch,
            'seed': self._seed, 'seq_len': self._seq_len,
            'global_batch_size': self._global_batch_size}

  def set_state(self, state) -> None:
    """Continues exactly after the batch at which `state` was taken."""
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
      raise ValueError(f'Iterator state lacks keys {missing}; expected {STATE_KEYS}.')
    for key in ('seed', 'seq_len', 'global_batch_size'):
      if int(state[key]) != getattr(self, '_' + key):
        raise ValueError(
            f'Iterator state has {key}={int(state[key])} but this iterator '
            f'has {key}={getattr(self, "_" + key)}; the data config changed.')
    if int(state['epoch']) < 0 or int(state['step_in_epoch']) < 0:
      raise ValueError(f'Iterator state has negative positions: {dict(state)}.')
    self._epoch = int(state['epoch'])
    self._step_in_epoch = int(state['step_in_epoch'])
