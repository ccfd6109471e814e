"""What the TUI does with a turn the chat store does not hold (issue 31): a reply the store
cannot save (its disk full, item 4) stays on screen, its footer says it is unsaved, and the
user is told why; a message whose engine stopped before a word (item 10) goes back into the
prompt, and nothing of it is stored."""

from __future__ import annotations

import pytest
from helpers import wait_until
from tui_helpers import idle, make_app, replies, type_prompt

from paged_chat.app.chat_store import StoreFullError
from paged_chat.engine.core.errors import EngineDeadError
from paged_chat.tui.message_widgets import UserMessage


@pytest.mark.timeout(90)
async def test_a_reply_the_full_disk_refuses_stays_on_screen_marked_unsaved(engine, tmp_path,
                                                                          monkeypatch):
    app = make_app(engine, tmp_path)
    notices: list[str] = []
    async with app.run_test(size=(120, 40)) as pilot:
        tab = app.active_tab
        monkeypatch.setattr(app, "notify", lambda message, **_: notices.append(str(message)))

        def full(*args, **kwargs):
            raise StoreFullError("database or disk is full", tmp_path / "chats.db")

        monkeypatch.setattr(app.store, "update_message", full)
        await type_prompt(pilot, "tell me about paging")
        await wait_until(lambda: replies(tab) and idle(app) and tab.session.turn is not None
                         and tab.session.turn.finished, timeout=60)
        [reply] = replies(tab)
        assert reply.text and reply.text == tab.session.turn.text
        assert "unsaved" in reply.footer, reply.footer
        assert any("could not be saved" in notice and "full" in notice for notice in notices)


@pytest.mark.timeout(90)
async def test_a_message_whose_engine_stops_before_a_word_goes_back_to_the_prompt(
        engine, tmp_path, monkeypatch):
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        tab = app.active_tab

        async def killed(*args, **kwargs):
            raise EngineDeadError("the engine process exited unexpectedly (exit code -9)")
            yield  # an async generator, as EngineClient.stream is

        monkeypatch.setattr(engine, "stream", killed)
        await type_prompt(pilot, "tell me about paging")
        await wait_until(lambda: tab.session.turn is not None and tab.session.turn.withdrawn
                         and idle(app) and tab.prompt.text == "tell me about paging", timeout=60,
                         what=lambda: f"prompt {tab.prompt.text!r}")
        assert not tab.query(UserMessage) and not replies(tab)
        # The tab's first turn wrote its chat; withdrawn, it leaves no empty chat behind.
        assert tab.session.chat_id not in {chat.id for chat in app.store.list_chats()}


@pytest.mark.timeout(120)
async def test_a_regenerate_whose_engine_stops_before_a_word_shows_the_old_reply_again(
        engine, tmp_path, monkeypatch):
    """Ctrl+R, and the engine dies before the new reply's first word: the reply it was to
    replace comes back on screen (the store still holds it), not an empty error reply."""
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        tab = app.active_tab
        await type_prompt(pilot, "tell me about paging")
        await wait_until(lambda: replies(tab) and idle(app) and tab.session.turn is not None
                         and tab.session.turn.finished, timeout=60)
        [old] = replies(tab)
        old_text = old.text
        assert old_text

        async def killed(*args, **kwargs):
            raise EngineDeadError("the engine process exited unexpectedly (exit code -9)")
            yield  # an async generator, as EngineClient.stream is

        monkeypatch.setattr(engine, "stream", killed)
        assert tab.regenerate()
        await wait_until(lambda: tab.session.turn.withdrawn and idle(app) and not tab.streaming,
                         timeout=60)
        assert [reply.text for reply in replies(tab)] == [old_text]
        assert len(tab.query(UserMessage)) == 1 and not tab.prompt.text
        stored = app.store.get_chat(tab.session.chat_id).messages
        assert [(m.role, m.content) for m in stored] == [("user", "tell me about paging"),
                                                         ("assistant", old_text)]
