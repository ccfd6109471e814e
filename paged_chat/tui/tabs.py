"""Tab management, mixed into the app: opening a chat in a tab (new, stored, forked,
restored from the last run, the demo's), closing and cycling tabs, and keeping the
open-tabs file in step. Tabs get their session and what they need passed down."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from textual.css.query import NoMatches

from paged_chat.chat_session import ChatSession
from paged_chat.tui.chat_tab import ChatTab

if TYPE_CHECKING:
    from paged_chat.store import Chat

DEMO_SAMPLING = {"max_tokens": 256}   # demo replies stay short so the tabs keep cycling


class TabManagement:
    """The app's tabs: each a view of one ChatSession on the app's store."""

    def _free_colour(self) -> int:
        used = {tab.colour for tab in self.chat_tabs}
        return next(i for i in range(len(used) + 1) if i not in used)

    def _store_warning(self, message: str) -> None:
        self.notify(message, severity="warning", timeout=8, markup=False)

    async def open_session_tab(self, session: ChatSession, *, activate: bool = True) -> ChatTab:
        """A tab showing `session`; its stored messages mount when it is first shown."""
        tab = ChatTab(session, self._free_colour(), wait_for_engine=self.wait_for_engine,
                      sampling_params=self.sampling_params)
        await self.tabs.add_pane(tab)
        self._refresh_tab(tab)
        if activate:
            self._activate(tab)
        self._save_open_tabs()
        return tab

    async def open_chat_tab(self, chat: Chat, *, activate: bool = True, loaded: bool = False) -> ChatTab:
        """A tab for a stored chat; `loaded` says whether `chat` carries its messages."""
        session = ChatSession(self.store, chat, loaded=loaded, on_warning=self._store_warning)
        return await self.open_session_tab(session, activate=activate)

    async def open_new_chat(self) -> ChatTab:
        """A new chat named `Chat N`, N one past the open tabs (the next free such name)."""
        titles = {tab.title for tab in self.chat_tabs}
        number = len(titles) + 1
        while f"Chat {number}" in titles:
            number += 1
        chat = self.store.create_chat(f"Chat {number}", self.model_name,
                                      self.settings.chat.system_prompt, {})
        return await self.open_chat_tab(chat, loaded=True)

    def _refresh_tab(self, tab: ChatTab) -> None:
        try:
            header = self.tabs.get_tab(tab.id)
        except (ValueError, NoMatches):  # its header is being added or removed
            return
        label = tab.label()
        if getattr(header, "_paged_chat_label", None) != label:
            header._paged_chat_label = label
            header.label = label
            if tab is self.active_tab:   # a label growing while it streams stays in view
                self.call_after_refresh(self._scroll_to_active_label)
        if self._tab_infos is not None and (tab.chat_id not in self._tab_infos
                                            or self._tab_infos[tab.chat_id].title != tab.title):
            self._tab_infos = None

    def _scroll_to_active_label(self) -> None:
        """Scroll the tab bar so the active tab's whole label shows (after a restore the
        bar is laid out only after the last tab became active)."""
        tab = self.active_tab
        if tab is not None and tab.is_attached:
            try:
                self.tabs.get_tab(tab.id).scroll_visible(animate=False, force=True)
            except (ValueError, NoMatches):   # its header is being removed
                pass

    def cycle_tabs(self, step: int) -> None:
        tabs = self.chat_tabs
        active = self.active_tab
        if not tabs or active is None:
            return
        self._activate(tabs[(tabs.index(active) + step) % len(tabs)])

    def _activate(self, tab: ChatTab) -> None:
        """Show `tab` and give its prompt the focus now: keys already queued behind the
        one that switched tabs (a fast typist) must land in this tab, and `focus()` would
        move it only after them."""
        self.tabs.active = tab.id
        self.screen.set_focus(tab.prompt)

    async def close_tab(self, tab: ChatTab) -> None:
        if len(self.chat_tabs) == 1:  # there is always a tab: open the next one first
            await self.open_new_chat()
        elif tab is self.active_tab:
            self.cycle_tabs(-1 if tab is self.chat_tabs[-1] else +1)
        self._autopilots.pop(tab, None)
        await self.tabs.remove_pane(tab.id)
        self._tab_infos = None
        self._save_open_tabs()

    def closed_chats(self) -> list[Chat]:
        open_ids = {tab.chat_id for tab in self.chat_tabs}
        return [chat for chat in self.store.list_chats() if chat.id not in open_ids]

    async def open_stored_chat(self, chat_id: str) -> None:
        for tab in self.chat_tabs:
            if tab.chat_id == chat_id:
                self.tabs.active = tab.id
                return
        await self.open_chat_tab(self.store.get_chat(chat_id), loaded=True)

    async def _restore_tabs(self) -> None:
        """Reopen the tabs of the last run (their messages load when first shown)."""
        chats = {chat.id: chat for chat in self.store.list_chats()}
        open_ids, active = self.open_tabs.read()
        ids = [chat_id for chat_id in open_ids if chat_id in chats]
        if not ids and chats:
            latest = self.store.latest_chat()
            ids = [latest.id] if latest is not None else []
        for chat_id in ids:
            await self.open_chat_tab(chats[chat_id], activate=False)
        for tab in self.chat_tabs:
            if tab.chat_id == active:
                self.tabs.active = tab.id

    def _save_open_tabs(self) -> None:
        active = self.active_tab
        self.open_tabs.save([tab.chat_id for tab in self.chat_tabs],
                            active.chat_id if active else None)

    async def _open_demo_tabs(self, count: int) -> None:
        from paged_chat.tui.demo import demo_tabs

        for title, system, autopilot in demo_tabs(count, seed=int(time.time())):
            chat = self.store.create_chat(title, self.model_name, system, dict(DEMO_SAMPLING))
            tab = await self.open_chat_tab(chat, activate=False, loaded=True)
            self._autopilots[tab] = autopilot
            tab.send(autopilot.first_prompt())
        self.tabs.active = self.chat_tabs[0].id

    def pause_demo(self, tab: ChatTab) -> None:
        """Esc in a demo tab pauses its autopilot."""
        if tab in self._autopilots:
            self._autopilots[tab].paused = True
