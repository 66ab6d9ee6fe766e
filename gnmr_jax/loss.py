r"""Output head and cross-entropy fused, chunked along the sequence.

Why: an LM head writes float32 logits [B, S, V] that the cross-entropy reads back; at a
32000-token vocabulary that tensor dominates the step's memory (and its backward keeps
another one, the logits' cotangent). Here the head's matmul and the loss run one chunk of
the sequence at a time under a ``lax.scan``, so only one chunk's float32 logits
[B, S / num_chunks, V] are alive at once; the batch axis stays whole in every chunk, so a
batch-sharded x keeps its sharding.

The loss of token (b, s) with target t and weight w is

  l_bs = w (logsumexp_v z_bsv - z_bst),   z = x @ head   (float32 accumulation),

and ``chunked_cross_entropy`` returns L = sum_bs l_bs. Its gradient is formed in the
forward pass, chunk by chunk, from the same logits:

  dz = w (softmax(z) - onehot(t)),   dx = dz @ head^T,   dhead = sum_chunks x^T @ dz,

three GEMMs per chunk and no recomputation; the backward only scales the saved dx and
dhead by L's cotangent. The two gradient GEMMs read dz in x's dtype with float32
accumulation (what a bf16 mixed-precision head does; in float32 nothing is rounded).
Without differentiation only the forward GEMM runs.

The target logit is picked with a one-hot mask and a sum over the vocabulary, not a
gather, so the program is well typed when the logits' vocabulary axis is sharded under
explicit mesh axes (a gather has no unique output type there) and needs no all-gather.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from gnmr_jax import sharding
from gnmr_jax.precision import explicit_sharding

# Logical axes of a chunk's logits (gnmr_jax.sharding's rules).
LOGIT_AXES = ('batch', 'length', 'vocab')


def _check(x_BxSxD, head_DxV, targets_BxS, weights_BxS, num_chunks) -> None:
  """ValueErrors naming the argument that does not fit (before any tracing of the scan)."""
  if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
    raise ValueError(f'num_chunks must be an int >= 1, got {num_chunks!r}')
  if x_BxSxD.ndim != 3:
    raise ValueError(f'x_BxSxD must have shape [batch, seq, d_model], got {x_BxSxD.shape}')
  if head_DxV.ndim != 2 or head_DxV.shape[0] != x_BxSxD.shape[2]:
    raise ValueError(f'head_DxV must have shape [d_model={x_BxSxD.shape[2]}, vocab], '
                     f'got {head_DxV.shape}')
  for name, value in (('x_BxSxD', x_BxSxD), ('head_DxV', head_DxV)):
    if not jnp.issubdtype(value.dtype, jnp.floating):
      raise ValueError(f'{name} must be a float array, got {value.dtype}')
  if not jnp.issubdtype(targets_BxS.dtype, jnp.integer):
    raise ValueError(f'targets_BxS must be an integer array, got {targets_BxS.dtype}')
  if targets_BxS.shape != x_BxSxD.shape[:2]:
    raise ValueError(f'targets_BxS must have shape [batch, seq] = {x_BxSxD.shape[:2]}, '
                     f'got {targets_BxS.shape}')
  if weights_BxS is not None and weights_BxS.shape != x_BxSxD.shape[:2]:
    raise ValueError(f'weights_BxS must have shape [batch, seq] = {x_BxSxD.shape[:2]}, '
                     f'got {weights_BxS.shape}')


def _to_chunks(a_BxS_, num_chunks: int, chunk: int):
  """[B, S, ...] -> [num_chunks, B, chunk, ...], padded with zeros past S."""
  pad = num_chunks * chunk - a_BxS_.shape[1]
  if pad:
    a_BxS_ = jnp.pad(a_BxS_, [(0, 0), (0, pad)] + [(0, 0)] * (a_BxS_.ndim - 2))
  a_BxNxC_ = a_BxS_.reshape(a_BxS_.shape[:1] + (num_chunks, chunk) + a_BxS_.shape[2:])
  return jnp.moveaxis(a_BxNxC_, 1, 0)


def _from_chunks(a_NxBxC_, seq_len: int):
  """[num_chunks, B, chunk, ...] -> [B, seq_len, ...] (the padding dropped)."""
  a_BxNxC_ = jnp.moveaxis(a_NxBxC_, 0, 1)
  a_BxS_ = a_BxNxC_.reshape(a_BxNxC_.shape[:1] + (-1,) + a_BxNxC_.shape[3:])
  return a_BxS_[:, :seq_len]


def _chunk_logits(x_BxCxD, head_DxV):
  """float32 logits of one chunk, sharded by LOGIT_AXES, and the one-hot mask's iota."""
  logits_BxCxV = jnp.einsum('bcd,dv->bcv', x_BxCxD, head_DxV,
                            preferred_element_type=jnp.float32)
  logits_BxCxV = sharding.constrain(logits_BxCxV, LOGIT_AXES)
  vocab_BxCxV = lax.broadcasted_iota(jnp.int32, logits_BxCxV.shape, 2,
                                     **_sharding_kwargs(logits_BxCxV))
  return logits_BxCxV, vocab_BxCxV


