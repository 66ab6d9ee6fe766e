"""A small layer-stacked MLP for tests and benchmarks of routing and memory.

Mirrors how the model calls a policy: params stacked on a leading layer axis,
``lax.scan`` over layers, the per-layer recovery bit a scan input (never a
batched predicate), ``unroll`` as the model's scan would get it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gnmr_jax.precision import side_buffer
from gnmr_jax.precision.policy import PrecisionPolicy


def init_stack(key: jax.Array, num_layers: int, d_model: int, d_ff: int) -> dict:
  """float32 master params {'w_in': [L, D, F], 'w_out': [L, F, D]}."""
  k_in, k_out = jax.random.split(key)
  return {
      'w_in': jax.random.normal(k_in, (num_layers, d_model, d_ff)) / d_model ** 0.5,
      'w_out': jax.random.normal(k_out, (num_layers, d_ff, d_model)) / d_ff ** 0.5,
  }


def stack_apply(policy: PrecisionPolicy, params: dict, x_TxD: jax.Array,
                recovery_mask: jax.Array | None = None, unroll: int = 1,
                activation=jax.nn.silu) -> jax.Array:
  r"""Residual MLP stack :math:`h \leftarrow h + \mathrm{act}(h W_{in}) W_{out}`.

  Both matmuls of layer l use mask bit ``recovery_mask[l]``. A policy with a
  side buffer (``policy.init_side``) gets it threaded through the scan carry,
  as the model does.

  Args:
    policy: precision policy.
    params: from ``init_stack``.
    x_TxD: [T, D] input (its dtype is the carry's, e.g. bfloat16).
    recovery_mask: bool[L] or None (not recoverable).
    unroll: layers per scan iteration (``lax.scan``'s ``unroll``).
    activation: elementwise nonlinearity, or None for a linear stack.

  Returns:
    [T, D] output of ``x_TxD.dtype``.
  """
  num_layers = params['w_in'].shape[0]
  mask = (jnp.zeros((num_layers,), jnp.bool_) if recovery_mask is None
          else recovery_mask)
  act = activation or (lambda u: u)

  side = None
  if recovery_mask is not None:
    _, d_model, d_ff = params['w_in'].shape
    side = policy.init_side(x_TxD.shape[:-1], [(d_model, d_ff), (d_ff, d_model)],
                            x_TxD.dtype)

  def layer(carry, inputs):
    h, side = carry
    w_in, w_out, recover = inputs
    recover = None if recovery_mask is None else recover
    u, side = policy.dot_side(h, w_in, recover, side)
    v, side = policy.dot_side(act(u), w_out, recover, side)
    return ((h + v).astype(h.dtype), side), None

  (out, side), _ = lax.scan(layer, (x_TxD, side),
                            (params['w_in'], params['w_out'], mask), unroll=unroll)
  return side_buffer.attach(out, side)


def stack_loss(policy, params, x_TxD, recovery_mask=None, unroll=1,
               activation=jax.nn.silu) -> jax.Array:
  """Mean square of the stack output, float32 scalar."""
  out = stack_apply(policy, params, x_TxD, recovery_mask, unroll, activation)
  return jnp.mean(jnp.square(out.astype(jnp.float32)))


def register_cpu_scaled_matmul() -> None:
  """Lets ``jax.nn.scaled_matmul`` run on the CPU: dequantize, then a float32 dot.

  jax lowers the block-scaled GEMM for CUDA and ROCm only. Registered for the CPU, it
  computes the GEMM's definition (``jax.nn.scaled_matmul``'s docstring): each code times its
  block's scale, in float32, contracted in float32 at ``Precision.HIGHEST``. Everything else
  of a native program (the quantizers, ``jax.nn.scaled_dot_general``'s own quantize and
  backward, the transposes) then runs as it is, so its numerics can be compared on this host
  with the emulation's. For tests and numerics studies only; idempotent.

  Raises:
    RuntimeError: this jax's ``scaled_matmul`` binds no primitive of the expected name.
  """
  global _CPU_SCALED_MATMUL
  if _CPU_SCALED_MATMUL:
    return
  from jax.interpreters import mlir  # pylint: disable=g-import-not-at-top

  def operand(dtype, k):
    return jax.ShapeDtypeStruct((1, 1, k), dtype)
  # The primitive jax.nn.scaled_matmul binds, found in its jaxpr (it has no public name).
  jaxpr = jax.make_jaxpr(jax.nn.scaled_matmul)(
      operand(jnp.float8_e4m3fn, 32), operand(jnp.float8_e4m3fn, 32),
      operand(jnp.float8_e8m0fnu, 1), operand(jnp.float8_e8m0fnu, 1))
  primitive = _find_primitive(jaxpr.jaxpr, _SCALED_MATMUL_PRIMITIVE)
  if primitive is None:
    raise RuntimeError(f'jax {jax.__version__}: jax.nn.scaled_matmul binds no '
                       f'{_SCALED_MATMUL_PRIMITIVE!r} primitive')

  def reference(a, b, a_scales, b_scales, *, preferred_element_type):
    def dequantized(codes, scales):  # [B, R, K] x [B, R, K / block]
      block = codes.shape[-1] // scales.shape[-1]
      return codes.astype(jnp.float32) * jnp.repeat(scales.astype(jnp.float32), block, -1)
    out = jnp.einsum('bmk,bnk->bmn', dequantized(a, a_scales), dequantized(b, b_scales),
                     precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return [out.astype(preferred_element_type)]

  # A platform's own rule takes precedence over the primitive's default (custom partitioning).
  mlir.register_lowering(primitive, mlir.lower_fun(reference, multiple_results=True),
                         platform='cpu')
  _CPU_SCALED_MATMUL = True


def _find_primitive(jaxpr, name):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == name:
      return eqn.primitive
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        inner = getattr(sub, 'jaxpr', sub)
        if hasattr(inner, 'eqns'):
          found = _find_primitive(inner, name)
          if found is not None:
            return found
  return None


_SCALED_MATMUL_PRIMITIVE = 'scaled_matmul_wrapper'
_CPU_SCALED_MATMUL = False
