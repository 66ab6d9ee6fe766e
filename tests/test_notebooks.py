"""The notebooks in notebooks/ run end to end (small-config switch, CPU) and are committed clean.

Each notebook is executed with nbclient in a fresh kernel whose spec lives in a temp dir (found
first through JUPYTER_PATH), so nothing depends on kernels installed on the machine. The kernel
gets GNMR_NOTEBOOK_SMALL=1, one CPU device and a temp TFDS dir; the last cell of each notebook
prints a JSON summary that the tests check.
"""
import importlib.util
import json
import math
import os
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from gnmr_jax.data import corpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = ("quickstart.ipynb", "bring_your_own_model.ipynb")
KERNEL = "gnmr_jax_test_python3"
CELL_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
  """Env for the kernel: a temp kernel spec on JUPYTER_PATH, small switch, temp data dirs."""
  root = tmp_path_factory.mktemp("jupyter")
  spec_dir = root / "kernels" / KERNEL
  spec_dir.mkdir(parents=True)
  (spec_dir / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": "gnmr_jax test kernel", "language": "python"}))
  if os.environ.get("GNMR_JAX_SDIST"):
    sdist = corpus.verify_sdist(os.environ["GNMR_JAX_SDIST"])
  else:
    sdist = corpus.ensure_sdist(cache_dir=str(tmp_path_factory.mktemp("corpus")))
  env = dict(os.environ)
  env.update({
      "JUPYTER_PATH": os.pathsep.join(filter(None, [str(root), os.environ.get("JUPYTER_PATH")])),
      "GNMR_NOTEBOOK_SMALL": "1",
      "GNMR_JAX_SDIST": sdist,
      "GNMR_JAX_DATA_DIR": str(tmp_path_factory.mktemp("tfds")),
      "JAX_PLATFORMS": "cpu",
      "XLA_FLAGS": "",  # one CPU device, not the 8 simulated ones of conftest.py
      "MPLBACKEND": "Agg",
  })
  return env


def execute(name, env, cwd, monkeypatch):
  """Runs every cell of notebooks/<name> in a fresh kernel; returns the executed notebook."""
  # The kernel spec is looked up in this process, so JUPYTER_PATH must be set here too.
  monkeypatch.setenv("JUPYTER_PATH", env["JUPYTER_PATH"])
  nb = nbformat.read(os.path.join(REPO, "notebooks", name), as_version=4)
  # iopub_timeout: how long a finished cell's output may lag its reply before nbclient drops it
  # silently (default 4 s); on 2 loaded cores a summary print once arrived later (2026-12-07).
  client = NotebookClient(nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT_S, iopub_timeout=60,
                          raise_on_iopub_timeout=True,
                          resources={"metadata": {"path": str(cwd)}})
  client.execute(env=env)
  return nb


def outputs(nb, output_type):
  return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs
          if o.output_type == output_type]


def summary_line(nb, prefix):
  lines = [line for o in outputs(nb, "stream") if o.name == "stdout"
           for line in o.text.splitlines() if line.startswith(prefix + " ")]
  assert len(lines) == 1, f"expected one {prefix} line, got {lines}"
  return json.loads(lines[0][len(prefix) + 1:])


def test_quickstart_trains_gnmr_and_static_and_plots(kernel_env, tmp_path, monkeypatch):
  nb = execute("quickstart.ipynb", kernel_env, tmp_path, monkeypatch)
  assert not outputs(nb, "error")
  result = summary_line(nb, "QUICKSTART_SUMMARY")
  assert result["backend"] == "cpu" and result["config"] == "tiny"
  assert result["low_cost_path"] == "int8"
  # The fit cell: no chip to fit on CPU, the config as it is.
  assert result["fit"] == {"target": None, "grad_accum_steps": 1, "remat": "none"}
  assert result["steps"] == {"gnmr": 16, "static": 16}
  for mode in ("gnmr", "static"):
    perplexity = result["eval_perplexity"][mode]
    assert math.isfinite(perplexity) and 1.0 < perplexity < 257.0, (mode, perplexity)
  # Same seed and data; routing a few units to bf16 must not change the outcome much.
  ratio = result["eval_perplexity"]["gnmr"] / result["eval_perplexity"]["static"]
  assert 0.8 < ratio < 1.25
  assert result["num_units"] == 14  # 7 projections x 2 layers
  assert 0 <= result["max_units_in_mask"] <= result["max_o"]
  assert 0.0 <= result["recovered_unit_steps_pct"] <= 100.0
  # Loss comparison, recovery heatmap, score heatmap, top-unit scores.
  images = [o for o in outputs(nb, "display_data") if "image/png" in o.get("data", {})]
  assert len(images) == 4
  workroot = tmp_path / "workdirs" / "quickstart"
  for mode in ("gnmr", "static"):
    assert (workroot / f"tiny_small_int8_{mode}" / "summary.json").exists()


