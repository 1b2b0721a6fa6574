"""The package's layers, written down once, and a check that every import follows them.

Data flows one way (file -> tensors -> stats -> findings -> output -> exit code), and so
do imports: a module may import its own layer's package and the layers below it, never
one above. Every import counts: at the top of a file, inside a function (lazy) and under
``if TYPE_CHECKING``. Modules of one layer that are siblings (``comparison``, ``trend``,
``training``) do not import each other; the bottom layer's modules may, without a cycle.
Runtime imports (top-level and lazy) form no cycle anywhere.

Run by ``.ci/run``; ``tests/test_layers.py`` plants a wrong-way import and sees it fail.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

#: Top to bottom. A module belongs to the first entry its dotted name starts with.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("gradaudit.__main__",),
    ("gradaudit.cli",),
    ("gradaudit.report",),
    ("gradaudit.integrations",),
    # Siblings: none imports another.
    ("gradaudit.comparison", "gradaudit.trend", "gradaudit.training"),
    ("gradaudit.scan",),
    ("gradaudit.io",),
    ("gradaudit.engine",),
    # The bottom: result types, policy, errors and small host-side helpers. They may import
    # each other (no cycle); they import no stage above.
    (
        "gradaudit.results",
        "gradaudit.roles",
        "gradaudit.grouping",
        "gradaudit.precision",
        "gradaudit.selection",
        "gradaudit.policy",
        "gradaudit.errors",
        "gradaudit._compat",
        "gradaudit.no_gc",
    ),
)
#: The bottom layer's parts may import one another.
SHARED = len(LAYERS) - 1
#: The public facade: ``gradaudit/__init__.py`` resolves every public name on first use
#: (PEP 562), so it sits above everything; the subpackages import only its
#: ``_submodules`` helper, which imports nothing.
FACADE = "gradaudit"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _place(name: str) -> tuple[int, str] | None:
    """``(layer, part)`` of a module, or None for the facade."""
    for layer, parts in enumerate(LAYERS):
        for part in parts:
            if name == part or name.startswith(part + "."):
                return layer, part
    return None


def _imports(path: Path, name: str, modules: set[str]) -> Iterator[tuple[str, int, str]]:
    """``(target module, line, how)`` for each gradaudit import; how: top, lazy or typing."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def targets(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            return
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([node.module] if node.module else []))
        for alias in node.names:
            full = f"{base}.{alias.name}"
            yield full if full in modules else base

    def walk(node: ast.AST, how: str) -> Iterator[tuple[str, int, str]]:
        for child in ast.iter_child_nodes(node):
            child_how = how
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                child_how = "lazy" if how == "top" else how
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for statement in child.body:
                    yield from walk(ast.Module(body=[statement], type_ignores=[]), "typing")
                for statement in child.orelse:
                    yield from walk(ast.Module(body=[statement], type_ignores=[]), how)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(child):
                    if target == FACADE or target.startswith(FACADE + "."):
                        yield target, child.lineno, child_how
            yield from walk(child, child_how)

    yield from walk(tree, "top")


def problems(package: Path) -> list[str]:
    """Every wrong-way import, unplaced module and runtime import cycle under ``package``."""
    paths = {_module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    # The C extensions (``_native.c`` builds ``gradaudit.engine._native``) import nothing.
    modules = set(paths) | {_module_name(p, package) for p in package.rglob("*.c")}
    found: list[str] = []
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in paths.items():
        source = _place(name)
        if source is None and name != FACADE:
            found.append(f"{name}: in no layer (add it to LAYERS in .ci/layers.py)")
            continue
        for target, line, how in _imports(path, name, modules):
            if target not in paths:
                continue
            if how != "typing" and target != FACADE:
                graph[name].add(target)
            if source is None:  # the facade imports anything, lazily
                continue
            if target == FACADE:
                continue
            place = _place(target)
            if place is None:
                continue
            (layer, part), (target_layer, target_part) = source, place
            upward = target_layer < layer
            sibling = target_layer == layer and part != target_part and layer != SHARED
            if upward or sibling:
                where = f"{paths[name].relative_to(package.parent)}:{line}"
                arrow = "up" if upward else "sideways"
                found.append(f"{where}: {name} imports {target} ({how}, {arrow})")
    found.extend(f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph))
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def main() -> int:
    package = Path(__file__).resolve().parent.parent / "gradaudit"
    found = problems(package)
    for line in found:
        print(f"layers: {line}")
    if not found:
        print(f"layers: {len(LAYERS)} layers, every import points down, no import cycle")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
