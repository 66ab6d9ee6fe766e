"""The package as users get it: `python -m build` gives an sdist and a wheel (built from the sdist)
whose metadata passes `twine check --strict`; the wheel, installed into a fresh environment, runs
every python block of the README there (tests/doc_blocks.py), importing gnmr_jax from that
environment, not from this source tree.

The build runs without isolation (no network): with this environment's setuptools, which the
lock pins. The fresh environment gets the wheel alone (`pip install --no-deps --no-index`); its
dependencies come from this environment's site-packages, named by plain paths in a .pth file, so
that their own .pth files, among them the editable install of this checkout, are not run.
"""
import json
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
VERSION = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M)[1]

# Run in the fresh environment: every python block of the README (tests/doc_blocks.py, stdlib
# only), then a look at what the controller example left.
RUNNER = r"""
import importlib.metadata, json, sys
sys.path.insert(0, sys.argv[1])
import doc_blocks
import gnmr_jax

blocks = doc_blocks.code_blocks("README.md")
results, namespaces = doc_blocks.run_python_blocks(blocks)
info = {"file": gnmr_jax.__file__, "version": gnmr_jax.__version__,
        "dist_version": importlib.metadata.version("gnmr_jax"), "blocks": results}
controller = [ns for b, ns in zip(blocks, namespaces) if ns is not None and "tx.init(params)"
              in b["source"] and "gnmr_jax.recovery_mask(opt_state)" in b["source"]]
info["controller_blocks"] = len(controller)
if len(controller) == 1 and "ctl" in controller[0]:
  mask, ctl = controller[0]["mask"], controller[0]["ctl"]
  info.update(q_mask=[bool(b) for b in mask["layers"]["attn"]["q"]["kernel"]],
              head_mask=bool(mask["head"]["kernel"]), count=int(ctl.count),
              num_units=int(ctl.telemetry.num_units))
print("WHEEL_RESULT " + json.dumps(info))
"""


def _run(command, **kwargs):
  out = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
  assert out.returncode == 0, f"{command}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
  return out.stdout


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
  """The sdist and the wheel `python -m build` makes from a copy of the sources."""
  src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
  for name in ("pyproject.toml", "README.md"):
    shutil.copy(REPO / name, src / name)
  shutil.copytree(REPO / "gnmr_jax", src / "gnmr_jax",
                  ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
  _run([sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check",
        "--outdir", str(out), str(src)])
  return sorted(out.iterdir())


def test_build_gives_an_sdist_and_a_wheel_whose_metadata_passes_twine_check(dists):
  assert [p.name for p in dists] == [f"gnmr_jax-{VERSION}-py3-none-any.whl",
                                     f"gnmr_jax-{VERSION}.tar.gz"]
  report = _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dists)])
  assert report.count("PASSED") == 2, report


def test_the_wheel_runs_the_readme_examples_in_a_fresh_environment(dists, tmp_path):
  wheel = next(p for p in dists if p.suffix == ".whl")
  venv = tmp_path / "venv"
  _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
  python = str(venv / "bin" / "python")
  purelib = pathlib.Path(_run([python, "-c", "import sysconfig; "
                                             "print(sysconfig.get_paths()['purelib'])"]).strip())
  (purelib / "dependencies.pth").write_text("".join(f"{d}\n" for d in site.getsitepackages()))
  _run([sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check", "install",
        "--quiet", "--no-deps", "--no-index", str(wheel)])
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="")
  run_dir = tmp_path / "run"  # not the checkout: '' on sys.path must not find gnmr_jax
  run_dir.mkdir()
  stdout = _run([python, "-c", RUNNER, str(REPO / "tests")], env=env, cwd=str(run_dir))
  result = json.loads(next(l for l in stdout.splitlines()
                           if l.startswith("WHEEL_RESULT "))[len("WHEEL_RESULT "):])
  # gnmr_jax came from the installed wheel, at the version of pyproject.toml.
  assert pathlib.Path(result["file"]).is_relative_to(purelib), result["file"]
  assert result["version"] == result["dist_version"] == VERSION
  assert result["blocks"], "README: no python block"
  for block in result["blocks"]:
    assert block["ok"], f"README.md:{block['line']}\n{block['report']}"
  # The controller example (one plain block chains a controller and reads the mask) ran: one
  # update of the transient alarm, within its warmup.
  assert result["controller_blocks"] == 1, "README: one python block chains a controller"
  assert result["count"] == 1 and result["num_units"] == 4  # q and up, 2 layers each
  assert result["q_mask"] == [False, False] and result["head_mask"] is False