def test_bring_your_own_model_spike_enters_mask_for_t_lock_plus_one(kernel_env, tmp_path,
                                                                    monkeypatch):
  nb = execute("bring_your_own_model.ipynb", kernel_env, tmp_path, monkeypatch)
  assert not outputs(nb, "error")
  result = summary_line(nb, "BYOM_SUMMARY")
  assert result["num_units"] == 2  # the two routed Dense kernels, chosen by the regex
  assert result["mask_run_length"] == result["t_lock"] + 1
  assert 1 <= result["max_active"] <= result["max_o"]
  assert result["active_unit_steps"] >= result["t_lock"] + 1
  assert math.isfinite(result["final_loss"]) and result["final_loss"] < result["first_loss"]
  stdout = "".join(o.text for o in outputs(nb, "stream") if o.name == "stdout")
  assert "lax.cond in the routed forward pass: 2" in stdout
  # The NNX section: nnx_routing.route with the mask from nnx.Optimizer's state.
  assert result["nnx_mask_run_length"] == result["t_lock"] + 1
  assert math.isfinite(result["nnx_final_loss"])
  assert result["nnx_final_loss"] < result["nnx_first_loss"]
  assert "NNX layers restored after the step: True" in stdout


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_is_valid_and_has_no_outputs(name):
  nb = nbformat.read(os.path.join(REPO, "notebooks", name), as_version=4)
  nbformat.validate(nb)
  code_cells = [c for c in nb.cells if c.cell_type == "code"]
  assert code_cells
  for cell in code_cells:
    assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]
  assert nb.metadata.kernelspec.name == "python3"
  source = "\n".join(c.source for c in code_cells)
  # Small-config switch for CI, and the install cell that CI skips.
  assert "GNMR_NOTEBOOK_SMALL" in source and "REPO_URL" in source


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_install_cell_installs_a_wheel_or_the_git_url(name, tmp_path, monkeypatch):
  """The install cell run as if gnmr_jax were not installed, with pip and git recorded."""
  nb = nbformat.read(os.path.join(REPO, "notebooks", name), as_version=4)
  cell = next(c.source for c in nb.cells if c.cell_type == "code" and "REPO_URL" in c.source)
  assert "WHEEL = ''" in cell and "REPO_URL = ''" in cell
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(sys, "path", list(sys.path))
  commands = []
  monkeypatch.setattr(subprocess, "run", lambda command, check: commands.append(command))
  real_find_spec = importlib.util.find_spec

  def run(wheel="", repo_url="", installed=False):
    commands.clear()
    looks = iter([installed])  # the first look: installed or not; later ones: the real spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n: real_find_spec(n) if next(looks, True) else None)
    exec(cell.replace("WHEEL = ''", f"WHEEL = {wheel!r}").replace(  # pylint: disable=exec-used
        "REPO_URL = ''", f"REPO_URL = {repo_url!r}"), {})
    return commands

  pip = [sys.executable, "-m", "pip", "install", "-q"]
  wheel = tmp_path / "dist" / "gnmr_jax-0.2.0-py3-none-any.whl"
  assert run(wheel="dist/gnmr_jax-0.2.0-py3-none-any.whl") == [
      pip + [f"gnmr_jax[data,logging] @ {wheel.as_uri()}"]]
  assert run(wheel="https://example.org/gnmr_jax-0.2.0-py3-none-any.whl") == [
      pip + ["gnmr_jax[data,logging] @ https://example.org/gnmr_jax-0.2.0-py3-none-any.whl"]]
  clone = str(tmp_path / "gnmr_jax_repo")
  assert run(repo_url="https://example.org/gnmr_jax") == [
      ["git", "clone", "--depth", "1", "https://example.org/gnmr_jax", clone],
      pip + ["-e", f"{clone}[data,logging]"]]
  assert sys.path[0] == clone
  assert run(wheel="w.whl", installed=True) == []  # gnmr_jax imports: nothing to do
  with pytest.raises(RuntimeError, match="set WHEEL"):
    run()
