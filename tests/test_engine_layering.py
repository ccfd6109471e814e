"""The engine's layers import downwards only, read from each module's import statements."""

from __future__ import annotations

import ast
from pathlib import Path

import paged_chat

PACKAGE = Path(paged_chat.__file__).parent


def imported_modules(folder: Path) -> dict[str, set[str]]:
    """Every module under `folder` (a path relative to it) -> the absolute module names it
    imports, at any depth (TYPE_CHECKING and function-level imports included)."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[str(path.relative_to(folder))] = names
    return found


def offending(folder: Path, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    return {module: sorted(name for name in names if name.startswith(forbidden))
            for module, names in imported_modules(folder).items()
            if any(name.startswith(forbidden) for name in names)}


def test_engine_core_imports_nothing_from_the_clients() -> None:
    assert offending(PACKAGE / "engine" / "core", ("paged_chat.engine.clients",)) == {}


def test_attention_imports_nothing_from_the_models() -> None:
    assert offending(PACKAGE / "engine" / "attention", ("paged_chat.engine.models",)) == {}


def test_the_engine_imports_no_front_end() -> None:
    front_ends = tuple(f"paged_chat.{name}" for name in ("app", "tui", "cli", "server", "bench"))
    assert offending(PACKAGE / "engine", front_ends) == {}
