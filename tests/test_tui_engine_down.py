"""Issue 31, item 10: the TUI when its engine child stops. A `kill -9` of the child, then a
SIGSTOP of the restarted one, on the app's real engine process (a tiny model)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from helpers import engine_config, wait_until
from tui_helpers import TuiTestApp, idle, make_settings, press, replies, text_of, type_prompt

from paged_chat.app.chat_store import ChatStore


def status(app) -> str:
    return text_of(app.query_one("#status"))


def stored(app, chat_id: str) -> list[tuple[str, str, str | None]]:
    return [(m.role, m.content, m.finish_reason) for m in app.store.get_chat(chat_id).messages]


@pytest.mark.timeout(400)
async def test_a_killed_then_a_stopped_engine_child_is_told_restarted_and_quit_past(
        chat_model_dir, tmp_path):
    await kill_restart_stop_and_quit(chat_model_dir, tmp_path)


@pytest.mark.perf
@pytest.mark.timeout(400)
async def test_quitting_past_a_stopped_engine_child_is_fast(chat_model_dir, tmp_path):
    quit_s = await kill_restart_stop_and_quit(chat_model_dir, tmp_path)
    assert quit_s < 2.0, f"Ctrl+Q took {quit_s:.1f} s with the engine child stopped"


async def kill_restart_stop_and_quit(chat_model_dir, tmp_path) -> float:
    """The engine child killed (the app says so, F5 restarts it, the kept message goes),
    then stopped (SIGSTOP: "not responding"), then Ctrl+Q, which kills it rather than
    waiting on it; the seconds the quit took."""
    app = TuiTestApp(make_settings(max_tokens=4000), engine_config=engine_config(chat_model_dir),
                     store=ChatStore(tmp_path / "chats.db"), session_path=tmp_path / "s.json")
    pids: list[int] = []
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_until(lambda: app.engine is not None, timeout=120)
            engine, tab = app.engine, app.active_tab
            pids.append(engine.transport.pid)
            await type_prompt(pilot, "a long reply")
            await wait_until(lambda: engine.stats().num_running == 1 and replies(tab)[0].text,
                             timeout=60)

            os.kill(pids[0], signal.SIGKILL)
            # Until the reader has seen the exit, the heartbeat's silence may read "not
            # responding" for a moment: the dead child's own line is the one to wait for.
            await wait_until(lambda: "exit code" in status(app), what=lambda: status(app))
            assert "ready" not in status(app) and "exit code -9" in status(app)
            assert "has stopped" in status(app)
            assert "f5 restarts it" in status(app)
            numbers = text_of(app.query_one("#numbers"))
            assert "running 1" not in numbers and "stopped" in numbers
            await wait_until(lambda: idle(app))
            assert replies(tab)[0].text, "the partial reply stays on screen"

            before = stored(app, tab.chat_id)
            await type_prompt(pilot, "sent to a dead engine")
            assert tab.prompt.text == "sent to a dead engine", "what the user wrote is kept"
            assert not tab.streaming and stored(app, tab.chat_id) == before
            assert ("assistant", "", "error") not in stored(app, tab.chat_id)

            await press(pilot, "f5")   # restarts the engine, not the app
            await wait_until(lambda: engine.running and app.engine_trouble() is None
                             and "ready" in status(app), timeout=120, what=lambda: status(app))
            pids.append(engine.transport.pid)
            assert pids[1] != pids[0] and app.engine is engine and app.active_tab is tab
            tab.session.sampling = {"max_tokens": 4}
            await press(pilot, "enter")   # the kept message goes now
            await wait_until(lambda: tab.prompt.text == "" and idle(app), timeout=60)
            assert stored(app, tab.chat_id)[-2][:2] == ("user", "sent to a dead engine")
            assert stored(app, tab.chat_id)[-1][0] == "assistant" and stored(app, tab.chat_id)[-1][1]

            os.kill(pids[1], signal.SIGSTOP)
            await wait_until(lambda: "not responding" in status(app), timeout=30,
                             what=lambda: status(app))
            assert "ready" not in status(app)
            await type_prompt(pilot, "sent to a stopped engine")
            assert tab.prompt.text == "sent to a stopped engine"
            quit_at = time.monotonic()
            await press(pilot, "ctrl+q")
        quit_s = time.monotonic() - quit_at
        assert engine.transport._process.exitcode == -signal.SIGKILL and not engine.running
        return quit_s
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)




async def test_the_app_restarts_and_watches_any_client_whose_capabilities_say_it_can(
        chat_model_dir, tmp_path):
    """Issue 45 item 6: the app asked isinstance(LocalClient) whether it could restart an
    engine and see it hang; it asks the client's capabilities (`restart`) now. A client
    without it is told to be restarted where it runs."""
    from dataclasses import replace

    from test_tui_streaming import FedClient, fed_app

    from paged_chat.app.settings import Settings
    from paged_chat.tui.app import PagedChatApp

    class RestartableClient(FedClient):
        def __init__(self, engine) -> None:
            super().__init__(engine)
            self.responding = True
            self.restarts: list[float] = []

        @property
        def capabilities(self):
            return replace(super().capabilities, restart=True)

        def restart(self, timeout_s: float) -> None:
            self.restarts.append(timeout_s)

    app, fed = fed_app(chat_model_dir, tmp_path / "fed")
    async with app.run_test(size=(120, 40)):
        await wait_until(lambda: app.engine is not None)
        notes: list[str] = []
        app.notify = lambda message, **options: notes.append(message)
        app.restart_engine()
        assert not app.engine_trouble() and notes == ["a remote engine is restarted where it runs"]
    client = RestartableClient(fed.engine)
    app = PagedChatApp(Settings(), engine=client, store=ChatStore(tmp_path / "chats.db"),
                       session_path=tmp_path / "s.json")
    async with app.run_test(size=(120, 40)):
        await wait_until(lambda: app.engine is not None)
        client.responding = False
        assert "not responding" in app.engine_trouble()
        client.responding = True
        app.restart_engine()
        await wait_until(lambda: client.restarts and not app.engine_trouble())
