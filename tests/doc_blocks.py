"""The fenced code blocks of the README and the guides, and how a python block is run.

Shared by tests/test_doc_examples.py (every block of README.md and docs/**/*.md, in a fresh
interpreter) and tests/test_wheel.py (the README's blocks against the installed wheel). Stdlib
only: `run_python_blocks` also runs inside the wheel's fresh environment, which has no pytest.

A python block that holds `>>>` is a doctest (ELLIPSIS, NORMALIZE_WHITESPACE); any other python
block is a program, executed as it stands in a namespace of its own.
"""
import doctest
import pathlib
import re
import traceback

REPO = pathlib.Path(__file__).resolve().parents[1]
# ```lang at the start of a line, up to the closing ``` (blocks are not nested in these files).
_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


def markdown_files():
  """README.md and every markdown page of the documentation site, relative to the repository."""
  return ["README.md"] + sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")
                                if "_build" not in p.parts)


def code_blocks(path, languages=("python",)):
  """[{'file', 'line', 'language', 'source'}] of the fenced blocks of `path` in `languages`."""
  text = (REPO / path).read_text(encoding="utf-8")
  blocks = []
  for match in _FENCE.finditer(text):
    if match.group(1) in languages:
      blocks.append({"file": str(path), "line": text.count("\n", 0, match.start()) + 1,
                     "language": match.group(1), "source": match.group(2)})
  return blocks


def is_doctest(block):
  return ">>>" in block["source"]


def run_python_blocks(blocks):
  """Runs each block (a doctest, or a program) in a namespace of its own.

  Returns (results, namespaces): per block {'file', 'line', 'doctest', 'tries', 'ok', 'report'}
  ('tries': the examples a doctest ran, 1 for a program), and the namespace a program left (None
  for a doctest).
  """
  results, namespaces = [], []
  for block in blocks:
    name = f"{block['file']}:{block['line']}"
    if is_doctest(block):
      test = doctest.DocTestParser().get_doctest(block["source"], {}, name, block["file"],
                                                  block["line"])
      runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
      report = []
      runner.run(test, out=report.append)
      ok, tries, text = runner.failures == 0 and runner.tries > 0, runner.tries, "".join(report)
      namespace = None
    else:
      namespace = {"__name__": "__doc_example__"}
      try:
        exec(compile(block["source"], name, "exec"), namespace)  # pylint: disable=exec-used
        ok, text = True, ""
      except Exception:  # pylint: disable=broad-except
        ok, text = False, traceback.format_exc()
      tries = 1
    namespaces.append(namespace)
    results.append({"file": block["file"], "line": block["line"], "doctest": is_doctest(block),
                    "tries": tries, "ok": ok, "report": text[-3000:]})
  return results, namespaces
