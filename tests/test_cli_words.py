"""What the CLI shows in words: `--help` of every command (flags show no `<bool>`
placeholder, as if they took a value, and no Python type name such as `<FileText>`), and
how a stored reply ended, in the TUI's words (`stopped`, not `abort`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from paged_chat.chat_store import ChatStore
from paged_chat.cli import app


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
