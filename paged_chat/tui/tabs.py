"""The chat tabs: a TabbedContent that owns everything about its tabs.

It opens chats in tabs (new, stored, forked, restored from the last run, the demo's),
closes and cycles them, draws their headers, keeps the open-tabs file in step and tells
the engine panel who each tab is. What it needs comes down as constructor arguments (the
store, the open-tabs file, new chats' system prompt, and callables: the model new chats
are stored with, how a tab waits for the engine, learns that it cannot take a turn now,
and makes its sampling parameters); its
tabs report up with ChatTab messages, which it handles before they bubble on to the app.
Nothing outside reads its state but through the methods below.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from textual import on
from textual.content import Content
from textual.css.query import NoMatches
from textual.widgets import ContentSwitcher, Tab, TabbedContent, TabPane

from paged_chat.app.chat_session import ChatSession
from paged_chat.app.chat_store import new_chat
from paged_chat.app.text import sanitize_for_terminal as clean
from paged_chat.tui.chat_tab import ChatTab, EngineTrouble, MakeParams, WaitForEngine
from paged_chat.tui.tab_info import TabInfo
from paged_chat.tui.textual_compat import relabel_tab

if TYPE_CHECKING:
    from paged_chat.app.chat_store import ChatStore, StoredChat
    from paged_chat.tui.demo import Autopilot
    from paged_chat.tui.open_tabs import OpenTabs

DEMO_SAMPLING = {"max_tokens": 256}   # demo replies stay short so the tabs keep cycling


class ChatTabs(TabbedContent):
    """The open chats, each a ChatTab (a view of one ChatSession on `store`).

    Its own state: `_labels`, per tab, the header text last drawn (a header is redrawn only
    when its text changes: a new label re-lays the tab bar); `_infos`, per open chat id,
    what the panel shows of its tab (None: rebuilt when next asked for, after a tab
    closed or shows another chat; a tab opened or renamed drops it too); `_autopilots`,
    per demo tab, its driver. `model_name()` is what new chats store as their model (the
    engine's, once loaded).
    """

    def __init__(self, store: ChatStore, open_tabs: OpenTabs, *, model_name: Callable[[], str],
                 system_prompt: str | None, wait_for_engine: WaitForEngine,
                 sampling_params: MakeParams, engine_trouble: EngineTrouble,
                 id: str | None = None) -> None:
        super().__init__(id=id)
        self.store = store
        self.open_tabs = open_tabs
        self.model_name = model_name
        self.system_prompt = system_prompt
        self.wait_for_engine = wait_for_engine
        self.sampling_params = sampling_params
        self.engine_trouble = engine_trouble
        self._labels: dict[ChatTab, str] = {}
        self._infos: dict[str, TabInfo] | None = None
        self._autopilots: dict[ChatTab, Autopilot] = {}

    @property
    def chat_tabs(self) -> list[ChatTab]:
        # The panes' container, not a query of the whole DOM: that walks every message
        # widget of every tab, and the app's frames ask for the tabs.
        return [pane for pane in self.query_one(ContentSwitcher).children
                if isinstance(pane, ChatTab)]

    @property
    def active_tab(self) -> ChatTab | None:
        pane = self.active_pane
        return pane if isinstance(pane, ChatTab) else None

    def tab_infos(self) -> dict[str, TabInfo]:
        """Per open chat id, what the engine panel shows of its tab."""
        if self._infos is None:
            self._infos = {tab.chat_id: TabInfo(clean(tab.title), tab.colour, tab.tokens_of)
                           for tab in self.chat_tabs}
        return self._infos

    # ---- opening --------------------------------------------------------------------

    async def open_session_tab(self, session: ChatSession, *, activate: bool = True) -> ChatTab:
        """A tab showing `session`; its stored messages mount when it is first shown."""
        tab = ChatTab(session, self._free_colour(), wait_for_engine=self.wait_for_engine,
                      sampling_params=self.sampling_params, engine_trouble=self.engine_trouble)
        await self.add_pane(tab)
        self._refresh_label(tab)
        if activate:
            self._activate(tab)
        self._save_open_tabs()
        return tab

    async def open_chat_tab(self, chat: StoredChat, *, activate: bool = True,
                            loaded: bool = False) -> ChatTab:
        """A tab for a stored chat; `loaded` says whether `chat` carries its messages."""
        session = ChatSession(self.store, chat, loaded=loaded, on_warning=self._store_warning)
        return await self.open_session_tab(session, activate=activate)

    async def open_new_chat(self) -> ChatTab:
        """A new chat named `Chat N`, N one past the open tabs (the next free such name). It
        is written to the store with its first message: a tab left empty is no saved chat,
        whatever ends the app."""
        titles = {tab.title for tab in self.chat_tabs}
        number = len(titles) + 1
        while f"Chat {number}" in titles:
            number += 1
        chat = new_chat(f"Chat {number}", self.model_name(), self.system_prompt)
        return await self.open_session_tab(ChatSession(self.store, chat, in_store=False,
                                                       on_warning=self._store_warning))

    async def fork_tab(self, tab: ChatTab) -> ChatTab:
        """A new tab on a copy of `tab`'s chat (its KV blocks shared), shown and loaded."""
        await tab.ensure_loaded()
        fork = await self.open_session_tab(tab.session.fork(f"{tab.title} (fork)"))
        await fork.ensure_loaded()
        return fork

    async def open_stored_chat(self, chat_id: str) -> None:
        """Go to the chat's tab, or open one for it."""
        for tab in self.chat_tabs:
            if tab.chat_id == chat_id:
                self.active = tab.id
                return
        await self.open_chat_tab(self.store.get_chat(chat_id), loaded=True)

    def closed_chats(self) -> list[StoredChat]:
        """The stored chats that have no tab open."""
        open_ids = {tab.chat_id for tab in self.chat_tabs}
        return [chat for chat in self.store.list_chats() if chat.id not in open_ids]

    async def restore(self) -> None:
        """Reopen the tabs of the last run (their messages load when first shown). With
        none to reopen (a first start), the latest chat (an `ask`'s, say) opens beside a
        new empty tab, which is the one shown."""
        chats = {chat.id: chat for chat in self.store.list_chats()}
        open_ids, active = self.open_tabs.read()
        ids = [chat_id for chat_id in open_ids if chat_id in chats]
        if not ids and chats:
            latest = self.store.latest_chat()
            if latest is not None:
                await self.open_chat_tab(latest, activate=False)
            await self.open_new_chat()
            return
        for chat_id in ids:
            await self.open_chat_tab(chats[chat_id], activate=False)
        for tab in self.chat_tabs:
            if tab.chat_id == active:
                self.active = tab.id

    async def open_demo_tabs(self, count: int) -> None:
        """--demo: `count` tabs that chat by themselves, each driven by an autopilot."""
        from paged_chat.tui.demo import demo_tabs

        for title, system, autopilot in demo_tabs(count, seed=int(time.time())):
            chat = self.store.create_chat(title, self.model_name(), system, dict(DEMO_SAMPLING))
            tab = await self.open_chat_tab(chat, activate=False, loaded=True)
            self._autopilots[tab] = autopilot
            tab.send(autopilot.first_prompt())
        self.active = self.chat_tabs[0].id

    def pause_demo(self, tab: ChatTab) -> None:
        """Esc in a demo tab pauses its autopilot."""
        if tab in self._autopilots:
            self._autopilots[tab].paused = True

    # ---- moving between tabs, closing ---------------------------------------------------

    def cycle_tabs(self, step: int) -> None:
        tabs = self.chat_tabs
        active = self.active_tab
        if not tabs or active is None:
            return
        self._activate(tabs[(tabs.index(active) + step) % len(tabs)])

    async def close_tab(self, tab: ChatTab) -> None:
        """Close `tab`; closing the last one opens a new chat first (there is always a tab)."""
        if len(self.chat_tabs) == 1:
            await self.open_new_chat()
        elif tab is self.active_tab:
            self.cycle_tabs(-1 if tab is self.chat_tabs[-1] else +1)
        self._autopilots.pop(tab, None)
        self._labels.pop(tab, None)
        await self.remove_pane(tab.id)
        self._infos = None
        self._save_open_tabs()

    def _activate(self, tab: ChatTab) -> None:
        """Show `tab` and give its prompt the focus now: keys already queued behind the
        one that switched tabs (a fast typist) must land in this tab, and `focus()` would
        move it only after them."""
        self.active = tab.id
        self.screen.set_focus(tab.prompt)

    def render_frame(self) -> None:
        """A frame of the app (its FrameClock's): the shown tab's streaming reply renders
        what arrived since the last one; hidden tabs only keep theirs."""
        tab = self.active_tab
        if tab is not None:
            tab.render_frame()

    # ---- headers --------------------------------------------------------------------

    def refresh_streaming_labels(self) -> None:
        """Streaming tabs' headers (TTFT, tokens/s), all in one layout pass (a tab label
        change re-lays the tab bar)."""
        with self.app.batch_update():
            for tab in self.chat_tabs:
                if tab.streaming:
                    self._refresh_label(tab)

    def _refresh_label(self, tab: ChatTab) -> None:
        try:
            header = self.get_tab(tab.id)
        except (ValueError, NoMatches):  # its header is being added or removed
            return
        label = tab.label()
        if self._labels.get(tab) != label:
            self._labels[tab] = label
            _relabel(header, label)
            if tab is self.active_tab:   # a label growing while it streams stays in view
                self.call_after_refresh(self._scroll_to_active_label)
        if self._infos is not None and (tab.chat_id not in self._infos
                                        or self._infos[tab.chat_id].title != clean(tab.title)):
            self._infos = None

    def _scroll_to_active_label(self) -> None:
        """Scroll the tab bar so the active tab's whole label shows (after a restore the
        bar is laid out only after the last tab became active)."""
        tab = self.active_tab
        if tab is not None and tab.is_attached:
            try:
                self.get_tab(tab.id).scroll_visible(animate=False, force=True)
            except (ValueError, NoMatches):   # its header is being removed
                pass

    # ---- what the tabs report -----------------------------------------------------------

    def on_tab_pane_focused(self, event: TabPane.Focused) -> None:
        """TabbedContent shows the pane a widget was focused in; here only the tab bar and
        the app's actions switch tabs. That focus message comes a few queues late: a switch
        made meanwhile (Ctrl+N, then Alt+Left at once) was undone by the new tab's focus,
        and a stale focus landing in a tab the user just left switched back to it."""
        event.prevent_default()   # instead of TabbedContent's handler
        event.stop()

    @on(ChatTab.Changed)
    def _tab_changed(self, event: ChatTab.Changed) -> None:
        if event.tab.is_attached:
            self._refresh_label(event.tab)
        if isinstance(event, ChatTab.Rekeyed):
            self._infos = None
            self._save_open_tabs()
        elif isinstance(event, ChatTab.TurnEnded) and event.tab in self._autopilots:
            self._autopilots[event.tab].turn_done(event.tab)

    @on(TabbedContent.TabActivated)
    def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        # The tab shown now (not necessarily event.pane, which a later switch may have left)
        # has its streaming reply served first, the others' after it.
        for tab in self.chat_tabs:
            tab.reprioritize()
        # Shown from the app's queue: while the app is still opening tabs (the last run's,
        # one by one) the activations wait, and by then the stale ones are plain to see.
        self.app.call_later(self._show, event.pane)

    async def _show(self, tab: TabPane) -> None:
        # Stale activations (restoring adds tabs one by one) load nothing: tabs load lazily.
        try:
            if not (isinstance(tab, ChatTab) and tab is self.active_tab and tab.is_attached):
                return
            # Focus first: the hidden tab's prompt must not keep it while this one loads.
            tab.prompt.focus()
        except NoMatches:  # the tab, or the app, is being torn down
            return
        self._save_open_tabs()
        self.call_after_refresh(self._scroll_to_active_label)
        await tab.ensure_loaded()

    def _save_open_tabs(self) -> None:
        active = self.active_tab
        self.open_tabs.save([tab.chat_id for tab in self.chat_tabs],
                            active.chat_id if active else None)

    def _free_colour(self) -> int:
        used = {tab.colour for tab in self.chat_tabs}
        return next(i for i in range(len(used) + 1) if i not in used)

    def _store_warning(self, message: str) -> None:
        self.notify(message, severity="warning", timeout=8, markup=False)


def _relabel(header: Tab, label: str) -> None:
    """Show `label` in a tab header: Tab's label setter re-lays the whole screen out, and a
    label as wide as the last needs only a repaint (textual_compat.relabel_tab)."""
    content = Content.from_text(label)
    if content.cell_length != header.label.cell_length:
        header.label = content
    else:
        relabel_tab(header, content)
