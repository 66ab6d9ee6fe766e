"""The versions a result was produced with: one function for reports, results and cache keys.

Example:
  >>> from gnmr_jax import versions
  >>> sorted(versions.versions(("jax", "optax")))
  ['jax', 'optax', 'python']
  >>> versions.describe({'python': '3.11.7', 'jax': '0.10.2'})
  'python 3.11.7, jax 0.10.2'
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from typing import Optional, Sequence

# What a training result depends on.
TRAINING = ("jax", "flax", "optax")
# What decides a compiled program (the deviceless compilers: aot/compile.py).
COMPILERS = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt",
             "nvidia-cuda-nvcc-cu12", "flax")


def package_versions(packages: Sequence[str]) -> dict:
  """{distribution: version} of those of ``packages`` that are installed, in that order."""
  out = {}
  for package in packages:
    try:
      out[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out


def git_commit(repo: str) -> str:
  """The short commit of the checkout at ``repo``, marked when it has uncommitted changes."""
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, check=True,
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                           check=True, capture_output=True, text=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return commit + (" (with uncommitted changes)" if dirty else "")


def machine() -> dict:
  """The CPU, its cores, and jax's backend and devices."""
  import jax  # pylint: disable=g-import-not-at-top
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
  except OSError:
    pass
  return {"cpu": cpu, "cores": os.cpu_count(), "backend": jax.default_backend(),
          "devices": [str(d) for d in jax.devices()]}


def versions(packages: Sequence[str] = TRAINING, *, python: bool = True,
             repo: Optional[str] = None, with_machine: bool = False) -> dict:
  """Python's version (``python``), the installed ``packages``' versions, the checkout's commit
  (``repo``: its path) and the machine (``with_machine``), in that order."""
  out = {"python": platform.python_version()} if python else {}
  out.update(package_versions(packages))
  if repo is not None:
    out["git"] = git_commit(repo)
  if with_machine:
    out.update(machine())
  return out


def describe(found: dict) -> str:
  """'name version, ...' of a versions() dict."""
  return ", ".join(f"{name} {version}" for name, version in found.items())
