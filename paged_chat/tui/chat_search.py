"""Palette: find a stored chat by the words in its title or messages (the store's
full-text search, as `paged-chat chats list --search`), and open it or go to its tab."""

from __future__ import annotations

import time
from functools import partial

from rich.text import Text
from textual.command import Hit, Hits, Provider

from paged_chat.app.text import sanitize_for_terminal

MAX_HITS = 20
PREFIX = "Found in chats: "


def open_chat_label(title: str) -> str:
    """The palette's entry for a stored chat with no tab open (StoredChats, actions.py)."""
    return f"Open chat: {sanitize_for_terminal(title)}"


class ChatSearch(Provider):
    """Every query is a store search; the most recently used chats come first. A closed
    chat whose "Open chat" entry already matches the query is left to that entry: the
    palette lists each chat once."""

    async def search(self, query: str) -> Hits:
        app = self.app
        matcher = self.matcher(query)
        listed = {chat.id for chat in app.tabs.closed_chats()
                  if matcher.match(open_chat_label(chat.title)) > 0}
        found = [chat for chat in app.store.search_chats(query) if chat.id not in listed]
        for rank, chat in enumerate(found[:MAX_HITS]):
            text = PREFIX + sanitize_for_terminal(chat.title)
            yield Hit(0.5 - rank / (4 * MAX_HITS), Text(text),
                      partial(app.tabs.open_stored_chat, chat.id), text=text,
                      help=f"last used {time.strftime('%Y-%m-%d %H:%M', time.localtime(chat.updated))}")
