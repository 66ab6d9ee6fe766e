"""The harsher saved-activation stress options (per-tensor scale, quantized forward) vs NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gnmr_jax import precision
from gnmr_jax.precision import saved_activation as sa
from tests.tolerances import assert_allclose, matmul_atol

M, K, N = 24, 40, 16


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((M, K))
  x[3] *= 25.0  # an outlier token: per-tensor scaling flattens the other rows
  w = rng.standard_normal((K, N)) / np.sqrt(K)
  g = rng.standard_normal((M, N))
  return x, w, g


def _qdq(x, bits, per_tensor):
  """float64 reference of quantize-dequantize with round to nearest (ties to even)."""
  max_code = 2 ** (bits - 1) - 1
  amax = np.max(np.abs(x)) if per_tensor else np.max(np.abs(x), axis=1, keepdims=True)
  scale = np.where(amax > 0, amax / max_code, 1.0)
  return np.clip(np.round(x / scale), -max_code, max_code) * scale


def _bf16(a):
  return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32),
                    np.float64)


def assert_bf16_product(got, a, b):
  """got == a @ b (bf16-valued float64 operands) up to the float32 accumulation."""
  assert_allclose(got, a @ b, atol=matmul_atol(a, b))


def _vjp(dot, x, w, g):
  fn = jax.jit(lambda x, w, g: (lambda y, vjp: (y,) + vjp(g))(*jax.vjp(dot, x, w)))
  return [np.asarray(a, np.float64) for a in fn(jnp.asarray(x, jnp.float32),
                                                 jnp.asarray(w, jnp.float32),
                                                 jnp.asarray(g, jnp.float32))]


@pytest.mark.parametrize('bits', [2, 4])
@pytest.mark.parametrize('scale', ['token', 'tensor'])
@pytest.mark.parametrize('quantize_forward', [False, True])
def test_saved_activation_options_match_float64_reference(bits, scale, quantize_forward):
  x, w, g = _inputs()
  dot = sa.make_saved_activation_dot(bits, scale=scale, quantize_forward=quantize_forward)
  y, dx, dw = _vjp(dot, x, w, g)
  x_hat = _qdq(np.asarray(np.float32(x), np.float64), bits, scale == 'tensor')
  x_fwd = x_hat if quantize_forward else x
  # Operands go through bf16 (f32 accumulation): compare against bf16-rounded operands.
  # Products of bf16 numbers are exact in float32, so only the float32 sum rounds:
  # gamma_K of the terms, elementwise (the library's float32 x_hat rounds to the same
  # bf16 numbers as the float64 one: no element of this draw sits at a bf16 tie).
  assert_bf16_product(y, _bf16(x_fwd), _bf16(w))
  assert_bf16_product(dx, _bf16(g), _bf16(w).T)
  assert_bf16_product(dw, _bf16(x_hat).T, _bf16(g))


def test_per_tensor_scale_is_coarser_than_per_token_on_outlier_rows():
  x, w, g = _inputs()
  exact = x.T @ g
  errors = {}
  for scale in ('token', 'tensor'):
    _, _, dw = _vjp(sa.make_saved_activation_dot(4, scale=scale), x, w, g)
    errors[scale] = np.linalg.norm(dw - exact) / np.linalg.norm(exact)
  assert errors['tensor'] > 2 * errors['token'], errors


def test_defaults_keep_the_per_token_weight_gradient_only_stress():
  config = precision.default_precision_config()
  assert config.saved_activation_scale == 'token' and not config.saved_activation_forward
  config.mode, config.low_cost_path = 'static', 'saved_activation'
  x, w, g = _inputs(1)
  got = _vjp(precision.make_policy(config).dot, x, w, g)
  want = _vjp(sa.make_saved_activation_dot(4), x, w, g)
  # Exact: the default config builds this very path, so both run the same program.
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  # The forward is the exact bf16 product: nothing but dW sees the 4-bit copy.
  assert_bf16_product(got[0], _bf16(x), _bf16(w))


def test_invalid_stress_scale_is_rejected_naming_the_field():
  config = precision.default_precision_config()
  config.saved_activation_scale = 'channel'
  with pytest.raises(ValueError, match="'saved_activation_scale'.*'token', 'tensor'"):
    precision.make_policy(config)


def test_routed_policy_uses_the_options_in_both_roles():
  config = precision.default_precision_config()
  config.update(low_cost_path='saved_activation', recovery_path='saved_activation',
                saved_activation_bits=2, recovery_saved_activation_bits=8,
                saved_activation_scale='tensor', saved_activation_forward=True)
  policy = precision.make_policy(config)
  x, w, _ = _inputs(2)
  xj, wj = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
  for recover, bits in ((False, 2), (True, 8)):
    y = np.asarray(jax.jit(policy.dot)(xj, wj, jnp.asarray(recover)), np.float64)
    assert_bf16_product(y, _bf16(_qdq(np.asarray(np.float32(x), np.float64), bits, True)),
                        _bf16(w))
