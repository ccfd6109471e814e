"""The real `paged-chat` (or a script that runs its CLI) in a tmux pane, for the tests that
drive it as a user does."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_for

_SERVERS = itertools.count()


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


class TmuxApp:
    """The real `paged-chat` (python -m paged_chat, or `command`) in a tmux pane (120x40
    unless `size` says otherwise), with its own config and chat store under `tmp_path`;
    `model` is [engine] model there."""

    def __init__(self, model: Path | str, tmp_path: Path, max_tokens: int,
                 size: tuple[int, int] = (120, 40), command: str | None = None) -> None:
        config = tmp_path / "config.toml"
        config.write_text(f'[engine]\nmodel = "{model}"\ndevice = "cpu"\ndtype = "float32"\n'
                          f'num_blocks = 512\n\n[chat]\ntemperature = 0.0\nmax_tokens = {max_tokens}\n')
        self.store_path = tmp_path / "data" / "chats.db"
        # Without COLUMNS/LINES (set by pytest plugins): Textual would take them over the pane's size.
        env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
        env = {**env, "PAGED_CHAT_CONFIG": str(config), "PAGED_CHAT_DATA_DIR": str(tmp_path / "data"),
               "PAGED_CHAT_CACHE_DIR": os.environ["PAGED_CHAT_CACHE_DIR"], "TERM": "xterm-256color"}
        # A server of its own per app: the last test's server may still be exiting.
        self.session = f"paged-chat-test-{os.getpid()}-{next(_SERVERS)}"
        self.socket = ["-L", self.session]
        started = subprocess.run(
            ["tmux", *self.socket, "new-session", "-d", "-s", self.session, "-x", str(size[0]), "-y", str(size[1]),
             *[arg for key in ("PAGED_CHAT_CONFIG", "PAGED_CHAT_DATA_DIR",
                               "PAGED_CHAT_CACHE_DIR", "HF_HUB_OFFLINE", "TERM")
               for arg in ("-e", f"{key}={env[key]}")],
             command or f"{sys.executable} -m paged_chat"], env=env, capture_output=True, text=True)
        assert started.returncode == 0, f"tmux could not start the app: {started.stderr.strip()}"

    def screen(self) -> str:
        return tmux(*self.socket, "capture-pane", "-p", "-t", self.session)

    def keys(self, *keys: str, literal: bool = False) -> None:
        tmux(*self.socket, "send-keys", "-t", self.session, *(["-l"] if literal else []), *keys)

    def send(self, text: str) -> None:
        """Type `text` into the shown tab's prompt and, once it is on screen (in that
        prompt, not queued behind a tab switch), press Enter."""
        self.keys(text, literal=True)
        self.wait_for(lambda screen: text in screen)
        self.keys("Enter")

    def new_chat(self) -> None:
        """Ctrl+N, then wait until the new, empty tab is the one shown."""
        self.keys("C-n")
        self.wait_for(new_tab_shown)

    def wait_for(self, predicate, timeout: float = 180.0) -> str:
        """The screen once `predicate` holds for it (a generous bound: the machine may be
        busy, and nothing here depends on time)."""
        seen = {"screen": ""}

        def shown() -> bool:
            seen["screen"] = self.screen()
            return predicate(seen["screen"])

        wait_for(shown, timeout, what=lambda: f"the screen was:\n{seen['screen']}", every=0.1)
        return seen["screen"]

    def kill_server(self) -> None:
        subprocess.run(["tmux", *self.socket, "kill-server"], capture_output=True)


def new_tab_shown(screen: str) -> bool:
    """Chat 2's empty tab is on screen: the handler that showed it also asked for its
    prompt's focus, so keys sent from now on land in it."""
    return "Chat 2" in screen and "╭─ you" not in screen


needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (apt-get install tmux)")
