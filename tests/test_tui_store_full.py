"""Issue 31 item 4, the TUI's part: a reply the chat store cannot save (its disk full) stays
on screen, its footer says it is unsaved, and the user is told why."""

from __future__ import annotations

import pytest

from paged_chat.chat_store import StoreFullError
from helpers import wait_until
from tui_helpers import idle, make_app, replies, type_prompt


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
