"""The routed step costs what the static step does: temporaries of a layer-stacked config with
remat, compiled for H100 (layers unrolled, per-unit conditionals) and TPU v5e (loop rolled).

Bound: the issue's goal, routed temporaries <= 1.15 x static. Why it can hold: under remat
'full' both steps save only each layer's input and recompute the rest of a layer in the
backward pass; routing adds a conditional per projection whose branches' buffers live no longer
than the layer being recomputed. What breaks it: a fully unrolled routed step in which XLA merges
the recomputation into the forward pass (no CSE prevention) keeps every layer's activations:
2.1x here (313 vs 148 MB on H100), 3.2x at 1B (BENCHMARKS.md "Routed step at scale").
The config: tokens (128 x 128) and 4 layers so that the activations, not cuBLAS's fixed 32 MB
workspace, decide the temporaries.
"""

import pytest

from aot_helpers import compiled

GOAL = 1.15
LAYERS = 4
SHAPE = dict(batch=(128, 128), remat='full', num_layers=LAYERS, dtype='bfloat16')


@pytest.mark.parametrize('target,path', [('h100', 'fp8'), ('v5e-1', 'int8')])
def test_routed_temporaries_stay_within_the_goal_of_the_static_steps(target, path):
  _, static, _ = compiled(target, 'static', path, **SHAPE)
  _, routed, inventory = compiled(target, 'gnmr', path, **SHAPE)
  static_step, routed_step = static['steps']['train'], routed['steps']['train']
  ratio = routed_step['memory']['temp'] / static_step['memory']['temp']
  assert ratio <= GOAL, (ratio, static_step['memory'], routed_step['memory'])
  # The default per backend: unrolled on GPU (no loop), rolled on TPU (two loops, as static).
  assert len(routed_step['loops']) == (0 if target == 'h100' else 2), routed_step['loops']
  assert len(static_step['loops']) == 2
  if target == 'v5e-1':  # and the program stays within 2x of the static one's
    code = (routed_step['memory']['generated_code'] / static_step['memory']['generated_code'])
    assert code <= 2, code
