"""The "Works with" guide (docs/guides/works_with.md): every row names a test that exists (so each
claim is checked)."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
COLUMNS = ["wrapper", "status", "note", "test"]
TEST_REF = re.compile(r"^`(tests/[\w/]+\.py)::(\w+)(?:::(\w+))?`$")


GUIDE = "docs/guides/works_with.md"


def works_with_rows():
  """(line number, cells) of every table row of the "Works with" guide."""
  lines = (ROOT / GUIDE).read_text().splitlines()
  rows, header = [], None
  for number, line in enumerate(lines, 1):
    if not line.startswith("|"):
      header = None
      continue
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
    if header is None:
      header = cells
      assert header == COLUMNS, f"{GUIDE} line {number}: columns {header}, want {COLUMNS}"
    elif not all(set(c) <= set("-: ") for c in cells):
      rows.append((number, cells))
  return rows


def defined_tests(path):
  """Names of the module-level test functions and Class::method tests of a test file."""
  tree = ast.parse(path.read_text())
  names = set()
  for node in tree.body:
    if isinstance(node, ast.FunctionDef):
      names.add(node.name)
    elif isinstance(node, ast.ClassDef):
      names.update(f"{node.name}::{item.name}" for item in node.body
                   if isinstance(item, ast.FunctionDef))
  return names


def test_the_readme_and_the_guides_link_the_works_with_guide():
  assert "(docs/guides/works_with.md)" in (ROOT / "README.md").read_text()
  assert "(works_with.md)" in (ROOT / "docs" / "guides" / "controller.md").read_text()


def test_every_row_names_an_existing_test():
  rows = works_with_rows()
  assert len(rows) >= 20, "the table lost rows"
  for number, cells in rows:
    wrapper, status, _, test = cells
    assert wrapper and status, f"{GUIDE} line {number}: empty wrapper or status"
    assert status.startswith(("works", "fixed")), f"{GUIDE} line {number}: status {status!r}"
    match = TEST_REF.match(test)
    assert match, f"{GUIDE} line {number}: test cell {test!r} is not `tests/file.py::test_name`"
    path = ROOT / match.group(1)
    assert path.is_file(), f"{GUIDE} line {number}: no file {match.group(1)}"
    name = match.group(2) if match.group(3) is None else f"{match.group(2)}::{match.group(3)}"
    assert name.split("::")[-1].startswith("test"), f"{GUIDE} line {number}: {name} is no test"
    assert name in defined_tests(path), f"{GUIDE} line {number}: {match.group(1)} has no {name}"
