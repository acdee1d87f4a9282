"""No import circles among the project's modules.

Two modules that import each other (directly or around a longer circle) load
only in some orders, and are one module in two files. The imports are read off
the source with ast, as test_layering.py does, but only those that run when the
module loads: statements at module level (inside `if`, `try` or a class body
too, `if TYPE_CHECKING:` included, since such an import names the same
dependency), not those inside functions, which run later and are the way to
defer a heavy import (the engine, torch)."""

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("shared", "services", "tools")

KNOWN_CYCLES: set[frozenset[str]] = {
    frozenset({"shared.model.kernels.invariant_matmul", "shared.model.kernels.invariant_matmul_tma"}),
}
"""Circles that exist and are not fixed yet, each as the set of its modules. It may
only shrink: a circle listed here that no longer exists fails the test too."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load_time_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of the module's body, not descending into functions."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    paths = {
        module_name(p): p
        for folder in FOLDERS
        for p in sorted((ROOT / folder).rglob("*.py"))
        if "proto" not in p.parts
    }
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in load_time_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the module pkg.sub where there is one.
            targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names}
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_project():
    graph = import_graph()
    assert len(graph) > 60, "the walk found too few modules"
    assert "services.balancer.generation" in graph["services.balancer.router.orchestrator"]
    assert "services.balancer.frontend.protocol" in graph["services.balancer.frontend.api"]  # from pkg import mod


def test_the_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_no_module_imports_itself_around_a_circle():
    found = set(circles(import_graph()))
    new = [sorted(c) for c in found - KNOWN_CYCLES]
    gone = [sorted(c) for c in KNOWN_CYCLES - found]
    assert not new, "import circles:\n" + "\n".join(" <-> ".join(c) for c in new)
    assert not gone, "fixed, take them off KNOWN_CYCLES:\n" + "\n".join(" <-> ".join(c) for c in gone)
