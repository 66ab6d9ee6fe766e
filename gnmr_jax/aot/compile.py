"""Compiles a config's train and eval steps for a named accelerator, with no accelerator.

XLA compiles for a TPU topology through libtpu and for a GPU described by a target-config text
through the CUDA PJRT plugin, both on a CPU host (the ``aot`` extra installs them). The step is
built exactly as training builds it (``train_loop.build`` on a mesh of the topology's devices,
from ``config.mesh``), traced on abstract inputs and compiled; the executable cannot run, but
its memory analysis and optimized HLO are the program the device would run.

Example (needs the aot extra; tests/aot runs it):
  >>> report = compile_config(config, 'h100')                     # doctest: +SKIP
  >>> report['steps']['train']['memory']['peak_bytes']             # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections

from gnmr_jax.aot import device_specs
from gnmr_jax.aot import inventory as inventory_lib
from gnmr_jax.aot import program_cache
from gnmr_jax.aot import step_time as step_time_lib
from gnmr_jax.aot import targets as targets_lib
from gnmr_jax import versions as versions_lib

INSTALL_HINT = ("make aot-venv (builds .venv-aot beside .venv; run the tool with "
                ".venv-aot/bin/python -m gnmr_jax.aot), or pip install 'gnmr_jax[aot]' in an "
                "environment of its own")
# Autotuning needs a device; Triton would take the fp8 dots that cuBLASLt runs.
GPU_COMPILER_OPTIONS = {'xla_gpu_autotune_level': 0, 'xla_gpu_enable_triton_gemm': False}
STEPS = ('train', 'eval')
_OOM = re.compile(r'RESOURCE_EXHAUSTED|[Rr]an out of memory|exceeds.*memory|Out of memory')


class AotSetupError(RuntimeError):
  """The compilers for a target are not installed."""


class DoesNotFit(RuntimeError):
  """XLA refused to compile a step because it does not fit the device's memory (TPU)."""


def prepare_environment() -> None:
  """Keeps jax on the CPU and libtpu off the metadata server; call before jax starts a backend.

  With libtpu installed, a jax that looks for a TPU prints initialisation errors and starts
  slower; compile-only topologies need no backend but the CPU.
  """
  os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
  # libtpu takes a lock per machine; compile-only processes may share it (xdist workers, a
  # tool started from a notebook that holds one).
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  jax.config.update('jax_platforms', os.environ['JAX_PLATFORMS'])


def check_install(platform: str) -> None:
  """Raises AotSetupError naming the install command when `platform`'s compiler is missing."""
  if platform == 'tpu':
    missing = [] if importlib.util.find_spec('libtpu') else ['libtpu']
  else:
    missing = [name for name, module in (('jax-cuda12-plugin', 'jax_plugins.xla_cuda12'),
                                         ('nvidia-cuda-nvcc-cu12', 'nvidia.cuda_nvcc'))
               if _find_spec(module) is None]
  if missing:
    raise AotSetupError(f'compiling for a {platform.upper()} needs {", ".join(missing)} in this '
                        f'Python environment; install: {INSTALL_HINT}')


def _find_spec(module: str):
  try:
    return importlib.util.find_spec(module)
  except ModuleNotFoundError:
    return None


def topology_devices(target: targets_lib.Target) -> list:
  """The compile-only devices of `target` (they describe the hardware; none can run)."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  check_install(target.platform)
  if target.platform == 'gpu':
    topology = topologies.get_topology_desc(
        platform='cuda', target_config=target.gpu_config, topology=target.gpu_topology)
  else:
    topology = topologies.get_topology_desc(
        platform='tpu', topology_name=target.topology_name,
        chip_config_name=target.chip_config_name,
        chips_per_host_bounds=target.chips_per_host_bounds, num_slices=target.num_slices,
        wrap=target.wrap)
  return list(topology.devices)


class _AbstractData:
  """What `train_loop.build` reads of the data: its vocabulary size (no corpus is read)."""

  def __init__(self, data_config: ml_collections.ConfigDict):
    if data_config.tokenizer == 'bytes':
      from gnmr_jax.data.tokenizers import ByteTokenizer  # pylint: disable=g-import-not-at-top
      self.vocab_size = ByteTokenizer.vocab_size
    else:
      self.vocab_size = int(data_config.vocab_size)


def build_abstract(config: ml_collections.ConfigDict, devices: Sequence[Any]):
  """(run, abstract state, abstract batch) of `config` on a mesh of `devices`.

  Raises:
    ValueError: the config is invalid or config.mesh does not fit the devices.
  """
  from gnmr_jax import sharding, train_loop  # pylint: disable=g-import-not-at-top
  try:
    mesh = sharding.make_mesh(config.mesh, devices)
  except ValueError as e:
    raise ValueError(f'config.mesh does not fit the target\'s {len(devices)} devices: {e}; '
                     f'set --config.mesh.* (e.g. --config.mesh.fsdp=-1)') from e
  run = train_loop.build(config, data=_AbstractData(config.data), mesh=mesh)
  state = run.abstract_state  # with the state's shardings
  shape = (config.data.batch_size, config.data.seq_len)
  batch = {name: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=run.batch_sharding)
           for name in ('inputs', 'targets')}
  return run, state, batch


def memory_of(compiled) -> dict:
  """Per-device bytes from XLA's memory analysis, and the peak they add up to.

  peak = arguments + outputs - aliased (donated) + temporaries + generated code.
  """
  stats = compiled.memory_analysis()
  memory = {field: int(getattr(stats, f'{field}_size_in_bytes', 0) or 0)
            for field in ('argument', 'output', 'alias', 'temp', 'generated_code')}
  memory['peak_bytes'] = (memory['argument'] + memory['output'] - memory['alias']
                          + memory['temp'] + memory['generated_code'])
  return memory


def summarize(hlo_text: str) -> dict:
  """The JSON-able inventory of a compiled program's HLO text."""
  inventory = inventory_lib.parse(hlo_text)
  return {
      'gemms': inventory.gemm_counts(),
      # A routed step with nothing recovered (conditionals on branch 0), per device.
      'gemm_flops': inventory.flops_by_kind(),
      'projection_gemm_flops': inventory.flops_by_kind(projection=True),
      'conditionals': len(inventory.conditionals),
      'loops': {name: trips for name, trips in sorted(inventory.loops.items())},
      'collectives': inventory.collective_summary(),
      'hlo_instructions': len(inventory.instructions),
  }


