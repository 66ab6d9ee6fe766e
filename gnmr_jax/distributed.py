"""Multi-host start-up: `jax.distributed.initialize` when the usual environment asks for it."""

from __future__ import annotations

import os

import jax

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def maybe_initialize() -> bool:
  """Initializes the JAX cluster if JAX_COORDINATOR_ADDRESS (with JAX_NUM_PROCESSES and
  JAX_PROCESS_ID) is set, or on a Cloud TPU pod / SLURM job where JAX detects the cluster itself
  (GNMR_JAX_DISTRIBUTED=1). Returns True when a cluster was initialized.

  On CPU the processes use gloo collectives.
  """
  coordinator = os.environ.get(ENV_COORDINATOR)
  if coordinator:
    missing = [v for v in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if v not in os.environ]
    if missing:
      raise ValueError(f"{ENV_COORDINATOR} is set but {missing} are not: set all three "
                       f"to start a multi-process run.")
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" or not _has_accelerator_hint():
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator,
                               num_processes=int(os.environ[ENV_NUM_PROCESSES]),
                               process_id=int(os.environ[ENV_PROCESS_ID]))
    return True
  if os.environ.get("GNMR_JAX_DISTRIBUTED") == "1":
    jax.distributed.initialize()
    return True
  return False


def _has_accelerator_hint() -> bool:
  return any(k in os.environ for k in ("CUDA_VISIBLE_DEVICES", "TPU_NAME", "TPU_WORKER_ID"))
