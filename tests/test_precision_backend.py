"""default_low_cost_path picks int8 on TPU/CPU and fp8 only on GPUs with fp8 tensor cores."""
import dataclasses

import jax
import pytest

from gnmr_jax.precision import available_paths, default_low_cost_path


@dataclasses.dataclass
class FakeDevice:
  platform: str
  device_kind: str
  compute_capability: object = None


@pytest.mark.parametrize("device,want", [
    (FakeDevice("tpu", "TPU v5 lite"), "int8"),
    (FakeDevice("cpu", "cpu"), "int8"),
    (FakeDevice("gpu", "NVIDIA H200", "9.0"), "fp8"),
    (FakeDevice("gpu", "NVIDIA L4", "8.9"), "fp8"),
    (FakeDevice("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), "int8"),
    (FakeDevice("gpu", "Tesla T4", "7.5"), "int8"),
    (FakeDevice("rocm", "AMD Instinct MI300X", "gfx942"), "int8"),
    (FakeDevice("cuda", "NVIDIA H100 80GB HBM3", None), "fp8"),
])
def test_default_low_cost_path(device, want):
  assert default_low_cost_path(device) == want
  assert want in available_paths()


def test_default_on_this_machine_is_int8():
  assert default_low_cost_path() == ("int8" if jax.devices()[0].platform != "gpu" else
                                     default_low_cost_path(jax.devices()[0]))
