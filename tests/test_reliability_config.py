"""Bad input: random config overrides (hypothesis) are either refused before anything is traced
(TypeError from the typed ConfigDict, or ValueError naming the field) or build and trace a train
step; no invalid combination reaches tracing and fails there."""
import math
import os
import re
import sys
import types

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import pytest

from gnmr_jax import train_loop
from gnmr_jax.config import validate_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "configs"))
import tiny  # noqa: E402  pylint: disable=g-import-not-at-top

# Data fields that only make_data reads (dataset names and paths) are left out: they never reach
# the traced step. Every other field of every group is drawn.
SKIP = {"data": {"corpus_cache_dir", "data_dir", "dataset", "eval_split", "sdist_path",
                 "text_key", "train_split"}}
STRINGS = {
    "model.dtype": ["float32", "bfloat16", "float16", "int8", "f32"],
    "model.param_dtype": ["float32", "bfloat16", "float64"],
    "model.remat": ["none", "full", "block", "everything"],
    "model.name": ["tiny", "small", "huge"],
    "data.tokenizer": ["bytes", "sentencepiece", "chars"],
    "data.sentencepiece_model_type": ["unigram", "bpe", "word"],
    "optimizer.nonfinite": ["skip", "zero", "none", "ignore"],
    "gnmr.units": [r"layers/(attn|mlp)/(q|k)/kernel", r"nothing_matches", "(", ""],
    "gnmr.layer_axis": ["^layers/", "", "^nope/", "["],
    "precision.mode": ["static", "gnmr", "dynamic"],
    "precision.low_cost_path": ["int8", "fp8", "saved_activation", "blockwise", "bf16", "int3"],
    "precision.recovery_path": ["bf16", "int8", "fp8", "fp4"],
    "precision.saved_activation_scale": ["token", "tensor", "channel", "row"],
    "faults.schedule": ["3:1:scale:10", "3:*:nan;5:-:nan_loss::2", "3:99:nan", "3:1:boom",
                        r"2:mlp/up/kernel\[1\]:corrupt_output:4:2", "2:zzz:inf"],
}
INTS = [-1, 0, 1, 2, 3, 4, 7, 64, 1000, 10**9]
FLOATS = [-1.0, 0.0, 1e-9, 0.5, 1.0, 1.5, 3.0, 1e9, math.nan, math.inf, -math.inf]
ODD = [None, "x", True, 2.5, [1]]


def all_fields():
  config = tiny.get_config("runlocal")
  return [(g, f) for g in config.keys() for f in config[g].keys()
          if f not in SKIP.get(g, ())]


FIELDS = all_fields()


@st.composite
def overrides(draw):
  config = tiny.get_config("runlocal")
  picked = draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True))
  out = []
  for group, field in picked:
    current = config[group][field]
    key = f"{group}.{field}"
    if key in STRINGS:
      pool = STRINGS[key]
    elif isinstance(current, bool):
      pool = [True, False]
    elif isinstance(current, int):
      pool = INTS + [current * 2]
    elif isinstance(current, float):
      pool = FLOATS + [current * 2]
    else:
      pool = [current, "bogus"]
    out.append((group, field, draw(st.sampled_from(pool + ODD))))
  return out


def trace_train_step(config):
  """Builds everything for `config` and traces (lowers, no compile) one train step."""
  stub_data = types.SimpleNamespace(vocab_size=256)
  run = train_loop.build(config, data=stub_data, devices=jax.devices()[:1])
  with train_loop.sharding.activation_sharding(run.mesh):
    state = run.abstract_state
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         state, run.state_shardings)
    shape = (config.data.batch_size, config.data.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=run.batch_sharding)
             for k in ("inputs", "targets")}
    run.train_step.lower(state, batch)


OUTCOMES = {"type_refused": 0, "value_refused": 0, "traced": 0}


@hypothesis.settings(max_examples=80, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(overrides())
def test_random_overrides_are_refused_up_front_or_trace(changes):
  config = tiny.get_config("runlocal")
  config.mesh.fsdp, config.mesh.data = 1, -1
  try:
    for group, field, value in changes:
      config[group][field] = value
  except TypeError:  # the typed ConfigDict refuses it at assignment (train.py: exit 2)
    OUTCOMES["type_refused"] += 1
    return
  names = [f"{g}.{f}" for g, f, _ in changes]
  try:
    validate_config(config, device_count=1)
  except ValueError as e:
    # Refused before anything is built, naming (one of) the overridden fields or its group.
    assert any(n in str(e) or n.split(".")[1] in str(e) or n.split(".")[0] in str(e)
               for n in names), (changes, str(e))
    OUTCOMES["value_refused"] += 1
    return
  for _, _, value in changes:  # nothing non-finite may pass validation
    assert not (isinstance(value, float) and not math.isfinite(value)), changes
  try:
    trace_train_step(config)
  except ValueError as e:  # only resolution against the built model, naming the field
    assert re.search(r"config\.faults\.schedule|gnmr: `(units|layer_axis)`", str(e)), (
        changes, str(e))
    OUTCOMES["value_refused"] += 1
    return
  OUTCOMES["traced"] += 1


def test_outcomes_were_all_exercised(record_property):
  """The property above saw all three outcomes (it runs first in this file)."""
  if not any(OUTCOMES.values()):
    pytest.skip("run together with the property test")
  assert all(v > 0 for v in OUTCOMES.values()), OUTCOMES
  refused = OUTCOMES["type_refused"] + OUTCOMES["value_refused"]
  record_property("bad_inputs_tried", refused)  # every refused draw held an invalid value
  record_property("bad_inputs_refused", refused)
  record_property("valid_configs_traced", OUTCOMES["traced"])
