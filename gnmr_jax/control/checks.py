"""Argument checks shared by the controllers and the clipping transforms (before any tracing).

Each check raises a ValueError that names the argument (prefixed with the transform's
name) and the allowed values.
"""

from __future__ import annotations

import numbers
import re

import jax
import jax.numpy as jnp
import numpy as np

STATIC_HINT = ("it sets shapes or Python control flow, so keep it static, e.g. "
               "optax.inject_hyperparams(gnmr_jax.gnmr, "
               "static_args=('delta', 'max_o', 't_lock', 'warmup'))")


def check_int(name: str, value, minimum: int, hint: str = "") -> None:
  """A Python integer >= minimum (not a bool, not an array). ``name`` is e.g. 'gnmr: `max_o`'."""
  if hint and isinstance(value, (jax.Array, np.ndarray)):
    raise ValueError(f"{name} must be a Python integer >= {minimum}, got an array "
                     f"{value!r}; {hint}.")
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


def check_regex(name: str, value, expected: str = "a regex string") -> None:
  """A string that compiles as a regex; ``expected`` describes it in the message."""
  if not isinstance(value, str):
    raise ValueError(f"{name} must be {expected}, got {value!r}.")
  try:
    re.compile(value)
  except re.error as e:
    raise ValueError(f"{name} is not a valid regex ({value!r}: {e}).") from None


def check_positive(name: str, value) -> None:
  """A finite Python real > 0."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
      0.0 < value < float("inf")):
    raise ValueError(f"{name} must be a finite float > 0, got {value!r}.")


def check_fraction(name: str, value) -> None:
  """A Python real in [0, 1)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
    raise ValueError(f"{name} must be a float in [0, 1), got {value!r}.")


def check_positive_or_schedule(name: str, value) -> None:
  """A float > 0, a jax/numpy real scalar > 0, a schedule, or a traced scalar.

  Values are checked, not types, so ``optax.inject_hyperparams`` can hand in its float32
  arrays; a traced one (its update under jit) cannot be checked.
  """
  if callable(value):
    return
  dtype = getattr(value, "dtype", None)
  is_number = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
  is_array = (dtype is not None and jnp.shape(value) == () and
              (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)))
  if not (is_number or is_array):
    raise ValueError(f"{name} must be a positive float (or a jax/numpy real scalar) "
                     f"or an optax schedule, got {value!r}.")
  try:
    concrete = float(value)
  except jax.errors.ConcretizationTypeError:
    return  # traced: checked at init, where inject_hyperparams passes concrete values
  if not 0 < concrete < float("inf"):
    raise ValueError(f"{name} must be a finite value > 0, got {value!r}.")
