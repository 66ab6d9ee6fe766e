"""Every code block of the README and of the documentation's guides does what it shows.

Python blocks run, in one fresh interpreter (one CPU device; a block may register a precision
path, which must not leak into this worker's other tests): a block with `>>>` as a doctest, any
other block as a program. Shell blocks are checked without being run (they train, or compile for
an accelerator): every `make` target exists, every file they name is in the repository, every
`--config.x.y=` override names a config field and every `python -m` module imports.
"""
import importlib.util
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

import doc_blocks

REPO = doc_blocks.REPO
FILES = doc_blocks.markdown_files()
README_MAX_LINES = 300  # the README is a guide; the rest lives in docs/

RUNNER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import doc_blocks
blocks = [b for f in doc_blocks.markdown_files() for b in doc_blocks.code_blocks(f)]
results, _ = doc_blocks.run_python_blocks(blocks)
print("DOC_BLOCKS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def block_results(tmp_path_factory):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "MPLBACKEND": "Agg"}
  out = subprocess.run([sys.executable, "-c", RUNNER, str(REPO / "tests")], capture_output=True,
                       text=True, env=env, timeout=600,
                       cwd=str(tmp_path_factory.mktemp("doc_blocks")))
  lines = [l for l in out.stdout.splitlines() if l.startswith("DOC_BLOCKS ")]
  assert out.returncode == 0 and lines, out.stderr[-4000:]
  results = {}
  for result in json.loads(lines[-1][len("DOC_BLOCKS "):]):
    results.setdefault(result["file"], []).append(result)
  return results


@pytest.mark.parametrize("path", FILES)
def test_python_blocks_run(block_results, path):
  expected = doc_blocks.code_blocks(path)
  results = block_results.get(path, [])
  assert [r["line"] for r in results] == [b["line"] for b in expected]
  for result in results:
    assert result["ok"], f"{path}:{result['line']}\n{result['report']}"


def test_the_readme_and_the_guides_have_examples_that_run(block_results):
  counted = {path: len(results) for path, results in block_results.items()}
  assert counted.get("README.md", 0) >= 1, counted
  # The guides that show code: the controller (Linen and NNX routing), the recovery gap, a path.
  for guide in ("controller", "choosing_a_recipe", "precision"):
    assert counted.get(f"docs/guides/{guide}.md", 0) >= 1, counted
  doctests = [r for results in block_results.values() for r in results if r["doctest"]]
  assert doctests and all(r["tries"] >= 10 for r in doctests), doctests


def test_the_readme_stays_a_guide():
  lines = (REPO / "README.md").read_text().splitlines()
  assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
  # The brief's two commands stay at the top.
  first_block = doc_blocks.code_blocks("README.md", ("bash",))[0]["source"]
  assert first_block.startswith("make train") and "\nmake test" in first_block, first_block


def _make_targets():
  return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))


def _config_fields():
  """The dotted names of every field of the base config, groups 'faults' and 'diagnostics'
  included."""
  from gnmr_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  fields = set()

  def walk(node, prefix):
    for key, value in node.items():
      name = f"{prefix}{key}"
      fields.add(name)
      if hasattr(value, "items"):
        walk(value, name + ".")

  walk(config_lib.base_config(), "")
  return fields


def _commands(block):
  """The block's commands: continuation lines joined, comments dropped, split as a shell would."""
  text = block["source"].replace("\\\n", " ")
  return [shlex.split(line, comments=True) for line in text.splitlines() if line.strip()]


SHELL_BLOCKS = [b for f in FILES for b in doc_blocks.code_blocks(f, ("bash", "sh", "shell"))]


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: f"{b['file']}:{b['line']}")
def test_shell_blocks_name_what_exists(block):
  where = f"{block['file']}:{block['line']}"
  targets, fields = _make_targets(), _config_fields()
  for words in _commands(block):
    words = [w for w in words if not re.match(r"^[A-Z_]+=", w)]  # environment assignments
    if words and words[0] == "make":
      for target in words[1:]:
        assert target in targets, f"{where}: no Makefile target {target!r}"
      continue
    for i, word in enumerate(words):
      if word == "-m":
        assert importlib.util.find_spec(words[i + 1]), f"{where}: no module {words[i + 1]}"
      value = word.split("=", 1)[1] if word.startswith("--config=") else word
      path = value.split(":", 1)[0]
      if re.match(r"^(\.venv[\w-]*/bin/python|[\w./-]+\.(py|sh))$", path):
        assert (REPO / path).exists() or path.startswith(".venv"), f"{where}: no file {path}"
      override = re.match(r"^--config\.([\w.]+)=", word)
      if override:
        assert override.group(1) in fields, f"{where}: no config field {override.group(1)}"
