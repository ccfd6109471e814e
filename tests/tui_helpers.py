"""What the TUI tests share: the app with a throwaway store, and keys sent the way a
terminal sends them (the tiny engine for the app is engine_fixtures' `engine`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
from helpers import wait_until
from textual import events

from paged_chat.app.chat_store import ChatStore
from paged_chat.app.settings import ChatSettings, Settings, TuiSettings
from paged_chat.engine import LocalClient
from paged_chat.tui.app import PagedChatApp
from paged_chat.tui.block_map import SHARED, TAB0, BlockMapView
from paged_chat.tui.chat_tab import ChatTab
from paged_chat.tui.message_widgets import AssistantMessage

SYSTEM = ("You are a careful assistant. You answer in short sentences, you check your facts, "
          "and you say when you do not know something. Keep every answer brief and friendly.")


class TuiTestApp(PagedChatApp):
    """The real app; replies ignore EOS so a random model's reply has a known length."""

    def sampling_params(self, sampling: dict):
        return super().sampling_params({"ignore_eos": True, **sampling})


def make_settings(max_tokens: int = 24, system_prompt: str | None = SYSTEM, **tui) -> Settings:
    return Settings(chat=ChatSettings(system_prompt=system_prompt, temperature=0.0,
                                      max_tokens=max_tokens),
                    tui=TuiSettings(**tui))


def make_app(engine, tmp_path: Path, settings: Settings | None = None,
             app_class: type[PagedChatApp] = TuiTestApp, **kwargs) -> PagedChatApp:
    """The app on `engine` with its chats and session under tmp_path; `app_class`
    PagedChatApp itself where the replies' EOS must stay (a remote server's text)."""
    return app_class(settings or make_settings(), engine=engine,
                     store=ChatStore(tmp_path / "chats.db"),
                     session_path=tmp_path / "session.json", **kwargs)


async def press(pilot, *keys: str) -> None:
    """Send keys the way the terminal driver does (Pilot.press waits for the screen to
    settle, which takes seconds while replies stream)."""
    for key in keys:
        character = {"space": " ", "enter": "\r"}.get(key, key if len(key) == 1 else None)
        pilot.app.post_message(events.Key(key, character))
    await asyncio.sleep(0.05)


async def type_prompt(pilot, text: str) -> None:
    await press(pilot, *[{" ": "space"}.get(c, c) for c in text], "enter")
    await asyncio.sleep(0.05)


async def new_tab(pilot, key: str = "ctrl+n") -> ChatTab:
    """Open a tab with `key`; return it once its prompt has the focus."""
    app = pilot.app
    count = len(app.chat_tabs)
    await press(pilot, key)
    await wait_until(lambda: len(app.chat_tabs) == count + 1
                     and app.active_tab is app.chat_tabs[-1]
                     and app.focused is app.chat_tabs[-1].prompt)
    return app.chat_tabs[-1]


def idle(app: PagedChatApp) -> bool:
    return not any(tab.streaming for tab in app.chat_tabs)


class Watcher:
    """Samples the engine and the block map every 10 ms in the background of a test."""

    def __init__(self, app: PagedChatApp, engine: LocalClient) -> None:
        self.app, self.engine = app, engine
        self.max_batch = 0
        self.tab_codes: set[int] = set()
        self.shared_seen = False
        self.snapshots = []
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        view = self.app.query_one(BlockMapView)
        while True:
            stats = self.engine.stats()
            if not self.snapshots or stats is not self.snapshots[-1]:
                self.snapshots.append(stats)
            self.max_batch = max(self.max_batch, stats.batch_size)
            self.tab_codes |= {int(c) for c in np.unique(view.codes) if c >= TAB0}
            self.shared_seen |= bool((view.codes == SHARED).any())
            await asyncio.sleep(0.01)

    def stop(self) -> None:
        self._task.cancel()


def text_of(static) -> str:
    content = static.content
    return content.plain if hasattr(content, "plain") else str(content)


def replies(tab: ChatTab) -> list[AssistantMessage]:
    return tab.replies()
