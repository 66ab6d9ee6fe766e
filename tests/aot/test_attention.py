"""Attention compiled for each backend: cuDNN flash attention on GPUs that run it, Pallas splash
on TPU, XLA where no kernel applies; no float32 score buffer where a kernel runs, and no float32
[B, S, V] logits with the fused loss."""

import base64
import re

import pytest

from aot_helpers import compiled
from aot_helpers import tier_config
from gnmr_jax.aot import compile as compile_lib
from gnmr_jax.aot import targets as targets_lib

# The tier config in bf16 with 4 query heads over 2 kv heads of 16 (grouped-query attention)
# and a sequence of 384 = 3 x 128 (splash's block; a length no other dimension has).
SEQ = 384
# The loss in 4 chunks of 96 positions (the byte vocabulary's default is one chunk); an MLP
# width whose merged gate/up GEMM (2 x 160) is no vocabulary-sized array.
SHAPE = dict(dtype='bfloat16', num_heads=4, num_kv_heads=2, max_seq_len=SEQ, loss_chunks=4,
             ffn_dim=160)
VOCAB = 256  # the byte tokenizer's ids (a multiple of train_loop.VOCAB_MULTIPLE already)
KERNEL_CALLS = {'cudnn': ('__cudnn$fmhaSoftmax"', '__cudnn$fmhaSoftmaxBackward"'),
                'splash': ('splash_mha_fwd', 'splash_mha_dq', 'splash_mha_dkv')}


def _step(target):
  _, report, inventory = compiled(target, 'static', 'bf16', batch=(2, SEQ),
                                  **SHAPE)
  return report, inventory


def _f32_with_two_seq_axes(inventory) -> list:
  """Instructions whose result is a float32 array with two axes of the sequence's length."""
  found = []
  for instruction in inventory.instructions.values():
    for dims in re.findall(r'f32\[([\d,]+)\]', instruction.type):
      if [int(d) for d in dims.split(',')].count(SEQ) >= 2:
        found.append(f'{instruction.opcode} {instruction.type[:80]}')
  return found


# a100 is the lowest compute capability cuDNN flash attention takes (8.0), t4 (7.5) below it.
@pytest.mark.parametrize('target,expect', [
    ('h100', 'cudnn'), ('h200', 'cudnn'), ('b200', 'cudnn'), ('a100', 'cudnn'), ('l4', 'cudnn'),
    ('t4', 'xla'), ('v5e-1', 'splash'), ('v6e-1', 'splash')])
def test_the_report_names_the_kernel_auto_resolved_to_and_the_program_runs_it(target, expect):
  report, inventory = _step(target)
  assert report['attention'] == expect
  text = '\n'.join(f'{i.name} {i.attributes}' for i in inventory.instructions.values())
  for impl, calls in KERNEL_CALLS.items():
    for call in calls:
      assert (call in text) == (impl == expect), (target, call)
  if expect == 'xla':  # the reference keeps its float32 scores
    assert _f32_with_two_seq_axes(inventory)
  else:
    assert not _f32_with_two_seq_axes(inventory), _f32_with_two_seq_axes(inventory)[:3]
  # The fused loss (model.loss_chunks): no float32 logits of the whole [B, S, V] anywhere.
  whole = {f'f32[2,{SEQ},{VOCAB}]', f'f32[{2 * SEQ},{VOCAB}]'}
  assert not [i.name for i in inventory.instructions.values()
              if any(shape in i.type for shape in whole)]


def test_splash_bodies_name_their_sources_relative_to_the_checkout():
  """The Mosaic bodies in the lowered TPU program (the program cache's key) carry their debug
  locations; relative file names keep the key the same for a checkout in any directory."""
  compile_lib.prepare_environment()
  config = tier_config('static', 'bf16', batch=(2, SEQ), **SHAPE)
  run, state, batch = compile_lib.build_abstract(
      config, compile_lib.topology_devices(targets_lib.get_target('v5e-1')))
  text = compile_lib.lower_step(run.train_step, (state, batch), run.mesh).as_text()
  bodies = re.findall(r'\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22', text)
  assert len(bodies) == 3  # splash_mha_fwd, _dq, _dkv
  for body in bodies:
    files = set(re.findall(rb'[\w./-]+\.py', base64.b64decode(body)))
    assert b'jax/experimental/pallas/ops/tpu/splash_attention/splash_attention_kernel.py' in files
    assert not [f for f in files if f.startswith(b'/')], files
