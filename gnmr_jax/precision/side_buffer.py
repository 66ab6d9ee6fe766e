r"""A shared side buffer for the residuals of recovered units.

Why: when a routed unit may run a recovery path that keeps larger residuals
than its low-cost path (an 8-bit or bf16 saved activation instead of a 4-bit
one), per-unit residual slots must hold the larger set for *every* unit, so a
routed 4/8-bit model stores 8-bit bytes even with nothing recovered. GNMR
recovers at most ``max_o`` units per step, so the recovery residuals fit in one
buffer of ``max_o`` unit-sized regions shared by the whole model: each unit
keeps only its low-cost residuals, and a recovered unit appends its recovery
residuals to the buffer.

How (a cotangent channel): the buffer is a value threaded through the forward
pass like a scan carry, ``(y, side) = dot(x, kernel, recover, side)``, and a
recovered unit writes its residuals at the buffer's current offset. The
backward pass of unit *j* must read what unit *j* wrote, but the only value a
``custom_vjp`` backward gets from later in the program is its output's
cotangent. So the side buffer's cotangent carries the buffer itself: ``attach``
ends the chain (its backward returns the final buffer as the cotangent of its
input), and every unit's backward reads its region from the incoming
cotangent and passes it on unchanged. The buffer is therefore kept once (the
``attach`` residual), not once per unit.

For that to be exact the buffer's dtype must survive whatever JAX does to
cotangents (it may add zeros): residual bytes are packed three to a float32
word as the integer ``b0 + 2^8 b1 + 2^16 b2 < 2^24``, which float32 holds
exactly, never NaN, infinite, negative zero or subnormal. The price is 4/3 of
the raw bytes in the buffer.

Rules for callers (the model and ``testing.stack_apply`` follow them):
the state returned by one unit goes to the next unit only (a chain, no fan-out),
and the last state goes to ``attach`` on a value the loss depends on.
First-order reverse mode only: differentiating the backward pass again
(reverse-over-reverse) raises (``first_order_only``); use per-unit storage for
that.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BYTES_PER_WORD = 3  # Bytes packed into one float32 word (an integer < 2^24).
WORD_DTYPE = jnp.float32


class SideState(NamedTuple):
  """The buffer threaded through routed units.

  Attributes:
    buffer: float32[..., W] words per token; the leading axes are the tokens'
      (the activations' leading axes, so it shards like them).
    offset: int32[] first free word of the last axis.
    dropped: int32[] recoveries that did not fit and ran the low-cost path
      (0 when the mask holds at most the buffer's units).
  """

  buffer: jax.Array
  offset: jax.Array
  dropped: jax.Array


def init(token_shape: Sequence[int], words_per_token: int) -> SideState:
  """An empty side state for activations of leading shape ``token_shape``."""
  return SideState(jnp.zeros(tuple(token_shape) + (words_per_token,), WORD_DTYPE),
                   jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))


def no_cotangent(buffer_cotangent: jax.Array) -> SideState:
  """The cotangent of a SideState: the buffer's, and float0 zeros for the counters."""
  zero = np.zeros((), jax.dtypes.float0)
  return SideState(buffer_cotangent, zero, zero)


def _row_bytes(aval) -> int:
  return (aval.size // aval.shape[0]) * jnp.dtype(aval.dtype).itemsize


def num_words(avals: Sequence) -> int:
  """Words per row that ``pack`` needs for arrays of these avals ([M, ...] each)."""
  return -(-sum(_row_bytes(a) for a in avals) // BYTES_PER_WORD)


def check_rows(avals: Sequence, rows: int, what: str) -> None:
  """Raises ValueError unless every aval has ``rows`` leading rows."""
  for a in avals:
    if not a.shape or a.shape[0] != rows:
      raise ValueError(
          f'side-buffer storage needs residuals with one row per token ([{rows}, ...]); '
          f'{what} has a residual of shape {tuple(a.shape)}. Use '
          "recovery_storage='per_unit' for this path pair.")


def pack(leaves: Sequence[jax.Array]) -> jax.Array:
  """Packs [M, ...] arrays of any dtype into float32[M, num_words] integer words.

  Example:
    >>> import jax.numpy as jnp
    >>> words = pack([jnp.array([[1, 2, 3, 4]], jnp.uint8)])
    >>> words.tolist()   # 1 + 2*256 + 3*65536, then 4 (padded)
    [[197121.0, 4.0]]
  """
  rows = leaves[0].shape[0]
  parts = []
  for leaf in leaves:
    flat = leaf.reshape(rows, -1)
    if flat.dtype == jnp.bool_:
      flat = flat.astype(jnp.uint8)
    if flat.dtype != jnp.uint8:
      flat = lax.bitcast_convert_type(flat, jnp.uint8).reshape(rows, -1)
    parts.append(flat)
  data = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
  pad = -data.shape[1] % BYTES_PER_WORD
  if pad:
    data = jnp.pad(data, ((0, 0), (0, pad)))
  data = data.reshape(rows, -1, BYTES_PER_WORD).astype(jnp.int32)
  return (data[..., 0] | (data[..., 1] << 8) | (data[..., 2] << 16)).astype(WORD_DTYPE)


def unpack(words: jax.Array, avals: Sequence) -> list[jax.Array]:
  """Inverse of ``pack``: the arrays of ``avals`` from float32[M, num_words(avals)]."""
  ints = words.astype(jnp.int32)
  data = jnp.stack([ints & 255, (ints >> 8) & 255, (ints >> 16) & 255], axis=-1)
  data = data.astype(jnp.uint8).reshape(words.shape[0], -1)
  out, start = [], 0
  for a in avals:
    size = _row_bytes(a)
    chunk = data[:, start:start + size]
    start += size
    dtype = jnp.dtype(a.dtype)
    if dtype == jnp.bool_:
      out.append(chunk.reshape(a.shape).astype(jnp.bool_))
    elif dtype == jnp.uint8:
      out.append(chunk.reshape(a.shape))
    else:
      chunk = chunk.reshape(a.shape[0], -1, dtype.itemsize)
      out.append(lax.bitcast_convert_type(chunk, dtype).reshape(a.shape))
  return out


@jax.custom_vjp
def _attach(y: jax.Array, buffer: jax.Array) -> jax.Array:
  del buffer
  return y


def _attach_fwd(y, buffer):
  return y, buffer


def _attach_bwd(buffer, g):
  # y's cotangent passes unchanged; the buffer's "cotangent" is the final buffer itself
  # (a channel, not a derivative).
  return g, buffer


_attach.defvjp(_attach_fwd, _attach_bwd)


def attach(y: jax.Array, state: SideState | None) -> jax.Array:
  """Returns ``y`` unchanged and closes the side-buffer chain.

  Call it once, on a value the loss depends on (the model's logits), with the
  state the last routed unit returned; its backward sends the final buffer back
  to the units. ``state=None`` returns ``y`` as is.
  """
  if state is None:
    return y
  return _attach(y, state.buffer)


@jax.custom_jvp
def first_order_only(g: jax.Array) -> jax.Array:
  """Identity that refuses to be differentiated (guards the side buffer's backward).

  The side buffer stores residuals as integer words, which carry no derivative, so
  differentiating a backward pass that reads them (reverse-over-reverse, e.g. a
  gradient penalty) would silently drop terms. Its JVP rule raises instead.
  """
  return g


@first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
  del primals, tangents
  raise NotImplementedError(
      "higher-order derivatives through a routed unit with recovery_storage='side_buffer' "
      "are not supported (its residuals are stored as integer words and carry no "
      "derivative); use precision.recovery_storage='per_unit' for gradient penalties or "
      "other derivatives of gradients.")
