"""The real `paged-chat` in a tmux pane: two tabs streaming, and a kill -9 that keeps every
committed message."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest
from helpers import wait_for
from tmux_app import TmuxApp, needs_tmux, new_tab_shown, tmux

from paged_chat.app.chat_store import ChatStore
from paged_chat.tui.actions import ACTIONS


@pytest.mark.timeout(600)
@needs_tmux
def test_paged_chat_in_tmux(chat_model_dir, tmp_path):
    app = TmuxApp(chat_model_dir, tmp_path, max_tokens=24)
    try:
        app.wait_for(lambda s: "ready" in s and "KV cache" in s)
        app.send("hello from tmux one")
        app.wait_for(lambda s: "24 tok" in s)
        app.new_chat()
        app.send("second tab says hi")
        text = app.wait_for(lambda s: "second tab says hi" in s and "24 tok" in s)
        assert "hello from tmux one" in text          # the first tab's title
        assert "assistant" in text and "blocks × 16" in text
        app.keys("C-q")
        app.wait_for(lambda s: "KV cache" not in s)
    finally:
        app.kill_server()
    store = ChatStore(app.store_path)
    chats = store.list_chats()
    assert sorted(c.title for c in chats) == ["hello from tmux one", "second tab says hi"]
    for chat in chats:
        roles = [m.role for m in store.get_chat(chat.id).messages]
        assert roles == ["user", "assistant"]
    store.close()


@pytest.mark.timeout(600)
@needs_tmux
def test_kill_9_while_two_tabs_stream_keeps_every_committed_message(chat_model_dir, tmp_path):
    app = TmuxApp(chat_model_dir, tmp_path, max_tokens=4000)
    try:
        app.wait_for(lambda s: "ready" in s and "KV cache" in s)
        app.send("first long reply")
        app.new_chat()
        app.send("second long reply")
        # Both replies stream; the TUI saves them as they grow. Kill once each has been saved.
        wait_for_store(app.store_path, lambda saved: saved == {"first long reply", "second long reply"})
        pid = tmux(*app.socket, "display-message", "-p", "-t", app.session, "#{pane_pid}").strip()
        os.kill(int(pid), signal.SIGKILL)
    finally:
        app.kill_server()
    store = ChatStore(app.store_path)
    chats = {c.title: store.get_chat(c.id) for c in store.list_chats()}
    assert set(chats) == {"first long reply", "second long reply"}
    for chat in chats.values():
        user, reply = chat.messages
        assert user.role == "user" and user.content == chat.title and user.token_ids
        assert reply.role == "assistant" and reply.finish_reason == "interrupted"
        assert reply.content and reply.token_ids, "the partial reply is kept"
    store.close()


def wait_for_store(path: Path, predicate, timeout: float = 240.0) -> None:
    """Wait until `predicate` holds for the titles of the chats with saved reply tokens."""
    saved: set[str] = set()

    def holds() -> bool:
        saved.clear()
        saved.update(_saved_replies(path))
        return predicate(saved)

    wait_for(holds, timeout, what=lambda: f"replies saved so far: {saved}", every=0.2)


def _saved_replies(path: Path) -> set[str]:
    """Titles of the chats whose streaming reply already has tokens in the store."""
    if not path.exists():
        return set()
    with ChatStore(path) as store:
        return {chat.title for chat in store.list_chats()
                if any(m.role == "assistant" and m.token_ids for m in store.get_chat(chat.id).messages)}


@pytest.mark.timeout(600)
@needs_tmux
def test_at_80x24_a_first_start_shows_a_fresh_tab_and_only_whole_words(chat_model_dir, tmp_path):
    """Issue 32, items 8 and 14, as the user met them: a first start at 80x24 with an `ask`
    chat in the store (its sampling as `ask` keeps it, seed None; its reply stopped)."""
    with ChatStore(tmp_path / "data" / "chats.db") as store:
        essay = "Write a long essay about the history of Rome."
        chat = store.create_chat(essay, "smollm2-135m", None,
                                 {"max_tokens": 300, "seed": None, "temperature": 0.7})
        store.add_message(chat.id, "user", essay, [1])
        store.add_message(chat.id, "assistant", "Rome began as a small town on the Tiber.",
                          [2], "abort", {"ttft_s": 0.27, "tokens_per_s": 12.3})
    app = TmuxApp(chat_model_dir, tmp_path, max_tokens=8, size=(80, 24))
    try:
        screen = app.wait_for(lambda s: "ready" in s)
        # Item 14: the latest chat comes back in a tab beside a new, empty one, which is shown.
        assert "Chat 2" in screen and "Rome began" not in screen, screen
        *_, status, footer = screen.rstrip("\n").split("\n")
        # Item 8: the status line and the footer show whole parts and whole labels.
        assert not status.rstrip().endswith("·"), status
        words = {word for _, keys, label, _, _ in ACTIONS for word in re.findall(r"[A-Za-z]+", label)}
        shown = {word for word in re.findall(r"[A-Za-z]+", footer) if len(word) > 1}   # not ^n's n
        assert shown <= words | {"esc", "palette"}, footer
        app.keys("M-Left")   # the chat `ask` left
        screen = app.wait_for(lambda s: "Rome began" in s)
        assert "None" not in screen and "seed" not in screen, screen
        assert "max_tokens=300, temperature=0.7" in screen, screen
        # The panel over a narrow chat: a reply's footer fits its bubble, in whole parts.
        app.keys("F8")
        app.keys("M-Right")
        app.wait_for(lambda s: "KV cache" in s and "Rome began" not in s)
        app.send("hi")
        def reply_bottoms(screen: str) -> list[str]:
            chat_column = [line.split("▏")[0] for line in screen.split("\n")]
            return [line for line in chat_column if "╰" in line and "max tokens" in line]

        screen = app.wait_for(lambda s: reply_bottoms(s))
        [bottom] = reply_bottoms(screen)
        assert "…" not in bottom, screen
        app.keys("C-q")
        app.wait_for(lambda s: "KV cache" not in s)
    finally:
        app.kill_server()


@pytest.mark.timeout(600)
@needs_tmux
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_restores_the_terminal_and_saves_the_reply_as_stopped(chat_model_dir, tmp_path,
                                                                            signum):
    # A shell in the pane keeps the app's exit status (tmux's pane_dead_status is at times unset).
    status = tmp_path / "status"
    app = TmuxApp(chat_model_dir, tmp_path, max_tokens=4000,
                  command=f"sh -c '{sys.executable} -m paged_chat; echo $? > {status}; sleep 600'")
    try:
        app.wait_for(lambda s: "ready" in s and "KV cache" in s)
        app.send("a long reply")
        wait_for_store(app.store_path, lambda saved: saved == {"a long reply"})
        shell = tmux(*app.socket, "display-message", "-p", "-t", app.session, "#{pane_pid}").strip()
        [paged_chat] = Path(f"/proc/{shell}/task/{shell}/children").read_text().split()
        os.kill(int(paged_chat), signum)
        wait_for(lambda: status.exists() and status.read_text().strip(), 120, what="the app to exit")
        terminal = tmux(*app.socket, "display-message", "-p", "-t", app.session,
                        "#{alternate_on} #{mouse_any_flag}").split()
        assert (status.read_text().strip(), terminal) == (str(128 + signum), ["0", "0"])
    finally:
        app.kill_server()
    with ChatStore(app.store_path) as store:
        [chat] = store.list_chats()
        user, reply = store.get_chat(chat.id).messages
    assert user.content == "a long reply"
    assert reply.finish_reason == "abort" and reply.content, "saved as stopped, as Ctrl+Q does"
