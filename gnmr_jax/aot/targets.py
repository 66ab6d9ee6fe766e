"""The accelerators `gnmr_jax.aot` compiles for, by name, and their topologies.

GPU names: ``h100``, ``h200``, ``b200``, ``a100``, ``l4``, ``t4``; ``h100:8`` is one host with
8 GPUs, ``h100:2x8`` two hosts with 8 each. Each reads a ``GpuTargetConfigProto`` text shipped in
``target_configs/`` (device fields from XLA's published specs or the datasheet, each file says
which, plus the CUDA runtime version the fp8 rewrite needs).

TPU names as Cloud TPU spells them (MaxText's ``accelerator_to_spec_map.py``): ``v5e-N`` and
``v6e-N`` (N chips: 1, 4, 8, 16, 32, 64, 128, 256), ``v5p-N`` (N TensorCores, 2 per chip: 8 to
1024); ``v5e-256x2`` is two such slices. A slice spans ``N / 4`` hosts of 4 chips (v5e-1: one).

Example:
  >>> target = get_target('v5p-64')
  >>> target.platform, target.num_devices, target.num_hosts, target.topology_name
  ('tpu', 32, 8, 'v5:2x4x4')
  >>> get_target('h100:2x8').num_devices
  16
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import re

GiB = 1 << 30

# name -> (config file, what it is)
GPU_TARGETS = {
    'h100': 'NVIDIA H100 SXM 80 GB (Hopper, sm_90: fp8 and int8 tensor cores)',
    'h200': 'NVIDIA H200 141 GB (Hopper, sm_90)',
    'b200': 'NVIDIA B200 (Blackwell, sm_100: also block-scaled NVFP4 / MXFP8)',
    'a100': 'NVIDIA A100 SXM 80 GB (Ampere, sm_80: int8 and bf16 tensor cores, no fp8)',
    'l4': 'NVIDIA L4 24 GB (Ada, sm_89: fp8; Colab)',
    't4': 'NVIDIA T4 16 GB (Turing, sm_75: int8 tensor cores, no bf16; Colab free tier)',
}

# kind -> (topology prefix, chip config, HBM per device, {chips or cores: (shape, wrap)})
_PLANAR = {1: ('1x1', None), 4: ('2x2', None), 8: ('2x4', None), 16: ('4x4', None),
           32: ('4x8', None), 64: ('8x8', None), 128: ('8x16', (False, True, False)),
           256: ('16x16', (True, True, False))}
_CUBE = {8: ('2x2x1', None), 16: ('2x2x2', None), 32: ('2x2x4', None), 64: ('2x4x4', None),
         128: ('4x4x4', (True,) * 3), 256: ('4x4x8', (True,) * 3), 512: ('4x8x8', (True,) * 3),
         1024: ('8x8x8', (True,) * 3)}
TPU_KINDS = {
    # HBM per device: v5e 16 GiB, v6e 32 GiB per chip (one TensorCore each); v5p 95 GiB per chip,
    # one megacore device per chip (Cloud TPU system architecture pages).
    'v5e': ('v5e', 'default', 16 * GiB, _PLANAR, 'TPU v5e (v5 lite): int8 MXU, 16 GiB HBM'),
    'v6e': ('v6e', 'default', 32 * GiB, _PLANAR, 'TPU v6e (Trillium): int8 MXU, 32 GiB HBM'),
    'v5p': ('v5', 'megacore', 95 * GiB, _CUBE, 'TPU v5p: int8 MXU, 95 GiB HBM per chip'),
}
CHIPS_PER_HOST = 4


@dataclasses.dataclass(frozen=True)
class Target:
  """A named accelerator topology to compile for.

  Attributes:
    name: the name it was asked by (``'h100:2x8'``, ``'v5e-4'``).
    platform: ``'gpu'`` or ``'tpu'``.
    description: what it is.
    device_memory_bytes: memory of one device (GPU: the config's device_memory_size).
    num_devices: devices in the whole topology.
    num_hosts: hosts (processes) it spans.
    gpu_config: the GpuTargetConfigProto text (GPU only).
    topology_name, chip_config_name, chips_per_host_bounds, num_slices, wrap: the arguments of
      ``jax.experimental.topologies.get_topology_desc`` (TPU only).
  """
  name: str
  platform: str
  description: str
  device_memory_bytes: int
  num_devices: int
  num_hosts: int
  gpu_config: str | None = None
  topology_name: str | None = None
  chip_config_name: str | None = None
  chips_per_host_bounds: tuple | None = None
  num_slices: int = 1
  wrap: tuple | None = None

  @property
  def gpu_topology(self) -> str:
    """'<slices>x<hosts>x<GPUs per host>', the CUDA topology string."""
    return f'1x{self.num_hosts}x{self.num_devices // self.num_hosts}'


def target_names() -> list[str]:
  """Examples of every accepted form, for error messages and ``--help``."""
  return (sorted(GPU_TARGETS) + ['h100:8', 'h100:2x8']
          + [f'{k}-{n}' for k in ('v5e', 'v6e') for n in (1, 4, 8, 16, 64, 256)]
          + [f'v5p-{n}' for n in (8, 16, 32, 64, 128, 256, 512, 1024)] + ['v5e-256x2'])


def gpu_config_text(kind: str) -> str:
  """The shipped GpuTargetConfigProto text of a GPU kind (``'h100'``)."""
  return (importlib.resources.files('gnmr_jax.aot') / 'target_configs' / f'{kind}.txtpb'
          ).read_text()


def _unknown(name: str, why: str) -> ValueError:
  return ValueError(f'unknown target {name!r}: {why}. Targets: {", ".join(target_names())} '
                    f'(GPU: <{"|".join(sorted(GPU_TARGETS))}>[:<GPUs>|:<hosts>x<GPUs>]; '
                    f'TPU: <v5e|v6e>-<{"|".join(map(str, _PLANAR))}>, '
                    f'v5p-<{"|".join(map(str, _CUBE))}>, optionally x<slices>).')


def get_target(name: str) -> Target:
  """The ``Target`` called ``name``.

  Raises:
    ValueError: an unknown name, naming the accepted forms.
  """
  if not isinstance(name, str) or not name:
    raise _unknown(str(name), 'a target name is a non-empty string')
  gpu = re.fullmatch(r'([a-z0-9]+)(?::(?:(\d+)x)?(\d+))?', name)
  if gpu and gpu.group(1) in GPU_TARGETS:
    kind, hosts, per_host = gpu.group(1), int(gpu.group(2) or 1), int(gpu.group(3) or 1)
    if hosts < 1 or per_host < 1 or per_host > 8:
      raise _unknown(name, 'a GPU host holds 1 to 8 GPUs')
    text = gpu_config_text(kind)
    memory = int(re.search(r'device_memory_size:\s*(\d+)', text).group(1))
    return Target(name=name, platform='gpu', description=GPU_TARGETS[kind],
                  device_memory_bytes=memory, num_devices=hosts * per_host, num_hosts=hosts,
                  gpu_config=text)
  tpu = re.fullmatch(r'(v5e|v6e|v5p)-(\d+)(?:x(\d+))?', name)
  if not tpu:
    raise _unknown(name, 'not a GPU or TPU name')
  kind, size, slices = tpu.group(1), int(tpu.group(2)), int(tpu.group(3) or 1)
  prefix, chip_config, memory, shapes, description = TPU_KINDS[kind]
  if size not in shapes or slices < 1:
    raise _unknown(name, f'{kind} slices come in sizes {sorted(shapes)}')
  shape, wrap = shapes[size]
  chips = size // 2 if kind == 'v5p' else size
  per_host = (1, 1, 1) if chips == 1 else (2, 2, 1)
  return Target(name=name, platform='tpu', description=description, device_memory_bytes=memory,
                num_devices=chips * slices, num_hosts=max(1, chips // CHIPS_PER_HOST) * slices,
                topology_name=f'{prefix}:{shape}', chip_config_name=chip_config,
                chips_per_host_bounds=per_host, num_slices=slices,
                wrap=wrap or (False, False, False))


# jax device_kind prefixes -> target kinds (Colab's runtimes and the chips above); 'TPU v5'
# (v5p) after 'TPU v5 lite' (v5e), which it prefixes.
_DEVICE_KINDS = (('TPU v5 lite', 'v5e'), ('TPU v6 lite', 'v6e'), ('TPU v5', 'v5p'),
                 ('NVIDIA H100', 'h100'), ('NVIDIA H200', 'h200'), ('NVIDIA B200', 'b200'),
                 ('NVIDIA A100', 'a100'), ('NVIDIA L4', 'l4'), ('Tesla T4', 't4'))


def local_target(devices) -> str | None:
  """The target name of the devices a runtime has (``jax.devices()``): 'v6e-1' on Colab's TPU
  v6e, 't4' on its T4, 'h100:8' on one host of eight; None on a CPU or an unlisted chip.

  >>> import jax
  >>> local_target(jax.devices('cpu')) is None
  True
  """
  devices = list(devices)
  kind = next((name for prefix, name in _DEVICE_KINDS
               if devices and devices[0].device_kind.startswith(prefix)), None)
  if kind is None:
    return None
  if kind in GPU_TARGETS:
    return kind if len(devices) == 1 else f'{kind}:{len(devices)}'
  return f'{kind}-{len(devices) * (2 if kind == "v5p" else 1)}'
