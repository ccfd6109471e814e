"""The package's layers, read from its imports: no module imports another that imports it back
(directly or around a loop), and imports point down: the engine never imports a front end,
its core never imports its clients, attention never imports the models, and nothing in the
package imports benchmarks/ (not shipped: such an import fails in an installed copy)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "paged_chat"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" or (
        isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")


def imported_names(path: Path) -> set[str]:
    """The dotted names `path` imports (`from a import b`: a and a.b), anywhere in it (a
    function's import too), but not under `if TYPE_CHECKING:`, which never runs."""
    found: set[str] = set()
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}".rstrip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found - {own}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imported_names(path) & set(paths) for name, path in paths.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def _package_faces(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph without a package's `__init__` as a hop: a package that hands on names
    (engine/__init__.py, loaded on first use) is not a module's dependency on its siblings."""
    faces = {name for name in graph if (PACKAGE.parent / name.replace(".", "/") / "__init__.py").is_file()}
    return {name: targets - faces for name, targets in graph.items() if name not in faces}


def test_no_module_imports_itself_around_a_loop():
    assert cycles(_package_faces(import_graph())) == []


def test_the_cycle_finder_finds_a_loop():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize(("layer", "forbidden"), [
    ("paged_chat.engine", ("paged_chat.app", "paged_chat.cli", "paged_chat.tui",
                           "paged_chat.server", "paged_chat.bench")),
    ("paged_chat.engine.core", ("paged_chat.engine.clients",)),
    ("paged_chat.engine.attention", ("paged_chat.engine.models",)),
    ("paged_chat", ("benchmarks",)),
])
def test_imports_point_down(layer: str, forbidden: tuple[str, ...]):
    paths = [path for path in PACKAGE.rglob("*.py") if module_name(path).startswith(layer)]
    below = tuple(f"{name}." for name in forbidden)
    wrong = {module_name(path): sorted(name for name in imported_names(path)
                                       if name in forbidden or name.startswith(below))
             for path in paths}
    assert {name: targets for name, targets in wrong.items() if targets} == {}
