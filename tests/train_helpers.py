"""Shared helpers for the train-loop tests: the seconds-long config with test data paths."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "configs"))
import tiny  # noqa: E402  pylint: disable=g-import-not-at-top


def small_config(data, **overrides):
  """configs/tiny.py:runlocal without plots/TensorBoard, all devices on `data`.

  Args:
    data: (data_dir, sdist_path) from the `data_dirs` fixture, or a whole data ConfigDict.
    **overrides: 'group.field' -> value.
  """
  config = tiny.get_config("runlocal")
  if isinstance(data, tuple):
    config.data.data_dir, config.data.sdist_path = data
  else:
    config.data = data
  config.logging.plots = False
  config.logging.tensorboard = False
  config.mesh.fsdp = 1
  config.mesh.data = -1
  # The train-loop tests check the paper's rule (masks, detection): pin it rather than the
  # default priority ('norm').
  config.gnmr.priority = "gnmr"
  config.diagnostics.recovery_gap_every = 0
  for key, value in overrides.items():
    group, field = key.split(".")
    config[group][field] = value
  return config
