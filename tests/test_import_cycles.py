"""No import cycle among the product modules (services/, shared/, kernels/, cli/).

A cycle means two modules are one job split in two files, or that a shared piece lives in
the wrong one: move that piece into a module of its own, or turn the dependency around.
The graph is built from module-level imports (``from x import y`` counts as an import of
``x.y`` when that is a module); imports under ``if TYPE_CHECKING:`` are annotations only and
are skipped. Imports inside functions are not part of the module graph, but a lazy import
written only to dodge a cycle is a cycle all the same and is not allowed either."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_boundaries import ROOT

PRODUCT = ("services", "shared", "kernels", "cli")


def module_names(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``packages`` (a package is its __init__)."""
    names = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join(parts)] = path
    return names


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements run when the module loads (not in functions, not under
    TYPE_CHECKING)."""
    found = []

    def visit(statements):
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.orelse)
            else:
                for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                    visit(getattr(node, field, []))

    visit(tree.body)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
                     names: dict[str, Path]) -> set[str]:
    """The product modules an import statement loads, relative ones resolved against
    ``module``: ``from x import y`` loads ``x.y`` when that is a module, else ``x``."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & names.keys()
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    loaded = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base
              for alias in node.names}
    return loaded & names.keys()


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PRODUCT,
                 lazy: bool = False) -> dict[str, set[str]]:
    """Module -> the product modules it imports at module level (``lazy``: also those it
    imports inside its functions)."""
    names = module_names(root, packages)
    graph = {}
    for module, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        statements = module_level_imports(tree)
        if lazy:
            statements += [node for node in _function_bodies_imports(tree)]
        graph[module] = {name for node in statements
                         for name in imported_modules(node, module, path.name == "__init__.py",
                                                      names)} - {module}
    return graph


def _function_bodies_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements inside functions (run when the function is called)."""
    return [node for function in ast.walk(tree)
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
            for statement in function.body for node in ast.walk(statement)
            if isinstance(node, (ast.Import, ast.ImportFrom))]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle per strongly connected group of modules, each as a closed path."""
    found = []
    for group in _strongly_connected(graph):
        start = min(group)
        found.append(_shortest_path_back(graph, start, group))
    return sorted(found)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative; only groups of two or more modules."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(group)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups


def _shortest_path_back(graph: dict[str, set[str]], start: str, group: set[str]) -> list[str]:
    """Breadth-first from ``start`` back to itself inside ``group``: [start, ..., start]."""
    parents, frontier = {}, [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & group):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return path[::-1] + [start]
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a group it cannot reach back from")


def test_there_are_modules_to_check():
    graph = import_graph()
    assert "services.worker.runner" in graph and "shared.messages" in graph
    assert "shared.messages" in graph["services.scheduler.scheduler"]


def test_no_import_cycle_in_the_product():
    found = cycles(import_graph())
    assert not found, ("break each cycle at its cause (move the shared piece into a module of "
                       "its own, or turn the dependency around):\n"
                       + "\n".join(" -> ".join(cycle) for cycle in found))


def test_no_lazy_import_closes_a_cycle():
    """An import moved into a function still runs: if it closes a cycle, the cycle is there."""
    found = cycles(import_graph(lazy=True))
    assert not found, ("an import inside a function closes a cycle; break it at its cause:\n"
                       + "\n".join(" -> ".join(cycle) for cycle in found))


def test_the_check_catches_a_planted_cycle(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from ..c import thing\n")
    (package / "c.py").write_text("import pkg.a\nthing = 1\n")
    # not in the module graph: an annotation-only import, and one inside a function
    (package / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n"
        "def f():\n    from pkg import e\n")
    (package / "e.py").write_text("try:\n    from pkg.d import f\nexcept ImportError:\n"
                                  "    pass\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.d"] == set() and graph["pkg.e"] == {"pkg.d"}
    assert graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.a"] == {"pkg.sub.b"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    assert cycles(import_graph(tmp_path, ("pkg",), lazy=True)) == [
        ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"], ["pkg.d", "pkg.e", "pkg.d"]]
