"""What the CLI shows in words: `--help` of every command (flags show no `<bool>`
placeholder, as if they took a value, and no Python type name such as `<FileText>`), and
how a stored reply ended, in the TUI's words (`stopped`, not `abort`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from paged_chat.app.chat_store import ChatStore
from paged_chat.cli.main import app


def command_paths(command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command's words (typer builds its commands on its own copy of click)."""
    paths = [path]
    if hasattr(command, "list_commands"):
        ctx = command.context_class(command)
        for name in command.list_commands(ctx):
            paths += command_paths(command.get_command(ctx, name), (*path, name))
    return paths


@pytest.mark.timeout(60)
def test_help_shows_no_bool_or_python_type_placeholders():
    paths = command_paths(typer.main.get_command(app))
    assert ("ask",) in paths and ("chats", "delete") in paths
    for path in paths:
        result = CliRunner().invoke(app, [*path, "--help"], terminal_width=100)
        assert result.exit_code == 0, (path, result.output)
        assert "--help" in result.output
        for placeholder in ("<bool>", "<FileText>", "<TextIOWrapper>"):
            assert placeholder not in result.output, (path, placeholder)


@pytest.mark.timeout(60)
def test_chats_show_says_stopped_as_the_tui_does(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("PAGED_CHAT_CONFIG", str(tmp_path / "config.toml"))
    with ChatStore(tmp_path / "chats.db") as store:
        chat = store.create_chat("Stopped one", "tiny", None, {})
        store.add_message(chat.id, "user", "tell me a long story", [1])
        store.add_message(chat.id, "assistant", "Once upon", [2], "abort")
        store.add_message(chat.id, "user", "and another", [3])
        store.add_message(chat.id, "assistant", "Twice", [4], "length")
    result = CliRunner().invoke(app, ["chats", "show", chat.id])
    assert result.exit_code == 0, result.output
    assert "## Assistant (stopped)" in result.output and "## Assistant (max tokens)" in result.output
    assert "abort" not in result.output and "## User\n" in result.output
    # The README says what a stopped reply looks like there: the very heading printed above.
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    said = re.findall(r"`chats show` prints `([^`]+)`", readme)
    assert said and all(heading in result.output for heading in said), said


@pytest.mark.timeout(60)
@pytest.mark.parametrize("system_prompt, has", [(None, "has no system prompt"),
                                                ("Be brief.", "has the system prompt 'Be brief.'")])
def test_continuing_with_another_system_prompt_says_what_the_chat_has(tmp_path, monkeypatch,
                                                                       system_prompt, has):
    monkeypatch.setenv("PAGED_CHAT_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("PAGED_CHAT_CONFIG", str(tmp_path / "config.toml"))
    with ChatStore(tmp_path / "chats.db") as store:
        chat = store.create_chat("Plain", "tiny", system_prompt, {})
        store.add_message(chat.id, "user", "hi", [1])
        store.add_message(chat.id, "assistant", "hello", [2], "stop")
    result = CliRunner().invoke(app, ["ask", "-c", "-s", "Be a pirate", "hi"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"Error: chat {chat.id} {has} and --system would change it: "
                                     "drop --system to continue it, or start a new chat without -c")


def _command(path: tuple[str, ...]):
    command = typer.main.get_command(app)
    for name in path:
        command = command.get_command(command.context_class(command), name)
    return command


def _in_order(words: list[str], within: list[str]) -> bool:
    rest = iter(within)
    return all(word in rest for word in words)


def _breaks_early(lines: list[str], width: int, indent: int = 0) -> list[str]:
    """Lines a paragraph wraps after although the next line's first word would have fit
    (the next line goes on the paragraph where its first `indent` columns are blank)."""
    return [a for a, b in zip(lines, lines[1:])
            if a.strip() and b.strip() and not b[:indent].strip()
            and len(a.rstrip()) + 1 + len(b.split()[0]) <= width]


@pytest.mark.timeout(120)
def test_help_wraps_cleanly_at_80_columns():
    """Every command's help at 80 columns: no line wider, nothing cut with an ellipsis, every
    option's help whole and in order, and no paragraph (the description, a command's line in
    the list) broken before a word that fits."""
    for path in command_paths(typer.main.get_command(app)):
        result = CliRunner().invoke(app, [*path, "--help"], terminal_width=80, env={"COLUMNS": "80"})
        assert result.exit_code == 0, (path, result.output)
        lines = result.output.splitlines()
        assert max(map(len, lines)) <= 80 and "…" not in result.output, (path, result.output)
        shown = result.output.replace("│", " ").split()
        for param in _command(path).params:
            if getattr(param, "help", None):
                words = param.help.replace("`", "").split()  # Markdown shows a `code` span bare
                assert _in_order(words, shown), (path, param.name, result.output)
        description = lines[:next(i for i, line in enumerate(lines) if line.startswith("╭"))]
        assert not _breaks_early(description, 78), (path, result.output)
        if "╭─ Commands" in result.output:
            start = next(i for i, line in enumerate(lines) if line.startswith("╭─ Commands"))
            end = next(i for i in range(start, len(lines)) if lines[i].startswith("╰"))
            cells = [line[1:-1] for line in lines[start + 1:end]]
            assert not _breaks_early(cells, 77, indent=3), (path, result.output)
