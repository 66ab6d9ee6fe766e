"""Scaling recipes of the int8 and fp8 paths: how their operands get their scales.

A table of typed entries (``Scaling``), read by the config's validation, the docs, and each
format's path builder (``builder``), which maps the configured recipe to that format's ``Path``.
A recipe is added with ``register_scaling`` and a path per format that supports it.

``'auto'`` is resolved once, where the policy is built for its devices (``resolved_config``, as
``microscaling_impl`` is), to the entry ``AUTO_BY_PLATFORM`` names for the low-cost path on that
platform, and recorded in the run's config.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax

from gnmr_jax.precision import path as path_lib

AUTO = 'auto'


@dataclasses.dataclass(frozen=True)
class Scaling:
  """One scaling recipe.

  Attributes:
    name: the value of the precision config's ``scaling`` field.
    doc: one line on what it scales and what it costs.
  """

  name: str
  doc: str


_SCALINGS: dict[str, Scaling] = {}


def register_scaling(entry: Scaling) -> Scaling:
  """Adds ``entry`` to the table (a name is registered once)."""
  if not isinstance(entry, Scaling) or not entry.name:
    raise ValueError(f'register_scaling takes a Scaling with a name, got {entry!r}.')
  if entry.name in _SCALINGS and _SCALINGS[entry.name] != entry:
    raise ValueError(f'scaling {entry.name!r} is already registered; registered: {names()}.')
  _SCALINGS[entry.name] = entry
  return entry


def names() -> tuple[str, ...]:
  """The registered recipes' names, in registration order."""
  return tuple(_SCALINGS)


def config_values() -> tuple[str, ...]:
  """What the precision config's ``scaling`` field may hold: a registered name or 'auto'."""
  return names() + (AUTO,)


# scaling='auto' per (low-cost path, platform); anything else resolves to 'row'. The table's
# reasons (BENCHMARKS.md "Scaling recipes", experiments/results/scaling_recipes/REPORT.md):
# on GPUs and TPUs the per-tensor recipes cost the least around their GEMMs; delayed scaling
# (fp8 only) lets each cast fuse into its producer. On a CPU nothing is faster either way, so
# the precise 'row' recipe stays.
AUTO_BY_PLATFORM = {('fp8', 'gpu'): 'delayed', ('int8', 'gpu'): 'tensor',
                    ('int8', 'tpu'): 'tensor'}


def resolve(value: str, low_cost_path: str, device=None) -> str:
  """The recipe ``value`` names for ``low_cost_path`` on ``device`` (default jax.devices()[0]):
  itself unless 'auto'."""
  if value != AUTO:
    return value
  platform = (device or jax.devices()[0]).platform
  platform = {'cuda': 'gpu', 'rocm': 'gpu'}.get(platform, platform)
  return AUTO_BY_PLATFORM.get((low_cost_path, platform), ROW.name)


def resolved_config(config, device=None):
  """``config`` (a precision ConfigDict) with ``scaling='auto'`` resolved for ``device``; else
  ``config`` itself."""
  if config.scaling != AUTO:
    return config
  resolved = config.copy_and_resolve_references()
  resolved.scaling = resolve(AUTO, config.low_cost_path, device)
  return resolved


def get(name: str) -> Scaling:
  """The entry named ``name``; ValueError listing the valid names otherwise."""
  if name not in _SCALINGS:
    raise ValueError(f'Unknown scaling {name!r}; valid: {names()}.')
  return _SCALINGS[name]


def builder(format_name: str, paths: Mapping[str, path_lib.Path]):
  """A path builder (registry.register_path) that picks ``paths[config.scaling]``.

  Args:
    format_name: the path's registered name, for the error of a recipe it lacks.
    paths: recipe name -> that recipe's ``Path`` for this format.

  Example:
    >>> import ml_collections
    >>> from gnmr_jax.precision import bf16
    >>> build = builder('doc', {'row': bf16.PATH})
    >>> build(ml_collections.ConfigDict({'scaling': 'row'}), 'low_cost') is bf16.PATH
    True
  """
  unknown = sorted(set(paths) - set(_SCALINGS))
  if unknown:
    raise ValueError(f'{format_name}: unregistered scalings {unknown}; registered: {names()}.')

  def build(config, role):
    del role
    get(config.scaling)
    if config.scaling not in paths:
      raise ValueError(f'the {format_name!r} path has no {config.scaling!r} scaling; it has '
                       f'{tuple(paths)}.')
    return paths[config.scaling]

  return build


ROW = register_scaling(Scaling(
    'row', 'one current absmax scale per row of each leg\'s lhs and per column of its rhs: the '
    'most precise; six operands quantized per unit and step, a float32 GEMM result rescaled'))
TENSOR = register_scaling(Scaling(
    'tensor', 'one current absmax scale per tensor: x, W and the output gradient quantized '
    'once per step, their codes shared by the legs; fp8: the scale folded into the GEMM'))
DELAYED = register_scaling(Scaling(
    'delayed', 'one scale per tensor from the unit\'s amax history (the precision config\'s '
    'amax_history_length steps, carried in the train state): the casts fuse into their '
    'producers; an amax jump past the history saturates for a step'))