def _sharding_kwargs(like) -> dict:
  typed = explicit_sharding.out_sharding(like)
  return {} if typed is None else {'out_sharding': typed}


def _chunk_losses(logits_BxCxV, vocab_BxCxV, targets_BxC):
  """Per-token cross-entropies float32[B, C] and the logsumexp they used."""
  lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
  onehot_BxCxV = vocab_BxCxV == targets_BxC[..., None]
  target_BxC = jnp.sum(jnp.where(onehot_BxCxV, logits_BxCxV, 0.0), axis=-1)
  return lse_BxC - target_BxC, lse_BxC, onehot_BxCxV


def _scan_chunks(body, carry, operands_BxS_, num_chunks):
  """`lax.scan(body, carry, ...)` over sequence chunks of the [B, S, ...] operands.

  Chunks of ceil(S / num_chunks) positions, as many as S needs (never an all-padding one),
  padded with zeros. The outputs per chunk come back as [B, S, ...]. One chunk: body runs
  once on the operands as they are (no loop, no reshapes).
  """
  seq_len = operands_BxS_[0].shape[1]
  chunk = -(-seq_len // num_chunks)
  num_chunks = -(-seq_len // chunk)
  if num_chunks == 1:
    return body(carry, operands_BxS_)
  xs = tuple(_to_chunks(a, num_chunks, chunk) for a in operands_BxS_)
  carry, ys = lax.scan(body, carry, xs)
  return carry, jax.tree.map(lambda y: _from_chunks(y, seq_len), ys)


def _token_losses(x_BxSxD, head_DxV, targets_BxS, num_chunks):
  """float32[B, S] cross-entropies, one chunk's logits at a time (forward only)."""
  def body(_, xs):
    x_BxCxD, targets_BxC = xs
    logits_BxCxV, vocab_BxCxV = _chunk_logits(x_BxCxD, head_DxV)
    return None, _chunk_losses(logits_BxCxV, vocab_BxCxV, targets_BxC)[0]

  return _scan_chunks(body, None, (x_BxSxD, targets_BxS), num_chunks)[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _cross_entropy_sum(x_BxSxD, head_DxV, targets_BxS, weights_BxS, num_chunks):
  losses_BxS = _token_losses(x_BxSxD, head_DxV, targets_BxS, num_chunks)
  return jnp.sum(weights_BxS * losses_BxS)


def _cross_entropy_sum_fwd(x_BxSxD, head_DxV, targets_BxS, weights_BxS, num_chunks):
  compute = x_BxSxD.dtype
  head_sharding = explicit_sharding.out_sharding(head_DxV)
  dhead_DxV = explicit_sharding.zeros(
      jax.ShapeDtypeStruct(head_DxV.shape, jnp.float32, sharding=head_sharding))

  def body(dhead_DxV, xs):
    x_BxCxD, targets_BxC, weights_BxC = xs
    logits_BxCxV, vocab_BxCxV = _chunk_logits(x_BxCxD, head_DxV)
    losses_BxC, lse_BxC, onehot_BxCxV = _chunk_losses(logits_BxCxV, vocab_BxCxV, targets_BxC)
    probs_BxCxV = jnp.exp(logits_BxCxV - lse_BxC[..., None])
    dlogits_BxCxV = (probs_BxCxV - onehot_BxCxV) * weights_BxC[..., None]
    dlogits_BxCxV = dlogits_BxCxV.astype(compute)
    dx_BxCxD = jnp.einsum('bcv,dv->bcd', dlogits_BxCxV, head_DxV,
                          preferred_element_type=jnp.float32,
                          **_sharding_kwargs(x_BxCxD)).astype(compute)
    dhead_DxV = dhead_DxV + jnp.einsum('bcd,bcv->dv', x_BxCxD, dlogits_BxCxV,
                                       preferred_element_type=jnp.float32,
                                       **_sharding_kwargs(dhead_DxV))
    return dhead_DxV, (losses_BxC, dx_BxCxD)

  # Padded positions get weight 0: no loss, no gradient.
  dhead_DxV, (losses_BxS, dx_BxSxD) = _scan_chunks(
      body, dhead_DxV, (x_BxSxD, targets_BxS, weights_BxS), num_chunks)
  loss = jnp.sum(weights_BxS * losses_BxS)
  return loss, (dx_BxSxD, dhead_DxV, explicit_sharding.static_type(head_DxV))


def _cross_entropy_sum_bwd(num_chunks, residuals, g):
  del num_chunks
  dx_BxSxD, dhead_DxV, head_type = residuals
  # One rounding each to the returned dtypes (none in float32 but the product's own).
  dx_BxSxD = (g * dx_BxSxD.astype(jnp.float32)).astype(dx_BxSxD.dtype)
  dhead_DxV = explicit_sharding.retype((g * dhead_DxV).astype(head_type.aval.dtype),
                                       head_type.aval)
  return dx_BxSxD, dhead_DxV, None, None


_cross_entropy_sum.defvjp(_cross_entropy_sum_fwd, _cross_entropy_sum_bwd)


def chunked_cross_entropy(x_BxSxD: jax.Array, head_DxV: jax.Array, targets_BxS: jax.Array,
                          weights_BxS: jax.Array | None = None, *, num_chunks: int
                          ) -> jax.Array:
  r"""Sum over tokens of w (logsumexp(x @ head) - (x @ head)[target]), in float32.

  :math:`L = \sum_{b,s} w_{bs} (\log \sum_v e^{z_{bsv}} - z_{b s t_{bs}})` with
  :math:`z = x\,\mathrm{head}` accumulated in float32, computed ``num_chunks`` sequence
  chunks at a time so float32 [B, S, V] logits never exist (module docstring).

  Args:
    x_BxSxD: final hidden states [B, S, D] in the compute dtype (bfloat16 or float32).
    head_DxV: output head [D, V] in the compute dtype.
    targets_BxS: integer target ids [B, S] in [0, V).
    weights_BxS: per-token weights [B, S] (float or bool), or None for all ones.
    num_chunks: chunks along S (an int >= 1): chunks of ceil(S / num_chunks) positions,
      the last one padded with zero-weight positions when they do not divide S (so at
      most S chunks, fewer when fewer cover S).

  Returns:
    float32 scalar L. Its gradients: dx in x's dtype, dhead in head's dtype; none for
    the targets and weights.

  Raises:
    ValueError: an argument of the wrong shape or dtype, or a bad num_chunks.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> x = jax.random.normal(jax.random.key(0), (2, 6, 4))
    >>> head = jax.random.normal(jax.random.key(1), (4, 10))
    >>> targets = jnp.arange(12).reshape(2, 6) % 10
    >>> loss = chunked_cross_entropy(x, head, targets, num_chunks=4)
    >>> want = optax.softmax_cross_entropy_with_integer_labels(x @ head, targets).sum()
    >>> bool(jnp.allclose(loss, want, rtol=1e-5))
    True
    >>> dx, dhead = jax.grad(chunked_cross_entropy, argnums=(0, 1))(
    ...     x, head, targets, num_chunks=4)
    >>> dx.shape, dhead.shape
    ((2, 6, 4), (4, 10))
  """
  _check(x_BxSxD, head_DxV, targets_BxS, weights_BxS, num_chunks)
  if weights_BxS is None:
    weights_BxS = jnp.ones(targets_BxS.shape, jnp.float32, **_sharding_kwargs(targets_BxS))
  weights_BxS = lax.stop_gradient(weights_BxS.astype(jnp.float32))
  return _cross_entropy_sum(x_BxSxD, head_DxV, targets_BxS, weights_BxS, num_chunks)


def chunked_token_losses(x_BxSxD: jax.Array, head_DxV: jax.Array, targets_BxS: jax.Array,
                         *, num_chunks: int) -> jax.Array:
  r"""Per-token cross-entropies float32[B, S], ``num_chunks`` sequence chunks at a time.

  :math:`l_{bs} = \log \sum_v e^{z_{bsv}} - z_{b s t_{bs}}`, z = x @ head accumulated in
  float32: the values whose weighted sum ``chunked_cross_entropy`` returns, for scoring
  and evaluation code that needs them per token. Forward only (differentiable, but
  through the scan, with no saving).

  Args:
    x_BxSxD, head_DxV, targets_BxS, num_chunks: as in ``chunked_cross_entropy``.

  Returns:
    float32[B, S].

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> x = jax.random.normal(jax.random.key(0), (2, 5, 4))
    >>> head = jax.random.normal(jax.random.key(1), (4, 7))
    >>> targets = jnp.arange(10).reshape(2, 5) % 7
    >>> losses = chunked_token_losses(x, head, targets, num_chunks=2)
    >>> want = optax.softmax_cross_entropy_with_integer_labels(x @ head, targets)
    >>> losses.shape, bool(jnp.allclose(losses, want, rtol=1e-5))
    ((2, 5), True)
  """
  _check(x_BxSxD, head_DxV, targets_BxS, None, num_chunks)
  return _token_losses(x_BxSxD, head_DxV, targets_BxS, num_chunks)
