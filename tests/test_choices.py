"""Formulation choices are made in few functions (issue 52), counted from the source.

A *choice* is a comparison (``==``, ``!=``, ``in``, ``not in``, or a ``match``/``case``,
or ``str.startswith``) that tests a formulation: one side is a string literal (or a
tuple, list or set of them) naming a registered formulation of any op or 'auto'
(:data:`kvjax.kernels.REGISTRY`), or a name or attribute that holds one (the config
fields ``decode_attention``, ``prefill_impl``, ``weight_matmul``; the variables
``impl``, ``requested``, ``pick``, ``choice``). Not choices: comparisons with a cache
policy's ``kind``, the ``window_cache`` field, a layout or ``jax.nn.dot_product_attention``'s
``implementation`` (their 'dense', 'auto' and 'cudnn' are other vocabularies' words), and
membership in the
registry's name lists (:data:`REGISTERED`: a check that a value is registered). Every function of kvjax/ is scanned, as
tests/test_imports.py scans imports; a nested function counts as its own.
"""

from __future__ import annotations

import ast
import pathlib

from kvjax import kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]
HOLDERS = {"decode_attention", "prefill_impl", "weight_matmul", "impl", "requested",
           "pick", "choice"}
OTHER_VOCABULARY = {"kind", "slot_kind", "window_cache", "key_layout", "value_layout",
                    "layout", "implementation"}
REGISTERED = {"CANDIDATES",
              "WEIGHT_CANDIDATES", "names", "allowed", "known"}
"""Membership in these (the registry's name lists) checks that a value is registered; it
chooses nothing."""
ALLOWED = {"kvjax.kernels.select", "kvjax.planner.resolve"}
"""The registry's rule (the models' calls, the plan's picks, the config's and mesh's
validation all go through it) and the planner's resolve."""


def _names() -> set[str]:
    return {f.name for f in kernels.REGISTRY} | {kernels.AUTO}


def _tests_formulation(node: ast.AST, names: set[str]) -> bool:
    def literal(o):
        if isinstance(o, ast.Constant) and isinstance(o.value, str):
            return o.value in names
        if isinstance(o, (ast.Tuple, ast.List, ast.Set)):
            return any(literal(e) for e in o.elts)
        return False

    def holder(o):
        return ((isinstance(o, ast.Name) and o.id in HOLDERS)
                or (isinstance(o, ast.Attribute) and o.attr in HOLDERS))

    if isinstance(node, ast.Compare):
        ops = [node.left, *node.comparators]
        if any((isinstance(o, ast.Attribute) and o.attr in OTHER_VOCABULARY)
               or (isinstance(o, ast.Name) and o.id in OTHER_VOCABULARY) for o in ops):
            return False
        last = node.comparators[-1]
        if isinstance(node.ops[-1], (ast.In, ast.NotIn)) and (
                (isinstance(last, ast.Name) and last.id in REGISTERED)
                or (isinstance(last, ast.Attribute) and last.attr in REGISTERED)
                or (isinstance(last, ast.Call) and getattr(last.func, "attr", getattr(
                    last.func, "id", None)) in REGISTERED)):
            return False
        return any(literal(o) or holder(o) for o in ops)
    if isinstance(node, ast.Match):
        return holder(node.subject)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "startswith"):
        return holder(node.func.value)
    return False


def choice_sites(root: pathlib.Path = ROOT / "kvjax") -> dict[str, int]:
    """{'module.function': number of choices in it} over every .py file under ``root``."""
    names = _names()
    out: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)

        def visit(node, where):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(child, f"{where}.{child.name}")
                    continue
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{where}.{child.name}")
                    continue
                if _tests_formulation(child, names):
                    out[where] = out.get(where, 0) + 1
                visit(child, where)

        visit(ast.parse(path.read_text()), module)
    return out


def test_choices_are_made_in_at_most_three_functions():
    sites = choice_sites()
    assert set(sites) <= ALLOWED, sorted(set(sites) - ALLOWED)
    assert len(sites) <= 3


def test_the_counter_finds_a_choice(tmp_path):
    """The count can fail: a branch on a formulation name is found."""
    pkg = tmp_path / "kvjax"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f(cfg, kind):\n"
                              "    if cfg.decode_attention == 'native':\n"
                              "        return 1\n"
                              "    return kind == 'dense'\n")
    global ROOT  # noqa: PLW0603
    old, ROOT = ROOT, tmp_path
    try:
        assert choice_sites(pkg) == {"kvjax.m.f": 1}
    finally:
        ROOT = old