def project_step_time(hlo_text: str, report: dict, model_config) -> dict:
  """The train step's projection on the report's target (step_time.project), or {'error'}.

  Tokens per device: batch_size * seq_len / num_devices; model FLOPs: step_time.
  model_flops_per_token over the model's weights less the embedding table.
  """
  from gnmr_jax import model_configs  # pylint: disable=g-import-not-at-top
  try:
    spec = device_specs.get_spec(report['target'])
  except ValueError as e:
    return {'error': str(e)}
  tokens = report['batch_size'] * report['seq_len'] / report['num_devices']
  d_model, heads = int(model_config.d_model), int(model_config.num_heads)
  per_token = step_time_lib.model_flops_per_token(
      model_configs.param_count(model_config) - int(model_config.vocab_size) * d_model,
      int(model_config.num_layers), heads, d_model // heads, report['seq_len'])
  kernels = step_time_lib.summarize(inventory_lib.parse(hlo_text))
  precision = report['precision']
  return step_time_lib.project(kernels, spec, tokens=tokens, model_flops=per_token * tokens,
                               path=precision['low_cost_path'], mode=precision['mode'])


def source_roots() -> tuple[str, ...]:
  """The directories holding jax's and gnmr_jax's packages (the checkout, the venv)."""
  import gnmr_jax  # pylint: disable=g-import-not-at-top
  packages = (jax, gnmr_jax)
  return tuple(sorted({os.path.dirname(os.path.dirname(os.path.abspath(p.__file__)))
                       for p in packages}, key=len, reverse=True))


def lower_step(jitted, args, mesh):
  """`jitted` lowered on abstract `args` under `mesh`, its source locations relative to
  `source_roots()`.

  Pallas kernels (splash attention on TPU) carry their Mosaic body as bytecode with its debug
  locations inside the lowered program; relative file names keep that text, and so the
  program cache's key, the same for a checkout in any directory.
  """
  from gnmr_jax import sharding  # pylint: disable=g-import-not-at-top
  pattern = '^(?:' + '|'.join(re.escape(root + os.sep) for root in source_roots()) + ')'
  previous = jax.config.jax_hlo_source_file_canonicalization_regex
  jax.config.update('jax_hlo_source_file_canonicalization_regex',
                    f'{previous}|{pattern}' if previous else pattern)
  try:
    with sharding.activation_sharding(mesh):
      return jitted.trace(*args).lower()
  finally:
    jax.config.update('jax_hlo_source_file_canonicalization_regex', previous)


def compile_step(jitted, args, mesh, target: targets_lib.Target,
                 cache_dir: str | None = None):
  """(program, lower seconds) of `jitted` on abstract `args` under `mesh`, for `target`.

  Args:
    cache_dir: where compiled programs' reports are kept (program_cache.py); None: no cache.

  Raises:
    DoesNotFit: XLA reports the program does not fit the device's memory.
  """
  start = time.perf_counter()
  lowered = lower_step(jitted, args, mesh)
  lower_s = time.perf_counter() - start
  options = GPU_COMPILER_OPTIONS if target.platform == 'gpu' else {}
  entry_key = None
  if cache_dir:
    described = f'{target.name}\n{target.gpu_config or target.topology_name}'
    entry_key = program_cache.key(lowered.as_text(), described, options,
                                  versions_lib.package_versions(versions_lib.COMPILERS))
    program = program_cache.load(cache_dir, entry_key)
    if program is not None:
      return program, lower_s
  # A compile-only executable cannot be read back from jax's persistent cache (jax 0.10.2:
  # "PjRtCompiler must be constructed with a Client to call DeserializeLoadedExecutable"), so
  # writing one would only cost time and disk: no compile is slow enough to be written. (jax
  # decides once per process whether the cache is on; this threshold it reads per write.)
  min_seconds = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update('jax_persistent_cache_min_compile_time_secs', float('inf'))
  compile_start = time.perf_counter()
  try:
    compiled = lowered.compile(compiler_options=options)
  except Exception as e:  # pylint: disable=broad-except  (XlaRuntimeError and friends)
    if _OOM.search(str(e)):
      raise DoesNotFit(str(e).splitlines()[0][:500]) from e
    raise
  finally:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', min_seconds)
  program = program_cache.Program(compiled.as_text(), memory_of(compiled),
                                  round(time.perf_counter() - compile_start, 2))
  if entry_key is not None:
    program_cache.store(cache_dir, entry_key, program)
  return program, lower_s


def compile_config(config: ml_collections.ConfigDict, target: str | targets_lib.Target,
                   steps: Sequence[str] = STEPS, keep_hlo: bool = False,
                   cache_dir: str | None = None, step_time: bool = False) -> dict:
  """Compiles `config`'s steps for `target` and reports what the device would run.

  Args:
    config: a training config (``configs/*.py``), with config.mesh for the target's devices.
    target: a target name (targets.get_target) or Target.
    steps: which of 'train', 'eval'.
    keep_hlo: also return each step's optimized HLO text under 'hlo' (not JSON-sized).
    cache_dir: keep and reuse compiled programs' reports there (program_cache.py); default
      $GNMR_AOT_CACHE_DIR, unset: no cache. A step read from it says 'cached': True and the
      compile seconds XLA took when it compiled it.
    step_time: also price the train step on the target's device (step_time.project) under
      the train step's 'step_time'; a target without a device spec gets {'error': why}.

  Returns:
    {'target', 'platform', 'num_devices', 'num_hosts', 'device_memory_bytes', 'config',
    'versions', 'steps': {step: {'lower_s', 'compile_s', 'memory', 'fits', 'margin_bytes',
    'gemms', 'gemm_flops', 'conditionals', 'loops', 'collectives', 'hlo_instructions'}}}; a step
    that XLA refused for memory has 'fits': False and 'error'.

  Raises:
    ValueError: an unknown target or step, an invalid config, a mesh the target cannot hold.
    AotSetupError: the target's compiler is not installed.
  """
  target = targets_lib.get_target(target) if isinstance(target, str) else target
  unknown = [s for s in steps if s not in STEPS]
  if unknown or not steps:
    raise ValueError(f'steps must be a non-empty subset of {STEPS}, got {list(steps)}')
  prepare_environment()
  cache_dir = cache_dir if cache_dir is not None else os.environ.get('GNMR_AOT_CACHE_DIR')
  devices = topology_devices(target)
  run, state, batch = build_abstract(config, devices)
  report = {
      'target': target.name, 'platform': target.platform, 'description': target.description,
      'num_devices': target.num_devices, 'num_hosts': target.num_hosts,
      'device_memory_bytes': target.device_memory_bytes,
      'device_kind': devices[0].device_kind, 'mesh': dict(run.mesh.shape),
      'batch_size': int(config.data.batch_size), 'seq_len': int(config.data.seq_len),
      'model': run.model_config.get('name', '?'),
      # as resolved for the target's devices: the kernel compiled ('auto' never stays)
      'attention': run.model_config.attention,
      'precision': {'mode': run.config.precision.mode,
                    'low_cost_path': run.config.precision.low_cost_path,
                    'recovery_path': run.config.precision.recovery_path,
                    # as resolved for the target's devices ('auto' never stays)
                    'microscaling_impl': run.config.precision.microscaling_impl,
                    'scaling': run.config.precision.scaling},
      'versions': versions_lib.package_versions(versions_lib.COMPILERS), 'steps': {},
  }
  jitted = {'train': run.train_step, 'eval': run.eval_step}
  for step in steps:
    try:
      program, lower_s = compile_step(jitted[step], (state, batch), run.mesh, target,
                                      cache_dir)
    except DoesNotFit as e:
      report['steps'][step] = {'fits': False, 'error': str(e)}
      continue
    memory = program.memory
    entry = {'lower_s': round(lower_s, 2), 'compile_s': program.compile_s, 'memory': memory,
             'fits': memory['peak_bytes'] <= target.device_memory_bytes,
             'margin_bytes': target.device_memory_bytes - memory['peak_bytes'],
             'cached': program.cached}
    entry.update(summarize(program.hlo_text))
    if step_time and step == 'train':
      entry['step_time'] = project_step_time(program.hlo_text, report, run.model_config)
    if keep_hlo:
      entry['hlo'] = program.hlo_text
    report['steps'][step] = entry
  return report


def fits(report: dict) -> bool:
  """Whether every compiled step of a report fits the device."""
  return all(step['fits'] for step in report['steps'].values())
