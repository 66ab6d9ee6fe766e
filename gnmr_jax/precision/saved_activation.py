r"""Saved-activation quantization: bf16 compute, the saved input stored at k bits.

The stress test of the paper. The forward and the input gradient are the bf16
path; only the activation kept for the weight gradient is stored at k bits
(per-token absmax scale, round to nearest or stochastic rounding), so
:math:`\partial W = \hat{x}^T g` uses the dequantized :math:`\hat{x}`.

Two options make the stress harsher (both off by default): ``scale='tensor'``
uses one absmax scale for the whole [M, K] activation instead of one per token,
so a few outlier tokens flatten the rest to a handful of codes; and
``quantize_forward=True`` also feeds :math:`\hat{x}` to the forward product
(:math:`y = \hat{x}W`, straight-through :math:`\partial x = gW^T`), so the error
reaches the loss, the later layers' activations and, through the nonlinearities
and attention, the input gradient, and compounds across layers.

Storage is real: k <= 2 codes live in one plane of 2-bit fields,
uint8[M, ceil(K/4)]; wider codes in 4-bit nibble planes of uint8[M, ceil(K/2)]
(one plane for 3 <= k <= 4, two for 5 <= k <= 8, four bit-exact planes for
bf16); plus a float32[M, 1] scale. So 2 bits really store half the bytes of 4.

The plane shape is therefore not the same for every width. Under the default
routed storage (``recovery_storage='side_buffer'``, side_buffer.py) that does
not matter: a unit keeps only its low-cost planes and a recovered unit's planes
go to the shared side buffer. Under ``recovery_storage='per_unit'``, widths
3..8 and bf16 share the nibble-plane shape on purpose: a routed unit lays out its
branches' residuals merged by shape and dtype
(``routing.merge_residual_slots``), so a routed 4-bit/8-bit unit stores two
planes (the larger branch), not a 4-bit copy plus an 8-bit copy. A 2-bit plane
matches no nibble plane, so a routed 2-bit/8-bit unit under this per-unit
storage keeps the 2-bit plane in a slot of its own next to the two 8-bit planes
(K/4 bytes per token more than the 8-bit set alone).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gnmr_jax.precision import path as path_lib
from gnmr_jax.precision import explicit_sharding, quantize, registry

BF16_BITS = 16  # `bits` value meaning "store the exact bf16 activation".
VALID_BITS = tuple(range(2, 9)) + (BF16_BITS,)
# 'token': one absmax scale per row of x [M, K]; 'tensor': one for the whole x.
SCALES = ('token', 'tensor')


def _noise_key(x: jax.Array) -> jax.Array:
  # A key derived from the activation's bits: no key has to be threaded through
  # the model, and the noise changes whenever the activation does.
  bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jax.random.fold_in(jax.random.key(0), jnp.sum(bits, dtype=jnp.uint32))


def quantize_activation(x: jax.Array, bits: int, stochastic_rounding: bool = False,
                        scale: str = 'token'):
  r"""Stores x [M, K] at ``bits`` bits per element with a per-token (row) absmax scale.

  :math:`s_m = \max_k |x_{mk}| / (2^{b-1}-1)` (``scale='tensor'``: one
  :math:`s = \max_{m,k} |x_{mk}| / (2^{b-1}-1)` for every row), codes
  :math:`c = \mathrm{clip}(\mathrm{round}(x/s), \pm(2^{b-1}-1))`, or
  :math:`\lfloor x/s + u \rfloor`, :math:`u \sim U[0,1)` with stochastic rounding
  (unbiased: :math:`E[c\,s] = x`).

  Args:
    x: [M, K] activation.
    bits: 2..8, or 16 for the exact bf16 value (bit planes, no scale rounding).
    stochastic_rounding: round stochastically instead of to nearest.
    scale: 'token' (one scale per row) or 'tensor' (one scale, broadcast to
      [M, 1] so both choices have the same residual shape).

  Returns:
    ``(planes, scale)``: a tuple of packed uint8 planes (one uint8[M, ceil(K/4)]
    plane of 2-bit fields for bits <= 2, else uint8[M, ceil(K/2)] nibble planes;
    see ``quantize.codes_to_planes``) and the float32[M, 1] scale.
  """
  if scale not in SCALES:
    raise ValueError(f'saved-activation scale must be one of {SCALES}, got {scale!r}.')
  if bits == BF16_BITS:
    raw = lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    planes = tuple(quantize.pack_nibbles(((raw >> (4 * p)) & 15).astype(jnp.uint8))
                   for p in range(4))
    return planes, jnp.ones((x.shape[0], 1), jnp.float32)
  max_code = 2 ** (bits - 1) - 1
  axes = 1 if scale == 'token' else (0, 1)
  scale = jnp.broadcast_to(quantize.absmax_scale(x, axes, max_code), (x.shape[0], 1))
  y = x.astype(jnp.float32) / scale
  if stochastic_rounding:
    y = jnp.floor(y + jax.random.uniform(_noise_key(x), y.shape))
  else:
    y = jnp.round(y)
  codes = jnp.clip(y, -max_code, max_code).astype(jnp.int32)
  return quantize.codes_to_planes(codes, bits), scale


def dequantize_activation(planes, scale, bits: int, size: int) -> jax.Array:
  """Inverse of ``quantize_activation``: float32 [M, size]."""
  if bits == BF16_BITS:
    raw = jnp.zeros(planes[0].shape[:-1] + (size,), jnp.uint16)
    for p, plane in enumerate(planes):
      raw = raw | (quantize.unpack_nibbles(plane, size).astype(jnp.uint16) << (4 * p))
    return lax.bitcast_convert_type(raw, jnp.bfloat16).astype(jnp.float32)
  return quantize.planes_to_codes(planes, bits, size).astype(jnp.float32) * scale


def saved_activation_path(bits: int, stochastic_rounding: bool = False, scale: str = 'token',
                          quantize_forward: bool = False) -> path_lib.Path:
  r"""bf16 dot whose saved activation is stored at ``bits`` bits.

  Forward :math:`y = xW` and :math:`\partial x = gW^T` are bf16 (float32
  accumulation) with the exact weights; :math:`\partial W = \hat{x}^T g` with
  :math:`\hat{x}` the dequantized saved activation. Residuals: the packed code
  planes and the float32[M, 1] scale (plus the kernel); ``x`` itself is not kept.

  Args:
    bits: 2..8, or 16 for bf16 storage (the recovery choice "in bf16").
    stochastic_rounding: stochastic instead of round-to-nearest codes.
    scale: 'token' (per-row absmax scale) or 'tensor' (one absmax scale).
    quantize_forward: also compute the forward from the dequantized activation,
      :math:`y = \hat{x}W` (the input gradient stays :math:`gW^T`, straight through).

  Returns:
    A ``Path``; ``path_lib.path_dot`` of it is the differentiable dot.
  """
  if bits not in VALID_BITS:
    raise ValueError(f'saved-activation bits must be one of {VALID_BITS}, got {bits!r}.')
  if scale not in SCALES:
    raise ValueError(f'saved-activation scale must be one of {SCALES}, got {scale!r}.')

  def forward(x, kernel):
    planes, x_scale = quantize_activation(x, bits, stochastic_rounding, scale)
    if quantize_forward:
      x_hat = dequantize_activation(planes, x_scale, bits, x.shape[1]).astype(x.dtype)
      return quantize.bf16_matmul(x_hat, kernel, x.dtype), (planes, x_scale)
    return quantize.bf16_matmul(x, kernel, x.dtype), (planes, x_scale)

  def backward(residuals, x, kernel, g):
    # x is only its ShapeDtypeStruct (not saved): the weight gradient uses the
    # dequantized activation, and dx takes x's sharding under an explicit mesh.
    planes, x_scale = residuals
    x_hat = dequantize_activation(planes, x_scale, bits, kernel.shape[0])
    # The output cotangent g has x's dtype.
    return (quantize.bf16_matmul(g, kernel.T, g.dtype,
                                 explicit_sharding.out_sharding(x)),
            quantize.bf16_matmul(x_hat.T, g, kernel.dtype,
                                 explicit_sharding.out_sharding(kernel)))

  return path_lib.Path(forward=forward, backward=backward, saves_input=False)


def make_saved_activation_dot(bits: int, stochastic_rounding: bool = False,
                              scale: str = 'token', quantize_forward: bool = False):
  """``dot(x [M,K], kernel [K,N])`` of ``saved_activation_path(bits, ...)``."""
  return path_lib.path_dot(saved_activation_path(bits, stochastic_rounding, scale,
                                                 quantize_forward))


def build(config, role):
  """Registry builder: ``saved_activation_bits`` as the low-cost path,
  ``recovery_saved_activation_bits`` as the recovery path; both use
  ``saved_activation_scale`` and ``saved_activation_forward`` (absent fields, as
  in configs written before they existed, mean 'token' and False)."""
  bits = (config.saved_activation_bits if role == 'low_cost'
          else config.recovery_saved_activation_bits)
  return saved_activation_path(bits, config.stochastic_rounding,
                               config.get('saved_activation_scale', 'token'),
                               config.get('saved_activation_forward', False))


registry.register_path('saved_activation', build)
