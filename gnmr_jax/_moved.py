"""Old module paths kept working: each re-exports its public names from their new home, and a
name that no longer exists there fails with an AttributeError naming its replacement."""

from __future__ import annotations


def missing(old_module: str, replacements: dict):
  """A module ``__getattr__`` for ``old_module`` whose removed names map to ``replacements``."""

  def __getattr__(name):  # pylint: disable=invalid-name
    if name in replacements:
      raise AttributeError(f"{old_module}.{name} was removed when the controller moved to "
                           f"gnmr_jax.control; use {replacements[name]}.")
    raise AttributeError(f"module {old_module!r} has no attribute {name!r}")

  return __getattr__
