r"""LoRA fine-tuning of the projection kernels over frozen (optionally INT8) base weights.

Each of the seven projection kernels W [L, K, N] of a pretrained model gets a rank-r
adapter (A [L, K, r], B [L, r, N]); the model runs with the merged kernel

  W_eff = W_base + (lora_alpha / r) * A @ B

through its precision policy, so a static int8 policy quantizes W_eff per channel
in every matmul (INT8 compute over INT8-stored base weights), and a routed policy
runs the recovered units in bf16. The train step differentiates the loss with
respect to W_eff (one gradient per projection, exactly what GNMR watches: its units
and recovery mask are the same as in pretraining) and maps it to the adapters by
the chain rule, dA = s dW B^T and dB = s A^T dW; only A and B are updated.

``quantize_base_int8`` stores the frozen base projection kernels as int8 with one
absmax scale per output channel (returned dequantized, float32), the INT8 base
weights of the paper's LoRA scenario.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gnmr_jax.control.state import controller_state
from gnmr_jax.control.units import path_to_str
from gnmr_jax.model import PROJECTION_UNITS_REGEX

_PROJECTION = re.compile(PROJECTION_UNITS_REGEX)


def is_projection(path: str) -> bool:
  return _PROJECTION.search(path) is not None


def _map_projections(fn, tree, *rest):
  def visit(path, leaf, *others):
    return fn(leaf, *others) if is_projection(path_to_str(path)) else leaf
  return jax.tree_util.tree_map_with_path(visit, tree, *rest)


def quantize_base_int8(params) -> Any:
  r"""Projection kernels -> int8 codes with a per-output-channel absmax scale, dequantized.

  For W [L, K, N]: :math:`s_{l,n} = \max_k |W_{lkn}| / 127`,
  :math:`\hat W = s\,\mathrm{round}(W / s)`. Other leaves are returned unchanged.
  """
  def q(w):
    scale = jnp.max(jnp.abs(w), axis=-2, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return codes.astype(jnp.float32) * scale
  return _map_projections(q, params)


class Adapter(NamedTuple):
  a: jax.Array  # float32 [L, K, r]
  b: jax.Array  # float32 [L, r, N]


def init_adapters(params, rank: int, key: jax.Array) -> dict:
  """{projection path: Adapter}; A ~ N(0, 1/K) (LoRA's Gaussian init), B = 0."""
  if rank < 1:
    raise ValueError(f"lora: rank must be >= 1, got {rank!r}.")
  adapters = {}
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  for i, (path, leaf) in enumerate(leaves):
    name = path_to_str(path)
    if is_projection(name):
      layers, k, n = leaf.shape
      a = jax.random.normal(jax.random.fold_in(key, i), (layers, k, rank)) / jnp.sqrt(k)
      adapters[name] = Adapter(a.astype(jnp.float32), jnp.zeros((layers, rank, n), jnp.float32))
  if not adapters:
    raise ValueError("lora: no projection kernel found in params.")
  return adapters


def merge(base, adapters: dict, scale: float):
  """The params with every projection kernel replaced by W_base + scale * A @ B."""
  def visit(path, leaf):
    name = path_to_str(path)
    if name in adapters:
      ad = adapters[name]
      return leaf + scale * jnp.einsum("lkr,lrn->lkn", ad.a, ad.b)
    return leaf
  return jax.tree_util.tree_map_with_path(visit, base)


def adapter_grads(kernel_grads, adapters: dict, scale: float) -> dict:
  """Chain rule from dL/dW_eff to the adapters: dA = s dW B^T, dB = s A^T dW."""
  out = {}
  flat = {path_to_str(p): g for p, g in jax.tree_util.tree_flatten_with_path(kernel_grads)[0]}
  for name, ad in adapters.items():
    g = flat[name]
    out[name] = Adapter(scale * jnp.einsum("lkn,lrn->lkr", g, ad.b),
                        scale * jnp.einsum("lkr,lkn->lrn", ad.a, g))
  return out


class LoraState(NamedTuple):
  step: jax.Array      # int32 []
  adapters: dict       # {path: Adapter}
  opt_state: Any       # optax state of the adapters
  ctl_state: Any       # optax state holding the GNMRState (kernel-gradient telemetry/mask)


def _lora_step(model, base_params, controller, optimizer, scale: float, routed: bool,
               state: LoraState, batch):
  """One LoRA step: (new state, core metrics, the GNMRState read, the GNMRState after)."""
  ctl = controller_state(state.ctl_state)
  mask = ctl.mask if routed else None
  merged = merge(base_params, state.adapters, scale)

  def loss_fn(params):
    # The model's fused head and loss (float32 [B, S, V] logits never exist): sum / tokens.
    total = model.apply({"params": params}, batch["inputs"], recovery_mask=mask,
                        targets=batch["targets"])
    return total / batch["targets"].size

  loss, grads = jax.value_and_grad(loss_fn)(merged)
  _, ctl_state = controller.update(grads, state.ctl_state, merged)
  g_adapters = adapter_grads(grads, state.adapters, scale)
  updates, opt_state = optimizer.update(g_adapters, state.opt_state, state.adapters)
  adapters = optax.apply_updates(state.adapters, updates)
  new_ctl = controller_state(ctl_state)
  metrics = {"loss": loss, "grad_norm": optax.tree.norm(g_adapters),
             "nonfinite": ~jnp.isfinite(loss)}
  return LoraState(state.step + 1, adapters, opt_state, ctl_state), metrics, ctl, new_ctl


def make_lora_step(model, base_params, controller: optax.GradientTransformation,
                   optimizer: optax.GradientTransformation, scale: float, routed: bool):
  """(state, batch) -> (state, metrics, (mask used, GNMRState after)): one LoRA step over frozen
  ``base_params`` (:class:`LoraTask` runs the same step in gnmr_jax.train_loop's loop).

  The controller sees the merged-kernel gradients of every param (non-projection
  leaves get zero gradients: they are frozen); its mask routes the next step when
  ``routed``.
  """

  def step_fn(state: LoraState, batch):
    state, metrics, ctl, new_ctl = _lora_step(model, base_params, controller, optimizer, scale,
                                              routed, state, batch)
    tel = new_ctl.telemetry
    metrics.update(num_units=tel.num_units, num_risky=tel.num_risky, num_active=tel.num_active,
                   active_unit_steps=tel.active_unit_steps,
                   risky_unit_steps=tel.risky_unit_steps)
    return state, metrics, (ctl.mask, new_ctl)

  return step_fn


def make_eval_fn(model, base_params, scale: float, routed: bool):
  """(state, batch) -> (sum of token losses, token count), with the current mask."""
  def eval_fn(state: LoraState, batch):
    mask = controller_state(state.ctl_state).mask if routed else None
    merged = merge(base_params, state.adapters, scale)
    return _loss_sum_and_count(model, merged, batch, mask)
  return eval_fn


def _loss_sum_and_count(model, params, batch, mask):
  """(sum of the batch's token cross-entropies, token count as float32), through the model's
  fused head and loss."""
  total = model.apply({"params": params}, batch["inputs"], recovery_mask=mask,
                      targets=batch["targets"])
  return total, jnp.float32(batch["targets"].size)


def make_sequence_logprob_fn(model, base_params, scale: float, routed: bool):
  """(state, tokens [B, S], weights [B, S]) -> sum over s of weights * log p(tokens[s+1] | <= s).

  ``weights[b, s]`` selects which next-token predictions count (the candidate's bytes
  in a cloze item).
  """
  def fn(state: LoraState, tokens, weights):
    mask = controller_state(state.ctl_state).mask if routed else None
    merged = merge(base_params, state.adapters, scale)
    # Per-row sums need per-token values, which the model's fused loss (targets=) does not
    # return, so this forward-only scoring pass still materialises float32 [B, S, V] logits.
    logits = model.apply({"params": merged}, tokens[:, :-1], recovery_mask=mask)
    logp = -optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(logp * weights[:, 1:], axis=1)
  return fn


@dataclasses.dataclass(frozen=True, eq=False)
class LoraTask:
  """LoRA fine-tuning as a task of ``gnmr_jax.train_loop.train_and_evaluate(..., task=)``.

  The loop, its logs, checkpoints (the :class:`LoraState`), evaluation and summary are the
  pretraining ones; the state holds the adapters, their optimizer's state and the controller's
  (which watches the merged-kernel gradients, the units of pretraining). The model and its
  precision policy come from the run's config (``build``); the controller of ``config.gnmr``
  is ``controller``, and ``optimizer`` updates the adapters.

  Attributes:
    base_params: the frozen base params (e.g. :func:`quantize_base_int8` of a pretrained model).
    rank: the adapters' rank.
    scale: lora_alpha / rank.
    optimizer: the adapters' optax transform.
    controller: the recovery controller (``gnmr_jax.control.from_config(config.gnmr)``).
    adapter_seed: seeds the adapters' A init.
    summary_fn: optional ``(run, state, final) -> dict`` of extra summary fields, called before
      the first step of a fresh run (final=False) and after the last (final=True).
  """
  base_params: Any
  rank: int
  scale: float
  optimizer: optax.GradientTransformation
  controller: optax.GradientTransformation
  adapter_seed: int = 0
  summary_fn: Any = None

  def init_state(self, rng, *, spec) -> LoraState:
    del rng, spec  # the adapters have their own seed; the base params are given
    adapters = init_adapters(self.base_params, self.rank, jax.random.key(self.adapter_seed))
    return LoraState(jnp.zeros((), jnp.int32), adapters, self.optimizer.init(adapters),
                     self.controller.init(self.base_params))

  def train_step(self, state: LoraState, batch, *, spec):
    from gnmr_jax import train_step as step_lib  # pylint: disable=g-import-not-at-top
    state, metrics, ctl, new_ctl = _lora_step(spec.model, self.base_params, self.controller,
                                              self.optimizer, self.scale, spec.routed, state,
                                              batch)
    metrics.update(learning_rate=spec.schedule(state.step - 1),
                   side_buffer_dropped=jnp.zeros((), jnp.int32),
                   **step_lib.controller_metrics(spec.layout, ctl, new_ctl))
    return state, metrics

  def eval_step(self, state: LoraState, batch, *, spec):
    mask = controller_state(state.ctl_state).mask if spec.routed else None
    merged = merge(self.base_params, state.adapters, self.scale)
    return _loss_sum_and_count(spec.model, merged, batch, mask)

  def trainable(self, state: LoraState):
    return state.adapters

  def summary_fields(self, run, state, *, final: bool) -> dict:
    return self.summary_fn(run, state, final) if self.summary_fn is not None else {}
