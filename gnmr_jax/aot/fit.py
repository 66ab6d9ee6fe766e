"""The fastest way a config's global batch fits a target: micro-batch, accumulation and remat
chosen from compiled programs (``python -m gnmr_jax.aot --fit``).

For each remat policy, the train step is compiled at accumulation k = 1, 2, 4, ... of the global
batch (``train.grad_accum_steps``; the micro-batch ``batch_size / k`` must divide over the mesh's
batch axes). The next k tried is the smallest the compiled memory allows: the temporaries are
taken as proportional to the micro-batch, which under-estimates them (the float32 gradient sum
and the optimizer's temporaries do not shrink), so no smaller k that fits is skipped; a policy
stops at its first k that fits, as every larger k only adds per-micro-batch work (each
micro-batch re-reads the weights at a smaller GEMM), and when the first candidate (the smallest
k under the cheapest policy, 'none') fits, no other is compiled. Among the candidates that fit,
the fastest by the step-time model's tokens/s (``step_time.project``) is chosen; on a target
without a device spec, the one with the fewest micro-batches and then the least recomputation.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional, Sequence

import ml_collections

from gnmr_jax.aot import compile as compile_lib
from gnmr_jax.aot import targets as targets_lib

# A TPU compiler refusing a program says what it would need: libtpu 0.0.42 "the total memory
# required for HLO temporaries (134.16G) exceeds available HBM (15.75G)", older ones "Used
# 87.73G of 15.75G hbm".
_USED = re.compile(r'(?:temporaries \(|Used )([\d.]+)([KMGT]?)\)? (?:exceeds|of)')
_UNIT = {'': 1, 'K': 2 ** 10, 'M': 2 ** 20, 'G': 2 ** 30, 'T': 2 ** 40}

# Cheapest recomputation first: the order ties are broken in without a step-time model.
REMAT_POLICIES = ('none', 'dots_saveable', 'full')


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One compiled (accumulation, remat) combination at the config's global batch."""
  grad_accum_steps: int
  micro_batch: int
  remat: str
  fits: bool
  peak_bytes: Optional[int]      # None: XLA refused the program for memory
  temp_bytes: Optional[int]
  tokens_per_s: Optional[float]  # the step-time model's, per device; None without a spec
  compile_s: Optional[float]
  refused_bytes: Optional[int] = None  # what a refusing compiler said the program needs

  def overrides(self) -> list[str]:
    return [f'--config.train.grad_accum_steps={self.grad_accum_steps}',
            f'--config.model.remat={self.remat}']


