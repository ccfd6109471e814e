"""Issue 45 item 3: the package uses Textual through its public API. Only
paged_chat/tui/textual_compat.py (version-guarded) imports a `textual._` module or touches a
Textual private attribute; the compat module's overrides apply on the Textual it was written
for and fall back to stock behaviour on any other."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from functools import cache
from pathlib import Path

import pytest
import textual

PACKAGE = Path(__file__).resolve().parents[1] / "paged_chat"
COMPAT = PACKAGE / "tui" / "textual_compat.py"
PRIVATE_MODULE = re.compile(r"\btextual(\.\w+)*\._\w")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _self_privates(tree: ast.AST) -> set[str]:
    """The private names a source assigns or reads on `self`, or defines in a class body."""
    names = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and _is_private(node.attr)):
            names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(item.name):
                    names.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names |= {t.id for t in targets if isinstance(t, ast.Name) and _is_private(t.id)}
    return names


@cache
def textual_privates() -> frozenset[str]:
    """Every private name Textual's own source uses on its objects."""
    root = Path(textual.__file__).parent
    return frozenset().union(*(_self_privates(ast.parse(path.read_text(encoding="utf-8")))
                               for path in root.rglob("*.py")))


@cache
def _class_privates(cls: type) -> frozenset[str]:
    """The private names of `cls`'s Textual bases: their attributes and what they set on self."""
    names: set[str] = set()
    for base in cls.__mro__:
        if not base.__module__.startswith("textual"):
            continue
        names |= {name for name in vars(base) if _is_private(name)}
        try:
            names |= _self_privates(ast.parse(inspect.getsource(base)))
        except (OSError, TypeError, SyntaxError, IndentationError):
            pass
    return frozenset(names)


def private_uses(source: str, module: str, own: set[str]) -> list[str]:
    """Where `source` (the module `module`) imports a textual._ module or touches a Textual
    private: on self in a class with a Textual base (reading, setting or overriding it), or
    on any other object a name that Textual has and the package's own code never defines
    (`own`)."""
    found = [f"{module}:{number}: {line.strip()}" for number, line
             in enumerate(source.splitlines(), 1) if PRIVATE_MODULE.search(line)]
    tree = ast.parse(source)
    modules = {alias.asname or alias.name.partition(".")[0] for node in ast.walk(tree)
               if isinstance(node, ast.Import) for alias in node.names
               if not alias.name.startswith("textual")}   # os._exit is not Textual's
    loaded = importlib.import_module(module) if "textual" in source else None

    def visit(node: ast.AST, cls: type | None) -> None:
        if isinstance(node, ast.ClassDef):
            owner = getattr(cls or loaded, node.name, None) if loaded is not None else None
            cls = owner if isinstance(owner, type) else None
            privates = _class_privates(cls) if cls is not None else frozenset()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in privates:
                    found.append(f"{module}:{item.lineno}: overrides {node.name}.{item.name}")
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            target = node.value.id if isinstance(node.value, ast.Name) else None
            if target == "self":
                if cls is not None and node.attr in _class_privates(cls):
                    found.append(f"{module}:{node.lineno}: self.{node.attr}")
            elif (target not in modules and node.attr in textual_privates()
                  and node.attr not in own):
                found.append(f"{module}:{node.lineno}: .{node.attr}")
        for child in ast.iter_child_nodes(node):
            visit(child, cls)

    visit(tree, None)
    return found


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_no_module_but_the_compat_one_touches_textuals_privates():
    paths = [path for path in sorted(PACKAGE.rglob("*.py")) if path != COMPAT]
    sources = {path: path.read_text(encoding="utf-8") for path in paths}
    own = set().union(*(_self_privates(ast.parse(source)) for source in sources.values()))
    found = [use for path, source in sources.items()
             for use in private_uses(source, _module_name(path), own)]
    assert not found, "\n".join(found)


BAD_USES = {
    "a private module": "from textual.widgets._footer import FooterKey\n",
    "a private attribute of a widget": (
        "from textual.widgets import Tab\n"
        "def relabel(header: Tab) -> None:\n    header._label = 'x'\n"),
    "a private attribute set on self": (
        "from textual.screen import Screen\n"
        "class Shown(Screen):\n    def __init__(self):\n"
        "        super().__init__()\n        self._compositor = None\n"),
    "a private method overridden": (
        "from textual.widgets import Static\n"
        "class Shown(Static):\n    def _on_mount(self, event):\n        pass\n"),
}


@pytest.mark.parametrize("source", BAD_USES.values(), ids=BAD_USES.keys())
def test_the_check_finds_each_kind_of_private_use(source, tmp_path, monkeypatch):
    (tmp_path / "bad_textual_use.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert private_uses(source, "bad_textual_use", own=set())
    finally:
        sys.modules.pop("bad_textual_use", None)


def test_the_checks_own_attributes_pass():
    source = ("from textual.widgets import Static\n"
              "class Shown(Static):\n    def __init__(self):\n"
              "        super().__init__()\n        self._shown_text = ''\n")
    assert not private_uses(source, "paged_chat.tui.chat_screen", own={"_shown_text"})
