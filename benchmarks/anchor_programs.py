"""The programs timed on the lent H200 (../shared/reference/gpu-anchors.md), rebuilt for compiling.

Source: ../shared/reference/probes/gpu_anchor.py (raw GEMMs; the 16-layer stack's bf16 and int8
steps, int8 routed by a per-layer ``lax.cond`` in the scan) and probes/gpu_route2.py (the fp8
low-cost layer: e4m3 forward, e5m2 gradients, fp8 operands; designs A static, B ``lax.cond`` per
matmul in the scan, D per matmul unrolled, E one cond per layer in the scan). The functions below
are those scripts' functions, unchanged but for names; MEASURED holds what they measured (ms,
median of 10-20 timed calls, H200, jax 0.11.2, 2026-11-29).

Each entry of `programs()` is (jitted function, abstract arguments): compile it deviceless with
gnmr_jax.aot.compile.compile_step for the 'h200' target (benchmarks/aot_step_time.py does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

L, T, D, F = 16, 8192, 2048, 5632  # layers, tokens, model width, MLP width
DN = (((1,), (0,)), ((), ()))

# name -> measured ms on the H200 (gpu-anchors.md); 'mask2' = layers 3 and 11 recovered.
MEASURED = {
    'gemm_bf16_8192x8192x8192': 2 * 8192 ** 3 / 595e12 * 1e3,
    'gemm_fp8_8192x8192x8192': 2 * 8192 ** 3 / 778e12 * 1e3,
    'gemm_int8_8192x8192x8192': 2 * 8192 ** 3 / 756e12 * 1e3,
    'gemm_bf16_16384x4096x11008': 2 * 16384 * 4096 * 11008 / 633e12 * 1e3,
    'gemm_fp8_16384x4096x11008': 2 * 16384 * 4096 * 11008 / 977e12 * 1e3,
    'gemm_int8_16384x4096x11008': 2 * 16384 * 4096 * 11008 / 954e12 * 1e3,
    'stack_bf16_static': 66.4,
    'stack_int8_static': 43.8,
    'stack_int8_cond_scan': 50.1,          # a cond per matmul, layers in the scan
    'stack_int8_cond_scan_mask2': 52.3,
    'stack_fp8_static': 34.6,              # gpu_route2 A
    'stack_fp8_cond_scan': 41.0,           # gpu_route2 B
    'stack_fp8_cond_scan_mask2': 44.7,
    'stack_fp8_cond_unrolled': 34.7,       # gpu_route2 D
    'stack_fp8_cond_unrolled_mask2': 37.8,
    'stack_fp8_cond_layer_scan': 41.1,     # gpu_route2 E
    'stack_fp8_cond_layer_scan_mask2': 44.9,
}
GEMM_SHAPES = ((8192, 8192, 8192), (16384, 4096, 11008))


# --- probes/gpu_anchor.py -------------------------------------------------------------------
def _q_int8(x, axis):
  s = jnp.max(jnp.abs(x), axis=axis, keepdims=True).astype(jnp.float32) / 127.0 + 1e-12
  return jnp.clip(jnp.round(x.astype(jnp.float32) / s), -127, 127).astype(jnp.int8), s


def _mm_int8(x, w):
  xq, sx = _q_int8(x, 1)
  wq, sw = _q_int8(w, 0)
  y = lax.dot_general(xq, wq, DN, preferred_element_type=jnp.int32)
  return (y.astype(jnp.float32) * sx * sw).astype(jnp.bfloat16)


@jax.custom_vjp
def dense_int8(x, w):
  return _mm_int8(x, w)


dense_int8.defvjp(lambda x, w: (_mm_int8(x, w), (x, w)),
                  lambda res, g: (_mm_int8(g, res[1].T), _mm_int8(res[0].T, g)))


def dense_bf16(x, w):
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


# --- probes/gpu_route2.py -------------------------------------------------------------------
def _q(x, axis, dtype, qmax):
  s = jnp.max(jnp.abs(x), axis=axis, keepdims=True).astype(jnp.float32) / qmax + 1e-12
  y = x.astype(jnp.float32) / s
  if dtype == jnp.int8:
    y = jnp.clip(jnp.round(y), -127, 127)
  return y.astype(dtype), s


def _mm_lp(x, w, dx, dw, qx, qw, out):
  xq, sx = _q(x, 1, dx, qx)
  wq, sw = _q(w, 0, dw, qw)
  return (lax.dot_general(xq, wq, DN, preferred_element_type=out).astype(jnp.float32)
          * sx * sw).astype(jnp.bfloat16)


def _make_dense(fwd, bwd):
  @jax.custom_vjp
  def dense(x, w):
    return fwd(x, w)
  dense.defvjp(lambda x, w: (fwd(x, w), (x, w)),
               lambda res, g: (bwd(g, res[1].T), bwd(res[0].T, g)))
  return dense


dense_fp8 = _make_dense(
    lambda x, w: _mm_lp(x, w, jnp.float8_e4m3fn, jnp.float8_e4m3fn, 448., 448., jnp.float32),
    lambda x, w: _mm_lp(x, w, jnp.float8_e5m2, jnp.float8_e4m3fn, 57344., 448., jnp.float32))


def _mlp(f1, f2, x, w1, w2):
  return (x + f2(jax.nn.silu(f1(x, w1)), w2)).astype(jnp.bfloat16)


def _routed(low):
  return lambda a, b, m: lax.cond(m, dense_bf16, low, a, b)


def _layer(kind, low):
  """A scan body: 'static' (low-cost matmuls), 'bf16', 'cond' (a cond per matmul), 'cond_layer'
  (one cond around the layer)."""
  def layer(x, inp):
    w1, w2, m = inp
    if kind == 'static':
      return _mlp(low, low, x, w1, w2), None
    if kind == 'bf16':
      return _mlp(dense_bf16, dense_bf16, x, w1, w2), None
    if kind == 'cond':
      return _mlp(lambda a, b: _routed(low)(a, b, m), lambda a, b: _routed(low)(a, b, m),
                  x, w1, w2), None
    return lax.cond(m, lambda x: _mlp(dense_bf16, dense_bf16, x, w1, w2),
                    lambda x: _mlp(low, low, x, w1, w2), x), None
  return layer


def _loss_scan(body):
  def loss(ws, x, mask):
    y, _ = lax.scan(body, x, (ws[0], ws[1], mask))
    return jnp.mean(jnp.square(y.astype(jnp.float32)))
  return loss


def _loss_unrolled(low):
  body = _layer('cond', low)

  def loss(ws, x, mask):
    for i in range(L):
      x, _ = body(x, (ws[0][i], ws[1][i], mask[i]))
    return jnp.mean(jnp.square(x.astype(jnp.float32)))
  return loss


def _gemm(dtype, out):
  return jax.jit(lambda a, b: lax.dot_general(a, b, DN, preferred_element_type=out))


def programs(sharding=None) -> dict:
  """name -> (jitted function, abstract args); `sharding` is put on every argument."""
  def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  out = {}
  for m, k, n in GEMM_SHAPES:
    size = f'{m}x{k}x{n}'
    # bf16: probes' jnp.dot(preferred f32).astype(bf16)
    out[f'gemm_bf16_{size}'] = (
        jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(
            jnp.bfloat16)), (spec((m, k), jnp.bfloat16), spec((k, n), jnp.bfloat16)))
    out[f'gemm_fp8_{size}'] = (_gemm(jnp.float8_e4m3fn, jnp.bfloat16),
                               (spec((m, k), jnp.float8_e4m3fn), spec((k, n), jnp.float8_e4m3fn)))
    out[f'gemm_int8_{size}'] = (_gemm(jnp.int8, jnp.int32),
                                (spec((m, k), jnp.int8), spec((k, n), jnp.int8)))
  stack_args = ((spec((L, D, F), jnp.bfloat16), spec((L, F, D), jnp.bfloat16)),
                spec((T, D), jnp.bfloat16), spec((L,), jnp.bool_))

  def step(loss):
    return jax.jit(jax.value_and_grad(loss)), stack_args

  out['stack_bf16_static'] = step(_loss_scan(_layer('bf16', None)))
  out['stack_int8_static'] = step(_loss_scan(_layer('static', dense_int8)))
  out['stack_int8_cond_scan'] = step(_loss_scan(_layer('cond', dense_int8)))
  out['stack_fp8_static'] = step(_loss_scan(_layer('static', dense_fp8)))
  out['stack_fp8_cond_scan'] = step(_loss_scan(_layer('cond', dense_fp8)))
  out['stack_fp8_cond_unrolled'] = step(_loss_unrolled(dense_fp8))
  out['stack_fp8_cond_layer_scan'] = step(_loss_scan(_layer('cond_layer', dense_fp8)))
  return out
