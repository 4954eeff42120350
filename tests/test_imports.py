"""The import graph of kvjax/, built from the source (function-local imports included).

docs/DESIGN.md's "Layers" table is :data:`LAYERS`: each module may import only modules of
its own layer or of layers below it, the graph has no cycle, and at most
:data:`MAX_LOCAL_KVJAX_IMPORTS` function-local imports of kvjax modules remain, each with a
reason on its line.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "kvjax"
MAX_LOCAL_KVJAX_IMPORTS = 5

# Lowest first; a module belongs to the layer of its longest matching prefix.
LAYERS = (
    ("base", ("kvjax", "kvjax.backend", "kvjax.kernels", "kvjax.ops", "kvjax.plan", "kvjax.rope",
              "kvjax.compilation_cache", "kvjax.compression",
              "kvjax.native",
              "kvjax.checkpoints", "kvjax.cache.policy", "kvjax.cache.quant",
              "kvjax.analysis.hardware", "kvjax.analysis.hlo_cost", "kvjax.analysis",
              "kvjax.inference", "kvjax.models", "kvjax.parallel", "kvjax.training")),
    ("config", ("kvjax.config", "kvjax.presets", "kvjax.naming", "kvjax.parallel.mesh",
                "kvjax.parallel.distributed")),
    ("cache", ("kvjax.cache", "kvjax.cache.kv", "kvjax.cache.compress", "kvjax.analysis.theory",
               "kvjax.analysis.speculative", "kvjax.analysis.paging",
               "kvjax.analysis.sizing", "kvjax.parallel.capacity")),
    ("models", ("kvjax.models.layers", "kvjax.models.weight_matmul",
                "kvjax.models.decode_kernels", "kvjax.models.flash",
                "kvjax.models.attention", "kvjax.models.mla", "kvjax.models.model",
                "kvjax.models.convert")),
    ("planner", ("kvjax.planner",)),
    ("inference", ("kvjax.inference.sampling", "kvjax.inference.decode",
                   "kvjax.inference.ragged", "kvjax.inference.speculative",
                   "kvjax.inference.engine", "kvjax.inference.memory",
                   "kvjax.parallel.specs", "kvjax.parallel.programs",
                   "kvjax.parallel.collectives")),
    ("analysis", ("kvjax.analysis.roofline", "kvjax.analysis.costs", "kvjax.analysis.profile",
                  "kvjax.analysis.report", "kvjax.analysis.batch",
                  "kvjax.parallel.costs", "kvjax.training.data",
                  "kvjax.training.evaluate", "kvjax.training.train",
                  "kvjax.training.longcontext", "kvjax.training.longgrid")),
    ("app", ("kvjax.inference.runner", "kvjax.fields", "kvjax.api")),
)


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _type_checking(node) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(mods: dict[str, pathlib.Path]):
    """{module: {imported kvjax module}} and [(module, line, text)] of function-local
    imports of kvjax modules. ``from P import X`` is an edge to P.X when that is a
    module, else to P; imports under ``if TYPE_CHECKING`` are not executed: no edge."""
    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges, local = {m: set() for m in mods}, []
    for m, path in mods.items():
        src = path.read_text()
        tree = ast.parse(src)
        pkg = m if path.name == "__init__.py" else m.rpartition(".")[0]

        def visit(node, in_function, m=m, pkg=pkg, src=src):
            if isinstance(node, ast.If) and _type_checking(node):
                return
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            hit = False
            for t in targets:
                if t == "kvjax" or t.startswith("kvjax."):
                    r = resolve(t)
                    if r and r != m:
                        edges[m].add(r)
                        hit = True
            if hit and in_function:
                local.append((m, node.lineno, src.splitlines()[node.lineno - 1].strip()))
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                     ast.Lambda))
            for child in ast.iter_child_nodes(node):
                visit(child, inner)

        visit(tree, False)
    return edges, local


def layer_of(module: str) -> int:
    best, rank = "", None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > len(best):
                best, rank = p, i
    return rank


def find_cycle(edges: dict[str, set]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = dfs(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state:
            found = dfs(v)
            if found:
                return found
    return None


@pytest.fixture(scope="module")
def graph():
    mods = modules()
    return mods, *imports(mods)


def test_no_import_cycle(graph):
    _, edges, _ = graph
    assert find_cycle(edges) is None, f"import cycle: {' -> '.join(find_cycle(edges))}"


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_module_has_a_layer_and_imports_only_below(graph):
    mods, edges, _ = graph
    assert [m for m in mods if layer_of(m) is None] == []
    up = [f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
          for a in sorted(edges) for b in sorted(edges[a]) if layer_of(b) > layer_of(a)]
    assert up == []


def test_few_function_local_kvjax_imports_each_with_a_reason(graph):
    _, _, local = graph
    assert len(local) <= MAX_LOCAL_KVJAX_IMPORTS, local
    unexplained = [x for x in local if not re.search(r"#.*\(.+\)|#\s*\w+", x[2])]
    assert unexplained == []


def _grep(pattern: str, *dirs: str) -> list[str]:
    hits = []
    for d in dirs:
        for p in (ROOT / d).rglob("*.py"):
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if pattern in line:
                    hits.append(f"{p.relative_to(ROOT)}:{i}")
    return hits


def test_no_ambient_mesh_or_process_backend_in_traced_layers():
    assert _grep("get_abstract_mesh", "kvjax/models", "kvjax/cache") == []
    backend = [h for h in _grep("default_backend()", "kvjax")
               if not h.startswith("kvjax/backend.py")]
    assert backend == []
