"""The runnable examples in the public modules' docstrings pass, and the public API has them.

The examples run in one fresh interpreter (one CPU device): some register precision paths in
the global registry, which must not leak into the other tests of this worker.
Not run here: gnmr_jax.data.pipeline and gnmr_jax.data.shakespeare_builder, whose examples
download and prepare the corpus at fixed paths (tests/test_data_*.py cover that code).
"""
import json
import os
import subprocess
import sys

import pytest

MODULES = (
    "gnmr_jax.control.paper",
    "gnmr_jax.control.priorities",
    "gnmr_jax.control.priority_table",
    "gnmr_jax.control.static_recipes",
    "gnmr_jax.control.recommended",
    "gnmr_jax.control.research",
    "gnmr_jax.control.recovery_gap",
    "gnmr_jax.control.units",
    "gnmr_jax.control.state",
    "gnmr_jax.control.config",
    "gnmr_jax.clipping",
    "gnmr_jax.precision.policy",
    "gnmr_jax.precision.registry",
    "gnmr_jax.precision.path",
    "gnmr_jax.precision.bf16",
    "gnmr_jax.precision.explicit_sharding",
    "gnmr_jax.nnx_routing",
    "gnmr_jax.model",
    "gnmr_jax.model_configs",
    "gnmr_jax.attention",
    "gnmr_jax.loss",
    "gnmr_jax.sharding",
    "gnmr_jax.plots",
    "gnmr_jax.data.config",
    "gnmr_jax.data.tokenizers",
    "gnmr_jax.data.iterator",
    "gnmr_jax.aot.targets",
    "gnmr_jax.versions",
)

# Public API that must carry a runnable example (">>>") in its docstring.
DOCUMENTED = (
    "gnmr_jax.gnmr", "gnmr_jax.GNMRState", "gnmr_jax.GNMRTelemetry", "gnmr_jax.recovery_mask",
    "gnmr_jax.controller_state", "gnmr_jax.transient_alarm", "gnmr_jax.norm_level",
    "gnmr_jax.fixed_set", "gnmr_jax.last_blocks", "gnmr_jax.late_switch",
    "gnmr_jax.control.research.gap", "gnmr_jax.control.research.relgap",
    "gnmr_jax.control.research.oracle", "gnmr_jax.control.research.hybrid",
    "gnmr_jax.control.research.random", "gnmr_jax.control.research.noise",
    "gnmr_jax.control.research.saturation", "gnmr_jax.model.amax_saturation_units",
    "gnmr_jax.control.measure",
    "gnmr_jax.control.UnitLayout", "gnmr_jax.control.UnitValues", "gnmr_jax.control.from_config",
    "gnmr_jax.precision.make_policy", "gnmr_jax.precision.PrecisionPolicy.dot",
    "gnmr_jax.precision.PrecisionPolicy.dot_general", "gnmr_jax.precision.register_path",
    "gnmr_jax.precision.available_paths", "gnmr_jax.precision.path_dot",
    "gnmr_jax.precision.path.three_leg_path",
    "gnmr_jax.nnx_routing.route", "gnmr_jax.nnx_routing.routed_einsum",
    "gnmr_jax.control.units.path_to_str", "gnmr_jax.control.units.resolve_units",
    "gnmr_jax.control.units.unit_norms",
    "gnmr_jax.model.Transformer", "gnmr_jax.model.projection_recover_bits",
    "gnmr_jax.model.for_init",
    "gnmr_jax.loss.chunked_cross_entropy", "gnmr_jax.loss.chunked_token_losses",
    "gnmr_jax.attention.resolve", "gnmr_jax.model_configs.static_scan_unroll",
    "gnmr_jax.plots", "gnmr_jax.plots.plot_losses", "gnmr_jax.plots.recovery_matrix",
)

RUNNER = r"""
import doctest, importlib, inspect, json, sys, warnings
warnings.simplefilter("ignore")
results = {}
for name in sys.argv[1:]:
  module = importlib.import_module(name)
  runner_out = []
  finder = doctest.DocTestFinder()
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  tests = finder.find(module, name)
  # DocTestFinder skips wrapped callables such as a jax.custom_vjp with a __doc__ (bf16_dot).
  found = {t.name for t in tests}
  for attr, value in vars(module).items():
    doc = getattr(value, "__doc__", None)
    if (f"{name}.{attr}" not in found and isinstance(doc, str) and ">>>" in doc
        and not (inspect.isclass(value) or inspect.ismodule(value) or inspect.isroutine(value))):
      tests.append(doctest.DocTestParser().get_doctest(
          doc, dict(vars(module)), f"{name}.{attr}", module.__file__, 0))
  for test in tests:
    runner.run(test, out=runner_out.append)
  results[name] = {"attempted": runner.tries, "failed": runner.failures,
                   "report": "".join(runner_out)[-4000:]}
print("DOCTEST_RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def doctest_results(tmp_path_factory):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "MPLBACKEND": "Agg"}
  out = subprocess.run([sys.executable, "-c", RUNNER, *MODULES], capture_output=True, text=True,
                       env=env, timeout=600, cwd=str(tmp_path_factory.mktemp("doctest")))
  lines = [l for l in out.stdout.splitlines() if l.startswith("DOCTEST_RESULTS ")]
  assert out.returncode == 0 and lines, out.stderr[-4000:]
  return json.loads(lines[-1][len("DOCTEST_RESULTS "):])


@pytest.mark.parametrize("module", MODULES)
def test_docstring_examples_pass(doctest_results, module):
  result = doctest_results[module]
  assert result["attempted"] > 0, f"{module} has no docstring examples"
  assert result["failed"] == 0, result["report"]


def _resolve(dotted):
  import importlib  # pylint: disable=g-import-not-at-top
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for attr in parts[i:]:
      obj = getattr(obj, attr)
    return obj
  raise ImportError(dotted)


@pytest.mark.parametrize("name", DOCUMENTED)
def test_public_api_has_runnable_example(name):
  doc = _resolve(name).__doc__ or ""
  assert ">>> " in doc, f"{name} has no runnable example in its docstring"
