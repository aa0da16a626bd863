"""The suite's own contracts (issue 50 item 8), read from the source with `ast`: a test module imports what the tests
share from helpers.py and finds fixtures through conftest.py, never importing another test module or conftest; and
the tests read their data from the checkout (tests/data/), never from a path beside or above it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from helpers import SPEC_BENCH

TESTS = Path(__file__).resolve().parent
# what pytest imports: the test modules, conftest.py, helpers.py and the throwaway method package; not export_hashes.py
# (a script run by hand, outside the suite) nor this file, whose strings are the patterns themselves
SOURCES = sorted(p for p in TESTS.rglob("*.py") if p.name not in ("export_hashes.py", Path(__file__).name))

# a test module, or conftest: what no test imports
TEST_MODULE = re.compile(r"^(test_\w*|conftest)$")
# an import of one, in code that a test writes out and runs in a fresh interpreter (a string)
IMPORT_LINE = re.compile(r"^\s*(from|import)\s+(test_\w*|conftest)\b", re.M)
# the data folder beside the checkout that the tests once read
OUTSIDE_PATHS = ("../shared", "/work/shared")


def imported_test_modules(source: str) -> list[str]:
    """`line: module` of every import of a test module or conftest, in code or in a string of code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: {a.name}" for a in node.names if TEST_MODULE.match(a.name.split(".")[0])]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if TEST_MODULE.match(node.module.split(".")[0]):
                found.append(f"{node.lineno}: {node.module}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [f"{node.lineno}: {m.group(2)} (in a string)" for m in IMPORT_LINE.finditer(node.value)]
    return found


def mentions_file(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id == "__file__" for n in ast.walk(node))


def paths_outside_the_checkout(source: str) -> list[str]:
    """`line: what` of every path that leaves the checkout: `parents[k]` of a file in tests/ with k >= 2 (parents[1] is
    the repository's root), three or more `.parent` of `__file__`, or the data folder beside the checkout by name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents"
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)
                and node.slice.value >= 2):
            found.append(f"{node.lineno}: parents[{node.slice.value}]")
        elif isinstance(node, ast.Attribute) and node.attr == "parent":
            depth, base = 0, node
            while isinstance(base, ast.Attribute) and base.attr == "parent":
                depth, base = depth + 1, base.value
            if depth >= 3 and mentions_file(base):
                found.append(f"{node.lineno}: {depth} x .parent of __file__")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [f"{node.lineno}: {path!r}" for path in OUTSIDE_PATHS if path in node.value]
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_module_imports_another_or_conftest(path):
    """Helpers (functions, constants) live in helpers.py, fixtures in conftest.py (pytest finds them)."""
    assert imported_test_modules(path.read_text()) == [], f"{path.name}: import from helpers.py instead"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_reads_outside_the_checkout(path):
    """Data comes from the repository (tests/data/, its source named in tests/data/README.md) or a fixture."""
    assert paths_outside_the_checkout(path.read_text()) == [], f"{path.name}: put the data under tests/data/"


def test_the_checks_find_what_they_look_for():
    """Each rule fires on a line that breaks it and stays quiet on its allowed neighbour."""
    assert imported_test_modules("from test_train_data import make_tiny_data") == ["1: test_train_data"]
    assert imported_test_modules("import test_decoder_eagle3 as eagle3_tests") == ["1: test_decoder_eagle3"]
    assert imported_test_modules("def f():\n    from conftest import made_once") == ["2: conftest"]
    assert imported_test_modules('CODE = """\nimport os\nfrom conftest import made_once\n"""') == [
        "1: conftest (in a string)"]
    assert imported_test_modules("from helpers import made_once\nimport testing\nfrom . import test_x") == []
    assert paths_outside_the_checkout('P = Path(__file__).resolve().parents[2] / "shared" / "data"') == [
        "1: parents[2]"]
    assert paths_outside_the_checkout("P = Path(__file__).resolve().parent.parent.parent") == [
        "1: 3 x .parent of __file__"]
    assert paths_outside_the_checkout('Q = "../shared/data/spec_bench_question.jsonl"') == ["1: '../shared'"]
    assert paths_outside_the_checkout('R = Path(__file__).resolve().parents[1] / "scripts"\n'
                                      "S = Path(__file__).parent.parent\nT = path.parent.parent.parent") == []


def test_the_spec_bench_subset_is_in_the_checkout():
    """The questions the prompt and eval tests read: in tests/data/, with their source and licence beside them."""
    assert Path(SPEC_BENCH).is_relative_to(TESTS / "data") and Path(SPEC_BENCH).is_file()
    readme = (TESTS / "data" / "README.md").read_text()
    assert Path(SPEC_BENCH).name in readme and "github.com/hemingkx/Spec-Bench" in readme and "Apache" in readme
