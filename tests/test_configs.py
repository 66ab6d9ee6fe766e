"""Every shipped config validates; the llama sizes refuse unknown names."""
import os
import sys

import pytest

from gnmr_jax.config import validate_config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "configs"))
import llama  # noqa: E402
import small  # noqa: E402
import tiny  # noqa: E402


@pytest.mark.parametrize("module,arg", [(tiny, None), (tiny, "runlocal"), (small, None),
                                        (small, "runlocal")] + [(llama, s) for s in llama.PAPER_SIZES])
def test_config_validates(module, arg):
  config = module.get_config(arg)
  validate_config(config, device_count=8)
  assert config.data.seq_len <= config.model.max_seq_len


def test_llama_unknown_size():
  with pytest.raises(ValueError, match="60m"):
    llama.get_config("70m")


def _wsd_reference(t, peak, end, warmup, total, fraction):
  """Warmup-stable-decay in float64: linear 0 -> peak over `warmup`, the peak until the last
  round(total * fraction) steps, then linear to `end` at `total`, `end` after it."""
  stable_end = max(total - max(1, round(total * fraction)), warmup)
  if t < warmup:
    return peak * t / warmup
  if t < stable_end:
    return peak
  return peak + (end - peak) * min(t - stable_end, total - stable_end) / (total - stable_end)


@pytest.mark.parametrize("warmup,total,fraction", [(20, 200, 0.2), (0, 50, 0.5), (10, 37, 1.0)])
def test_wsd_schedule_matches_a_float64_reference(warmup, total, fraction):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from gnmr_jax import optim  # pylint: disable=g-import-not-at-top
  config = tiny.get_config()
  config.optimizer.update(schedule="wsd", decay_fraction=fraction, warmup_steps=warmup,
                          learning_rate=3e-3, min_lr_ratio=0.1)
  validate_config(config, device_count=1)
  schedule = optim.learning_rate_schedule(config.optimizer, total)
  got = np.array([float(schedule(t)) for t in range(total + 3)])
  want = np.array([_wsd_reference(t, 3e-3, 3e-4, warmup, total, fraction)
                   for t in range(total + 3)])
  # float32 schedule arithmetic: a few float32 ulps of the peak.
  np.testing.assert_allclose(got, want, rtol=0, atol=4 * np.finfo(np.float32).eps * 3e-3)
  assert got[total] == pytest.approx(3e-4) and max(got) == pytest.approx(3e-3)


@pytest.mark.parametrize("field,value,match", [
    ("schedule", "linear", r"config.optimizer.schedule must be one of \['cosine', 'wsd'\]"),
    ("decay_fraction", 0.0, "config.optimizer.decay_fraction"),
    ("decay_fraction", 1.5, "config.optimizer.decay_fraction")])
def test_bad_schedule_settings_are_named(field, value, match):
  config = tiny.get_config()
  config.optimizer.schedule = "wsd"
  config.optimizer[field] = value
  with pytest.raises(ValueError, match=match):
    validate_config(config, device_count=1)


def test_bad_noise_rank_is_named():
  config = tiny.get_config()
  config.gnmr.noise_rank = "gap"
  with pytest.raises(ValueError, match=r"config.gnmr.noise_rank='gap' is read by priority 'noise'"):
    validate_config(config, device_count=1)
  config.gnmr.priority = "noise"
  with pytest.raises(ValueError, match=r"config.gnmr.noise_rank must be one of \['pi', 'norm'\]"):
    validate_config(config, device_count=1)


def test_bad_noise_gate_is_named():
  config = tiny.get_config()
  config.gnmr.noise_gate, config.gnmr.priority = "all", "noise"
  with pytest.raises(ValueError, match=r"config.gnmr.noise_gate must be one of \['unit', 'any'\]"):
    validate_config(config, device_count=1)
