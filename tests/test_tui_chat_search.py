"""The TUI's palette finds stored chats by the words in them (the store's full-text
search) and opens the one chosen, or goes to its tab."""

from __future__ import annotations

import pytest
from helpers import wait_until
from textual.command import CommandPalette
from tui_helpers import make_app, press

from paged_chat.app.chat_store import ChatStore
from paged_chat.tui.actions import StoredChats
from paged_chat.tui.chat_search import ChatSearch


@pytest.mark.timeout(120)
async def test_palette_search_opens_the_chat_that_holds_the_words(engine, tmp_path):
    with ChatStore(tmp_path / "chats.db") as store:
        tides = store.create_chat("Tides", "m")
        store.add_message(tides.id, "user", "Why do oceans rise twice a day?", [1])
        store.add_message(tides.id, "assistant", "The moon's gravity pulls the water.", [2], "stop")
        store.create_chat("Newest chat", "m")   # the one restored into a tab
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(lambda: [tab.title for tab in app.chat_tabs] == ["Newest chat", "Chat 2"])
        assert [hit async for hit in ChatSearch(app.screen).search("nothing-like-it")] == []
        await press(pilot, "ctrl+p")
        await wait_until(lambda: isinstance(app.screen, CommandPalette))
        await press(pilot, *"gravity")
        await wait_until(lambda: "Found in chats: Tides" in str(
            app.screen.query_one("CommandList").get_option_at_index(0).prompt)
            if app.screen.query("CommandList") and app.screen.query_one("CommandList").option_count
            else False)
        await press(pilot, "enter")
        await wait_until(lambda: app.active_tab is not None and app.active_tab.chat_id == tides.id)
        [hit] = [hit async for hit in ChatSearch(app.screen).search("newest")]
        await hit.command()   # an open chat: its tab comes to the front
        await wait_until(lambda: app.active_tab.title == "Newest chat")
        assert len(app.chat_tabs) == 3
        await pilot.pause()   # the tab switch's messages are handled before the app closes


@pytest.mark.timeout(120)
async def test_palette_search_lists_each_chat_once(engine, tmp_path):
    """Issue 32, item 9: a closed chat whose title matches came twice, as "Open chat: ..."
    and "Found in chats: ..."; one whose words only match comes once, found."""
    with ChatStore(tmp_path / "chats.db") as store:
        paging = store.create_chat("Paging explained", "m")
        store.add_message(paging.id, "user", "How does paging work?", [1])
        other = store.create_chat("Other", "m")
        store.add_message(other.id, "user", "Tell me about paging in old machines", [1])
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(lambda: len(app.chat_tabs) == 2)
        await app.tabs.close_tab(next(t for t in app.chat_tabs if t.chat_id == other.id))
        await pilot.pause()
        hits = [hit async for hit in StoredChats(app.screen).search("paging")]
        hits += [hit async for hit in ChatSearch(app.screen).search("paging")]
        listed = [hit.command.args[0] for hit in hits]
        assert sorted(listed) == sorted([paging.id, other.id]), [str(hit.text) for hit in hits]
