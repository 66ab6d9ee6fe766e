"""The documentation site builds with no warning (warnings are errors, as `make docs` runs it):
a docstring that reST cannot parse, a broken link or anchor between the README, the guides and
the reports, or a page outside every table of contents fails here. The pages are checked for the
API reference generated from the docstrings and for the notebooks rendered as committed."""
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
GUIDES = sorted(p.stem for p in (REPO / "docs" / "guides").glob("*.md"))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
  out = tmp_path_factory.mktemp("docs_html")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  start = time.perf_counter()
  build = subprocess.run([sys.executable, "-m", "sphinx", "-q", "-W", "--keep-going", "-c", "docs",
                          "-b", "html", ".", str(out)], capture_output=True, text=True,
                         cwd=str(REPO), env=env, timeout=600)
  seconds = time.perf_counter() - start
  assert build.returncode == 0, build.stderr[-6000:]
  assert not build.stderr.strip(), build.stderr[-6000:]
  print(f"docs build: {seconds:.1f} s")
  return out


def test_every_guide_and_report_is_a_page(site):
  assert (site / "docs" / "index.html").is_file() and (site / "index.html").is_file()
  for guide in GUIDES:
    assert (site / "docs" / "guides" / f"{guide}.html").is_file(), guide
  for report in ("README", "RESULTS", "THRESHOLDS", "RELIABILITY", "BENCHMARKS", "CHANGELOG"):
    assert (site / f"{report}.html").is_file(), report


def test_the_api_reference_is_generated_from_the_docstrings(site):
  import gnmr_jax  # pylint: disable=g-import-not-at-top
  controllers = (site / "docs" / "api" / "controllers.html").read_text()
  for name in ("gnmr", "transient_alarm", "norm_level", "fixed_set", "last_blocks", "late_switch",
               "recovery_mask", "controller_state", "GNMRState"):
    assert f'id="gnmr_jax.{name}"' in controllers, name
    # The first line of the docstring is on the page.
    summary = getattr(gnmr_jax, name).__doc__.strip().splitlines()[0]
    words = re.sub(r"[`:*]|\b(func|class)\b", "", summary).split()[:3]
    assert all(w.strip(".,()") in controllers for w in words), (name, words)
  for page, anchor in (("precision", "gnmr_jax.precision.make_policy"),
                       ("model", "gnmr_jax.model.Transformer"),
                       ("training", "gnmr_jax.train_loop.train_and_evaluate"),
                       ("units_and_gap", "gnmr_jax.control.measure"),
                       ("data", "gnmr_jax.data.make_data"),
                       ("aot", "gnmr_jax.aot.compile_config")):
    assert f'id="{anchor}"' in (site / "docs" / "api" / f"{page}.html").read_text(), anchor


@pytest.mark.parametrize("notebook, calls", [("quickstart", "train_and_evaluate"),
                                             ("bring_your_own_model", "nnx_routing")])
def test_the_notebooks_render_as_committed(site, notebook, calls):
  html = (site / "notebooks" / f"{notebook}.html").read_text()
  assert html.count("cell_input") >= 5 and calls in html
  # Rendered, not executed: the committed notebooks have no outputs, and none appear.
  assert "cell_output" not in html
