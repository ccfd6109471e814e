"""Palette: find a stored chat by the words in its title or messages (the store's
full-text search, as `paged-chat chats list --search`), and open it or go to its tab."""

from __future__ import annotations

import time
from functools import partial

from rich.text import Text
from textual.command import Hit, Hits, Provider

from paged_chat.text import sanitize_for_terminal

MAX_HITS = 20
PREFIX = "Found in chats: "


class ChatSearch(Provider):
    """Every query is a store search; the most recently used chats come first."""

    async def search(self, query: str) -> Hits:
        app = self.app
        for rank, chat in enumerate(app.store.search_chats(query)[:MAX_HITS]):
            text = PREFIX + sanitize_for_terminal(chat.title)
            yield Hit(0.5 - rank / (4 * MAX_HITS), Text(text),
                      partial(app.tabs.open_stored_chat, chat.id), text=text,
                      help=f"last used {time.strftime('%Y-%m-%d %H:%M', time.localtime(chat.updated))}")
