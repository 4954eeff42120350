"""The fast subset (``python -m pytest -q -m fast``, tests/fast.txt) names real tests, none
of them slow, and covers every test file that has a test which is not slow (issue 57,
item 7). Read with ``ast``: no test module is imported."""

import ast
import pathlib
import re

from tests.conftest import FAST_LIST

TESTS = pathlib.Path(__file__).resolve().parent


def _is_slow(decorators) -> bool:
    return any(re.search(r"\bmark\.slow\b", ast.unparse(d)) for d in decorators)


def functions_of(path: pathlib.Path) -> dict[str, bool]:
    """name (``Class::test`` inside a class) -> marked slow, of one test file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module_slow = any(isinstance(n, ast.Assign) and any(
        getattr(t, "id", "") == "pytestmark" for t in n.targets) and _is_slow([n.value])
        for n in tree.body)
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            out[node.name] = module_slow or _is_slow(node.decorator_list)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name.startswith("test"):
                    out[f"{node.name}::{f.name}"] = module_slow or _is_slow(
                        node.decorator_list + f.decorator_list)
    return out


def test_the_fast_list_names_real_tests_that_are_not_slow():
    ids = FAST_LIST.read_text().splitlines()
    assert ids, "tests/fast.txt is empty"
    for node in ids:
        file, _, name = node.partition("::")
        path = TESTS.parent / file
        assert path.exists(), node
        funcs = functions_of(path)
        base = name.split("[")[0]
        assert base in funcs, f"{node}: no such test in {file}"
        assert not funcs[base], f"{node} is marked slow"


def test_every_file_with_a_test_that_is_not_slow_is_in_the_fast_subset():
    listed = {n.split("::")[0] for n in FAST_LIST.read_text().splitlines()}
    missing = [f"tests/{p.name}" for p in sorted(TESTS.glob("test_*.py"))
               if not all(functions_of(p).values()) and f"tests/{p.name}" not in listed]
    assert not missing, f"test files with no test in tests/fast.txt: {missing}"
