"""Shared timing helpers for the benchmark scripts (not for tests)."""

import time

import jax


def median_seconds(fn, *args, iters=10, warmup=2):
  """Median wall time of ``fn(*args)`` over ``iters`` calls after ``warmup`` calls."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return sorted(times)[len(times) // 2]


def compile_stats(jitted, *args):
  """(compiled executable, compile seconds, optimized HLO text size in bytes)."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  seconds = time.perf_counter() - start
  return compiled, seconds, len(compiled.as_text())


def temp_mib(compiled) -> float:
  """The compiled program's temp (scratch) memory in MiB, from XLA's memory analysis."""
  analysis = compiled.memory_analysis()
  return float('nan') if analysis is None else analysis.temp_size_in_bytes / 2**20


def interleaved_seconds(calls, rounds=5, iters=3):
  """Round-robin timing of several no-argument calls; per call the best round's median.

  Interleaving spreads background load over all variants instead of whichever ran
  last, and the best round discards rounds disturbed by other processes.

  Args:
    calls: dict label -> no-argument callable returning JAX arrays.
    rounds: passes over all calls.
    iters: timed calls per pass.

  Returns:
    dict label -> seconds.
  """
  for call in calls.values():
    jax.block_until_ready(call())
  best = {label: float('inf') for label in calls}
  for _ in range(rounds):
    for label, call in calls.items():
      best[label] = min(best[label], median_seconds(call, iters=iters, warmup=0))
  return best