def accumulation_choices(batch_size: int, batch_shards: int) -> list[int]:
  """Powers of two k dividing ``batch_size`` whose micro-batch divides over ``batch_shards``."""
  out, k = [], 1
  while k <= batch_size:
    if batch_size % k == 0 and (batch_size // k) % batch_shards == 0:
      out.append(k)
    k *= 2
  return out


def _variant(config, accum: int, remat: str) -> ml_collections.ConfigDict:
  variant = config.copy_and_resolve_references()
  variant.train.grad_accum_steps = accum
  variant.model.remat = remat
  return variant


def _candidate(report: dict, accum: int, remat: str, batch_size: int) -> Candidate:
  step = report['steps']['train']
  memory = step.get('memory') or {}
  projection = step.get('step_time') or {}
  used = _USED.search(step.get('error', ''))
  return Candidate(grad_accum_steps=accum, micro_batch=batch_size // accum, remat=remat,
                   fits=bool(step['fits']), peak_bytes=memory.get('peak_bytes'),
                   temp_bytes=memory.get('temp'),
                   tokens_per_s=projection.get('tokens_per_s'),
                   compile_s=step.get('compile_s'),
                   refused_bytes=(int(float(used.group(1)) * _UNIT[used.group(2)]) if used
                                  else None))


def _next_choice(choices: list[int], tried: Candidate, device_bytes: int) -> Optional[int]:
  """The smallest k in ``choices`` beyond ``tried`` that could fit, from its memory (temps
  proportional to the micro-batch: a lower bound on the k needed); None when none can."""
  larger = [k for k in choices if k > tried.grad_accum_steps]
  if not larger:
    return None
  if tried.peak_bytes is None:
    if tried.refused_bytes is None:  # refused without a figure: try the next k
      return larger[0]
    # Only the total is known: taking all of it as temporaries (nothing fixed) still bounds
    # the k needed from below, since the program does not fit.
    fixed, temp = 0, tried.refused_bytes
  else:
    fixed, temp = tried.peak_bytes - tried.temp_bytes, tried.temp_bytes
  room = device_bytes - fixed
  if room <= 0:  # params, optimizer state and program alone exceed the device
    return None
  needed = tried.grad_accum_steps * temp / room
  return next((k for k in larger if k >= needed), larger[-1])


def fit(config: ml_collections.ConfigDict, target: str,
        remats: Sequence[str] = REMAT_POLICIES, cache_dir: Optional[str] = None,
        log: Optional[Callable[[str], None]] = None) -> dict:
  """Compiles the candidates (see the module docstring) and chooses one.

  ``log``, when given, gets a line per candidate as it is compiled (a fit compiles several).

  Returns:
    {'target', 'global_batch', 'seq_len', 'device_memory_bytes', 'priced' (whether the target
    has a step-time model), 'candidates': [Candidate as dict, in compile order], 'chosen' (the
    chosen Candidate as dict, or None when nothing fits), 'overrides' (its config flags)}.
  """
  from gnmr_jax.model_configs import REMAT_POLICY_NAMES  # pylint: disable=g-import-not-at-top
  unknown = [r for r in remats if r not in REMAT_POLICY_NAMES]
  if unknown or not remats:
    raise ValueError(f'--fit_remat: {list(remats)} must be a non-empty list of '
                     f'{list(REMAT_POLICY_NAMES)}')
  target_obj = targets_lib.get_target(target)
  batch = int(config.data.batch_size)
  from gnmr_jax import sharding  # pylint: disable=g-import-not-at-top
  mesh_sizes = sharding.mesh_shape(config.mesh, target_obj.num_devices)
  choices = accumulation_choices(batch, mesh_sizes[0] * mesh_sizes[1])
  if not choices:
    raise ValueError(f'--fit: data.batch_size={batch} has no power-of-two split whose '
                     f'micro-batch divides over data * fsdp = {mesh_sizes[0] * mesh_sizes[1]}.')
  candidates = []
  for remat in remats:
    accum = choices[0]
    while accum is not None:
      report = compile_lib.compile_config(_variant(config, accum, remat), target_obj, ('train',),
                                          cache_dir=cache_dir, step_time=True)
      tried = _candidate(report, accum, remat, batch)
      candidates.append(tried)
      if log is not None:
        log(f'fit: accumulation {accum} x micro-batch {batch // accum}, remat {remat}: '
            f'{"fits" if tried.fits else "does not fit"} ({tried.compile_s} s to compile)')
      if tried.fits:
        break
      accum = _next_choice(choices, tried, target_obj.device_memory_bytes)
    if candidates[0].fits and candidates[0].remat == 'none':  # nothing can be faster
      break
  fitting = [c for c in candidates if c.fits]
  priced = bool(fitting) and all(c.tokens_per_s for c in fitting)
  if priced:
    chosen = max(fitting, key=lambda c: (c.tokens_per_s, -c.grad_accum_steps))
  else:  # no step-time model for this device: fewest micro-batches, then least recompute
    chosen = min(fitting, key=lambda c: (c.grad_accum_steps, remats.index(c.remat)),
                 default=None)
  return {'target': target_obj.name, 'global_batch': batch, 'seq_len': int(config.data.seq_len),
          'device_memory_bytes': target_obj.device_memory_bytes, 'priced': priced,
          'candidates': [dataclasses.asdict(c) for c in candidates],
          'chosen': dataclasses.asdict(chosen) if chosen else None,
          'overrides': chosen.overrides() if chosen else []}


def format_fit(result: dict) -> str:
  """The candidates as a table and the chosen combination, for the command line."""
  gb = 1e9
  lines = [f"fit: global batch {result['global_batch']} x {result['seq_len']} tokens on "
           f"{result['target']} ({result['device_memory_bytes'] / gb:.2f} GB per device)",
           '| accumulation | micro-batch | remat | peak GB | temporaries GB | fits | '
           'tokens/s per device (model) |', '|---|---|---|---|---|---|---|']
  for c in result['candidates']:
    if c['peak_bytes'] is not None:
      peak = f"{c['peak_bytes'] / gb:.2f}"
    elif c.get('refused_bytes'):
      peak = f"refused (needs {c['refused_bytes'] / gb:.2f})"
    else:
      peak = 'refused'
    temp = f"{c['temp_bytes'] / gb:.2f}" if c['temp_bytes'] is not None else '-'
    speed = f"{c['tokens_per_s']:,.0f}" if c['tokens_per_s'] else '-'
    lines.append(f"| {c['grad_accum_steps']} | {c['micro_batch']} | {c['remat']} | {peak} | "
                 f"{temp} | {'yes' if c['fits'] else 'no'} | {speed} |")
  chosen = result['chosen']
  if chosen is None:
    lines.append('nothing fits: not at the smallest micro-batch the mesh divides, under any '
                 'remat policy tried')
  else:
    why = ('the fastest by the step-time model' if result['priced'] else
           'no step-time model for this device: the fewest micro-batches, then the least '
           'recomputation')
    lines.append(f"chosen ({why}): accumulation {chosen['grad_accum_steps']} x micro-batch "
                 f"{chosen['micro_batch']}, remat {chosen['remat']}: "
                 + ' '.join(result['overrides']))
  return '\n'.join(lines)
