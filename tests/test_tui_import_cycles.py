"""Issue 45 item 6: the TUI's modules import each other one way (app <-> start and
engine_panel <-> legend did not), counting every import: at the top, under TYPE_CHECKING
and inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

TUI = Path(__file__).resolve().parents[1] / "paged_chat" / "tui"
PACKAGE = "paged_chat.tui"


def tui_imports(source: str) -> set[str]:
    """The paged_chat.tui modules a source imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:
                found |= {alias.name for alias in node.names}
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module.removeprefix(PACKAGE + ".").partition(".")[0])
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix(PACKAGE + ".").partition(".")[0]
                      for alias in node.names if alias.name.startswith(PACKAGE + ".")}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle of `graph` (module -> the modules it imports), found once."""
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            found.append(path[path.index(module):] + [module])
            return
        if module in done:
            return
        for imported in sorted(graph.get(module, ())):
            visit(imported, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return found


def test_the_tuis_modules_import_each_other_one_way():
    graph = {path.stem: tui_imports(path.read_text(encoding="utf-8")) - {path.stem}
             for path in TUI.glob("*.py")}
    assert not cycles(graph)


def test_a_cycle_through_type_checking_or_a_function_is_found():
    app = ("from typing import TYPE_CHECKING\n"
           "if TYPE_CHECKING:\n    from paged_chat.tui.start import run_app\n")
    start = "def run_app():\n    from paged_chat.tui.app import PagedChatApp\n"
    graph = {"app": tui_imports(app), "start": tui_imports(start)}
    assert cycles(graph) == [["app", "start", "app"]]
