"""Tolerances for the tests' float comparisons, derived from the compared quantities.

Float32 programs round. Two float32 programs for the same math (another scan
layout, a sharded sum, another XLA fusion, another CPU's vector width or FMA
use) round differently, and a float32 program differs from its float64 NumPy
reference. A tolerance must follow from the size of that rounding, never from
what one CPU happened to show (issue 11). The models used here:

* One n-term sum s = sum_i t_i (a dot product, a mean, a norm): in any order,
  |fl(s) - s| <= gamma_n * sum_i |t_i| with gamma_n = n u / (1 - n u) and
  u = eps / 2 (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed.,
  eq. 3.5; n terms of a dot product include the n product roundings). Two
  orders both sit that close to s: they differ by at most 2 gamma_n sum_i |t_i|.
  `gamma`, `matmul_atol`.
* A chain of reductions (a network, layer after layer), where the worst case
  is far too loose: rounding errors behave like a random walk, so a float32
  n-term sum is off by about sqrt(n) u sum_i |t_i| (Higham and Mary, SIAM J.
  Sci. Comput. 41(5), 2019) and two orders by about sqrt(n) eps; the errors of
  successive sums add up along the chain (first order, unit gain). `chain_ulps`
  sums sqrt(n) over the chain; `f32_atol` scales it by max |reference|, the
  size of the terms in a network whose activations are normalized.
* bfloat16 roundings of matmul operands (BF16_EPS): each is <= u_bf16 relative;
  independent ones add up like a random walk, so a norm-wise drift of sqrt(R)
  eps_bf16 over R roundings on a value's path.

`assert_allclose` takes an elementwise (array) tolerance too. With
GNMR_TOLERANCE_LOG=<file> set it appends one JSON line per check: the worst
|actual - desired| / tolerance, i.e. the margin each tolerance keeps on this CPU.
"""

import json
import os
import sys

import numpy as np

# Spacing of float32 / bfloat16 at 1: 2^-23 and 2^-7 (8 significant bits).
F32_EPS = float(np.finfo(np.float32).eps)
BF16_EPS = 2.0**-7


def gamma(n, eps=F32_EPS):
  """gamma_n = n u / (1 - n u), u = eps / 2: relative bound of an n-term float sum."""
  nu = n * eps / 2
  return nu / (1 - nu)


def f32_atol(reference, ulps):
  """ulps float32 eps of the largest |reference|: an absolute tolerance."""
  return ulps * F32_EPS * float(np.max(np.abs(np.asarray(reference, np.float64))))


def matmul_atol(a, b, programs=1):
  """Elementwise bound on a float32 a @ b: gamma_K (|a| @ |b|), K the contracted size.

  Args:
    a, b: the operands (exactly representable in float32), [..., M, K] and [K, N].
    programs: 1 against an exact (float64) product, 2 between two float32 orders.

  Returns:
    float64 array of the product's shape.
  """
  a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
  return programs * gamma(a.shape[-1]) * (a @ b)


def chain_ulps(reduction_lengths):
  """sum of sqrt(n) over a chain of n-term float32 sums: their expected drift in eps."""
  return float(sum(np.sqrt(n) for n in reduction_lengths))


def transformer_reductions(cfg, seq_len):
  """Lengths of the float32 sums on the path from a token to a logit of gnmr_jax.model.

  Per layer: attention norm, q/k/v, scores, softmax sum, probs @ v, o; MLP norm,
  gate/up, down; each elementwise transcendental on the way (rsqrt twice, rope's
  sin/cos, exp, silu) counts as a 1-term sum. Then the final norm and the head.
  """
  d, f, head_dim = cfg.d_model, cfg.ffn_dim, cfg.d_model // cfg.num_heads
  per_layer = [d, 1, d, 1, head_dim, 1, seq_len, seq_len, d, d, 1, d, 1, f]
  return per_layer * cfg.num_layers + [d, 1, d]


def stack_reductions(num_layers, d_model, d_ff):
  """The same for gnmr_jax.precision.testing's residual MLP stack: h W_in, silu, . W_out."""
  return [d_model, 1, d_ff] * num_layers


def mean_square_atol(h, ulps):
  """Bound on |d mean(h^2)| when every h is within ulps eps max|h| (f32_atol).

  |d mean(h^2)| <= 2 mean|h| max|dh|, plus the mean's own sum of n non-negative
  terms, whose sum of |terms| is n mean(h^2): sqrt(n) eps of the result.
  """
  h = np.asarray(h, np.float64)
  return 2 * np.mean(np.abs(h)) * f32_atol(h, ulps) + f32_atol(np.mean(h * h),
                                                                chain_ulps([h.size]))


def _log(actual, desired, atol, rtol):
  path = os.environ.get('GNMR_TOLERANCE_LOG')
  if not path:
    return
  with np.errstate(invalid='ignore'):  # inf - inf: equal infinities count as agreeing
    diff = np.where(actual == desired, 0.0, np.abs(actual - desired))
  tol = atol + rtol * np.where(np.isfinite(desired), np.abs(desired), 0.0)
  ratio = np.where(tol > 0, diff / np.where(tol > 0, tol, 1), np.where(diff > 0, np.inf, 0))
  caller = sys._getframe(2)  # pylint: disable=protected-access
  with open(path, 'a', encoding='utf-8') as f:
    f.write(json.dumps({
        'test': os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0],
        'line': f'{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}',
        'worst_ratio': float(np.max(ratio, initial=0.0)),
        'max_abs_diff': float(np.max(diff, initial=0.0))}) + '\n')


def assert_allclose(actual, desired, *, atol=0.0, rtol=0.0, err_msg=''):
  """|actual - desired| <= atol + rtol |desired| elementwise; atol may be an array.

  Like np.testing.assert_allclose (NaNs must match, shapes broadcast), but with
  no default tolerance: every call states the one it derived.
  """
  actual = np.asarray(actual, np.float64)
  desired = np.asarray(desired, np.float64)
  atol = np.asarray(atol, np.float64)
  _log(actual, desired, atol, rtol)
  if np.ndim(atol) == 0:
    np.testing.assert_allclose(actual, desired, rtol=rtol, atol=float(atol), err_msg=err_msg)
    return
  actual, desired, atol = np.broadcast_arrays(actual, desired, atol)
  nan_mismatch = np.isnan(actual) != np.isnan(desired)
  bad = nan_mismatch | (np.abs(actual - desired) > atol + rtol * np.abs(desired))
  if bad.any():
    excess = np.where(bad, np.abs(actual - desired) - atol - rtol * np.abs(desired), -np.inf)
    worst = np.unravel_index(np.argmax(np.nan_to_num(excess, nan=np.inf)), excess.shape)
    raise AssertionError(
        f'{err_msg}\nNot equal to the elementwise tolerance: {int(bad.sum())} / {bad.size} '
        f'mismatched; worst at {tuple(int(i) for i in worst)}: actual {actual[worst]!r}, '
        f'desired {desired[worst]!r}, |diff| {abs(actual[worst] - desired[worst])!r} > '
        f'atol {atol[worst]!r} + rtol {rtol!r} * |desired|')
