"""Sphinx configuration of the gnmr_jax documentation (`make docs`).

Guides are MyST markdown (docs/guides/), the API reference is autodoc over the docstrings, one
page per group (docs/api/), and the notebooks (notebooks/) render through
myst-nb without being executed: they are committed without outputs and stay that way.
tests/test_docs_build.py builds this site with warnings as errors.
"""

import os
import re
import sys

# Autodoc imports the package; the docs never run a computation, so one CPU device suffices.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gnmr_jax  # pylint: disable=wrong-import-position

project = "gnmr_jax"
author = "the gnmr_jax authors"
copyright = "2026, the gnmr_jax authors"  # pylint: disable=redefined-builtin
release = version = gnmr_jax.__version__

extensions = [
    "myst_nb",  # MyST markdown (it loads myst_parser) and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # the docstrings' Google style (Args:, Returns:, Example:)
    "sphinx.ext.mathjax",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
# The source directory is the repository root (`sphinx-build -c docs . OUT`), so that the links
# between the README, the guides and the generated reports (RESULTS.md, ...) work the same here
# and on a code host; only these files are part of the site.
root_doc = "docs/index"
include_patterns = ["docs/**", "notebooks/*.ipynb", "README.md", "CHANGELOG.md", "RESULTS.md",
                    "THRESHOLDS.md", "RELIABILITY.md", "BENCHMARKS.md"]
# Sphinx walks the source directory before it filters: every other top-level folder (.venv, .git,
# workdirs, experiments, ...) is excluded by name, so the walk never enters it.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
exclude_patterns = ["docs/_build", "**/.ipynb_checkpoints"] + sorted(
    name for name in os.listdir(_ROOT)
    if os.path.isdir(os.path.join(_ROOT, name)) and name not in ("docs", "notebooks"))

# The docstrings write code as `name` (markdown's habit): render it as code, not as a citation.
default_role = "literal"

# MyST: the guides' headings get anchors (README links point at them), $...$ math, and
# ::: fences for directives.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "dollarmath"]

# Notebooks render as committed (no outputs): executing them is tests/test_notebooks.py's job.
nb_execution_mode = "off"

autodoc_typehints = "none"  # the signatures stay readable; Args: says what each argument is
autodoc_member_order = "bysource"
autodoc_default_options = {"exclude-members": "__init__, __new__"}
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

html_theme = "alabaster"
# The root page is docs/index.html (the source directory is the repository); index.html at the
# top of the site sends the reader there.
html_extra_path = ["_extra"]  # relative to this directory
html_title = f"gnmr_jax {release}"
html_theme_options = {"description": "Runtime precision control for low-precision LLM training",
                      "fixed_sidebar": True}


# The docstrings name files by glob in plain text (`configs/*.py`): a `*` right after a `/` is a
# glob, never reST emphasis. Everything else in a docstring that reST cannot parse stays a warning.
_GLOB_STAR = re.compile(r"(?<=/)\*")


def _escape_path_globs(app, what, name, obj, options, lines):  # pylint: disable=unused-argument
  lines[:] = [_GLOB_STAR.sub(r"\\*", line) for line in lines]


def setup(app):
  app.connect("autodoc-process-docstring", _escape_path_globs)
