"""The paged-chat Textual app: chat tabs on one AsyncEngine, and the engine panel.

The UI opens at once; the model loads in a thread worker and the status line says when it
is ready (a prompt sent before then waits for it). Each tab streams its replies in its own
worker on the app's event loop; the engine panel polls `AsyncEngine.stats()` (which never
blocks) on a ~10 Hz timer. The app takes an injected engine, store and settings, so tests
can drive it with a tiny model and a throwaway store.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.command import DiscoveryHit, Hit, Hits, Provider
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Static, TabbedContent

from paged_chat.engine.errors import PagedChatError
from paged_chat.text import sanitize_for_terminal as clean
from paged_chat.tui.chat_tab import ChatTab, copy_conversation
from paged_chat.tui.dialogs import ChatSettingsScreen, ConfirmScreen, HelpScreen, TextPromptScreen
from paged_chat.tui.engine_panel import EnginePanel, TabInfo

if TYPE_CHECKING:
    from paged_chat.engine import AsyncEngine, EngineConfig, SamplingParams
    from paged_chat.settings import Settings
    from paged_chat.store import ChatStore

# (action, default keys, footer label, description, priority): every action also has a
# palette entry. The action name is the binding id: `[tui.keys] new_chat = "ctrl+t"`.
ACTIONS: list[tuple[str, str, str, str, bool]] = [
    ("new_chat", "ctrl+n", "New", "New chat", True),
    ("close_chat", "ctrl+w", "Close", "Close chat", True),
    ("next_chat", "ctrl+pagedown,alt+right", "Next", "Next chat", True),
    ("prev_chat", "ctrl+pageup,alt+left", "Prev", "Previous chat", True),
    ("rename_chat", "f2", "Rename", "Rename chat", False),
    ("fork_chat", "ctrl+f", "Fork", "Fork chat (shares its KV blocks)", True),
    ("chat_settings", "f4", "Settings", "System prompt and sampling", False),
    ("stop", "escape", "Stop", "Stop the reply", False),
    ("regenerate", "ctrl+r", "Regenerate", "Regenerate the last reply", True),
    ("copy_reply", "alt+c", "Copy", "Copy the last reply", False),
    ("copy_code", "alt+x", "Copy code", "Copy the last code block", False),
    ("broadcast", "ctrl+b", "Broadcast", "Broadcast the prompt to every tab", True),
    ("toggle_panel", "f8", "Panel", "Show or hide the engine panel", False),
    ("help", "f1", "Help", "Help and keys", False),
]
SHOWN = {"new_chat", "close_chat", "fork_chat", "chat_settings", "stop", "regenerate",
         "broadcast", "toggle_panel", "help"}
PALETTE_ONLY = [
    ("delete_chat", "Delete this chat from the store"),
    ("quit", "Quit paged-chat"),
]


LABEL_TICKS = 10            # polls between refreshes of streaming tabs' headers
DEMO_NUM_BLOCKS = 1536      # --demo's KV pool unless config.toml sizes it
DEMO_SAMPLING = {"max_tokens": 256}   # demo replies stay short so the tabs keep cycling


def make_bindings() -> list[Binding]:
    return [Binding(keys, action, label, show=action in SHOWN, priority=priority, id=action,
                    tooltip=description) for action, keys, label, description, priority in ACTIONS]


class StoredChats(Provider):
    """Palette: reopen a chat from the store that has no open tab."""

    async def search(self, query: str) -> Hits:
        app = self.app
        assert isinstance(app, PagedChatApp)
        matcher = self.matcher(query)
        for chat in app.closed_chats():
            text = f"Open chat: {chat.title}"
            score = matcher.match(text)
            if score > 0:
                yield Hit(score, matcher.highlight(text), partial(app.open_stored_chat, chat.id),
                          help=f"last used {time.strftime('%Y-%m-%d %H:%M', time.localtime(chat.updated))}")

    async def discover(self) -> Hits:
        app = self.app
        assert isinstance(app, PagedChatApp)
        for chat in app.closed_chats()[:20]:
            yield DiscoveryHit(f"Open chat: {chat.title}", partial(app.open_stored_chat, chat.id))


class PagedChatApp(App):
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "paged-chat"
    BINDINGS = make_bindings()
    COMMANDS = App.COMMANDS | {StoredChats}

    def __init__(self, settings: "Settings | None" = None, *, engine: "AsyncEngine | None" = None,
                 engine_config: "EngineConfig | None" = None, store: "ChatStore | None" = None,
                 session_path: Path | None = None, demo: int | None = None,
                 restore: bool = True, poll_s: float = 0.1) -> None:
        super().__init__()
        from paged_chat.settings import Settings, data_dir

        self.settings = settings or Settings()
        self.engine = engine
        self._owns_engine = engine is None
        if engine_config is None and engine is None:
            pool = {}
            if demo and self.settings.engine.num_blocks is None \
                    and self.settings.engine.kv_cache_memory is None:
                pool = {"num_blocks": DEMO_NUM_BLOCKS}  # a pool the block map shows block by block
            engine_config = self.settings.engine_config(**pool)
        self.engine_config = engine_config
        self.demo = demo
        self._demo_dir: Path | None = None
        if store is None:
            from paged_chat.store import ChatStore
            if demo:  # demo chats are throwaway: keep them out of the user's history
                self._demo_dir = Path(tempfile.mkdtemp(prefix="paged-chat-demo-"))
                store = ChatStore(self._demo_dir / "chats.db")
            else:
                store = ChatStore()
        self.store = store
        self.session_path = session_path or (
            (self._demo_dir or data_dir()) / "tui-session.json")
        self.restore = restore
        self.poll_s = poll_s
        self.load_error: str | None = None
        self.load_seconds: float | None = None
        self._load_started = time.monotonic()
        self._engine_ready: asyncio.Event | None = None
        self._tab_infos: dict[str, TabInfo] | None = None
        self._last_engine_error: str | None = None
        self._chat_number = 0
        self._ticks = 0

    # ---- layout ---------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield TabbedContent(id="tabs")
            yield EnginePanel(id="engine-panel")
        yield Static(id="status")
        yield Footer()

    @property
    def tabs(self) -> TabbedContent:
        return self.query_one("#tabs", TabbedContent)

    @property
    def panel(self) -> EnginePanel:
        return self.query_one(EnginePanel)

    @property
    def chat_tabs(self) -> list[ChatTab]:
        return list(self.query(ChatTab))

    @property
    def active_tab(self) -> ChatTab | None:
        pane = self.tabs.active_pane
        return pane if isinstance(pane, ChatTab) else None

    @property
    def model_name(self) -> str:
        if self.engine is not None:
            return self.engine.engine.model_name
        return self.engine_config.model if self.engine_config is not None else "?"

    async def on_mount(self) -> None:
        self._engine_ready = asyncio.Event()
        theme = self.settings.tui.theme
        if theme in self.available_themes:
            self.theme = theme
        else:
            self.notify(f"[tui] theme {theme!r} is unknown; themes: "
                        f"{', '.join(sorted(self.available_themes))}", severity="warning", markup=False)
        self._apply_keymap(self.settings.tui.keys)
        if getattr(self.store, "notice", None):
            self.notify(self.store.notice, severity="warning", timeout=15, markup=False)
        if self.engine is None:
            self._load_engine()
        else:
            self._engine_loaded(self.engine, 0.0)
        self.panel.decode = self._decode
        if self.demo:
            await self._open_demo_tabs(self.demo)
        elif self.restore:
            await self._restore_tabs()
        if not self.chat_tabs:
            await self.action_new_chat()
        if self.active_tab is not None:
            await self.active_tab.ensure_loaded()
            self.active_tab.prompt.focus()
        self._update_status()
        self.set_interval(self.poll_s, self._poll)

    def _apply_keymap(self, keys: dict[str, str]) -> None:
        known = {action for action, *_ in ACTIONS}
        unknown = sorted(set(keys) - known)
        if unknown:
            self.notify(f"[tui.keys]: unknown action(s) {', '.join(unknown)}; known: "
                        f"{', '.join(sorted(known))}", severity="error", timeout=15, markup=False)
        self.set_keymap({action: key for action, key in keys.items() if action in known})

    # ---- the engine -----------------------------------------------------------------

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False)
    def _load_engine(self) -> None:
        from paged_chat.engine import AsyncEngine

        started = time.monotonic()
        try:
            engine = AsyncEngine.from_config(self.engine_config)
        except BaseException as error:  # shown in the status line and in any waiting tab
            message = str(error) if isinstance(error, (PagedChatError, ValueError, OSError)) \
                else f"{type(error).__name__}: {error}"
            try:
                self.call_from_thread(self._engine_failed, message)
            except RuntimeError:
                pass
            return
        try:
            self.call_from_thread(self._engine_loaded, engine, time.monotonic() - started)
        except RuntimeError:  # the app closed while the model loaded
            engine.shutdown()

    def _engine_loaded(self, engine: "AsyncEngine", seconds: float) -> None:
        self.engine = engine
        self.load_seconds = seconds
        self._engine_ready.set()
        self._update_status()
        if seconds:
            self.notify(f"{engine.engine.model_name} is ready ({seconds:.1f} s)", timeout=3, markup=False)

    def _engine_failed(self, message: str) -> None:
        self.load_error = message
        self._engine_ready.set()
        self._update_status()
        self.notify(f"the model failed to load: {message}", severity="error", timeout=30, markup=False)

    async def wait_for_engine(self) -> "AsyncEngine":
        """The engine, once loaded; raises PagedChatError if it failed to load."""
        await self._engine_ready.wait()
        if self.engine is None:
            raise PagedChatError(f"the model failed to load: {self.load_error}")
        return self.engine

    def sampling_params(self, sampling: dict) -> "SamplingParams":
        return self.settings.sampling_params(**sampling)

    def _decode(self, ids) -> str:
        if self.engine is None:
            return ""
        return self.engine.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _poll(self) -> None:
        """~10 Hz: take the engine's latest snapshot (never blocks) and show it."""
        if self.engine is None:
            if self.load_error is None:
                self._update_status()
            return
        if not self.screen.is_attached or not self.query(EnginePanel):
            return  # shutting down
        stats = self.engine.stats()
        if self._tab_infos is None:
            self._tab_infos = {tab.chat_id: TabInfo(clean(tab.title), tab.colour, tab.tokens_of)
                               for tab in self.chat_tabs}
        try:
            self.panel.show_stats(stats, self._tab_infos)
        except NoMatches:  # the panel is being built or torn down
            return
        self._ticks += 1
        if self._ticks % LABEL_TICKS == 0:
            self._refresh_streaming_labels()
        error = self.engine.last_error
        if error and error != self._last_engine_error:
            self._last_engine_error = error
            self.notify(f"engine step failed: {error}", severity="error", timeout=10, markup=False)

    def _refresh_streaming_labels(self) -> None:
        """Streaming tabs' headers (TTFT, tokens/s), all in one layout pass about once a second
        (a tab label change re-lays the tab bar)."""
        with self.batch_update():
            for tab in self.chat_tabs:
                if tab.streaming:
                    self._refresh_tab(tab)

    def _update_status(self) -> None:
        status = self.query_one("#status", Static)
        text = Text(no_wrap=True, overflow="ellipsis")
        if self.engine is not None:
            core = self.engine.engine
            text.append("● ", style="green")
            text.append(core.model_name, style="bold")
            text.append(f" · {core.device.type} · {str(core.dtype).removeprefix('torch.')}"
                        f" · {core.num_blocks:,} blocks × {core.block_size}"
                        f" · max {core.max_model_len:,} tokens/seq")
            if self.load_seconds:
                text.append(f" · ready (loaded in {self.load_seconds:.1f} s)", style="dim")
        elif self.load_error is not None:
            text.append("✖ ", style="red")
            text.append(f"model failed to load: {self.load_error}", style="red")
        else:
            config = self.engine_config
            elapsed = time.monotonic() - self._load_started
            text.append("◌ ", style="yellow")
            text.append(f"loading {config.model} ({config.device}, {config.dtype}) … "
                        f"{elapsed:.0f} s — you can type already", style="yellow")
        if self.demo:
            text.append(f" · demo: {self.demo} tabs chat by themselves (Esc pauses one)",
                        style="italic")
        status.update(text, layout=False)

    # ---- tabs -----------------------------------------------------------------------

    def _free_colour(self) -> int:
        used = {tab.colour for tab in self.chat_tabs}
        return next(i for i in range(len(used) + 1) if i not in used)

    async def open_chat_tab(self, chat, *, activate: bool = True, loaded: bool = False,
                            conversation=None, autopilot=None) -> ChatTab:
        tab = ChatTab(chat.id, chat.title, self._free_colour(), system_prompt=chat.system_prompt,
                      sampling=chat.sampling, conversation=conversation, loaded=loaded,
                      autopilot=autopilot)
        await self.tabs.add_pane(tab)
        self._refresh_tab(tab)
        if activate:
            self.tabs.active = tab.id
            tab.prompt.focus()
        self._save_session()
        return tab

    def _refresh_tab(self, tab: ChatTab) -> None:
        try:
            header = self.tabs.get_tab(tab.id)
        except (ValueError, NoMatches):  # its header is being added or removed
            return
        label = tab.label()
        if getattr(header, "_paged_chat_label", None) != label:
            header._paged_chat_label = label
            header.label = label
        if self._tab_infos is not None and (tab.chat_id not in self._tab_infos
                                            or self._tab_infos[tab.chat_id].title != tab.title):
            self._tab_infos = None

    @on(ChatTab.Changed)
    def _tab_changed(self, event: ChatTab.Changed) -> None:
        if event.tab.is_attached:
            self._refresh_tab(event.tab)

    @on(TabbedContent.TabActivated)
    async def _tab_activated(self, event: TabbedContent.TabActivated) -> None:
        tab = event.pane
        # Stale activations (restoring adds tabs one by one) load nothing: tabs load lazily.
        if isinstance(tab, ChatTab) and tab is self.active_tab and tab.is_attached:
            try:  # focus first: the hidden tab's prompt must not keep it while this one loads
                tab.prompt.focus()
            except NoMatches:  # the tab is being removed
                return
            self._save_session()
            await tab.ensure_loaded()

    def rekey_tab(self, tab: ChatTab, chat_id: str) -> None:
        """The tab now shows another chat (the demo starting over)."""
        tab.chat_id = chat_id
        self._tab_infos = None
        self._save_session()

    def closed_chats(self) -> list:
        open_ids = {tab.chat_id for tab in self.chat_tabs}
        return [chat for chat in self.store.list_chats() if chat.id not in open_ids]

    async def open_stored_chat(self, chat_id: str) -> None:
        for tab in self.chat_tabs:
            if tab.chat_id == chat_id:
                self.tabs.active = tab.id
                return
        await self.open_chat_tab(self.store.get_chat(chat_id))

    async def _restore_tabs(self) -> None:
        """Reopen the tabs of the last session (their messages load when first shown)."""
        chats = {chat.id: chat for chat in self.store.list_chats()}
        session = self._read_session()
        ids = [chat_id for chat_id in session.get("open", []) if chat_id in chats]
        if not ids and chats:
            latest = self.store.latest_chat()
            ids = [latest.id] if latest is not None else []
        for chat_id in ids:
            await self.open_chat_tab(chats[chat_id], activate=False)
        active = session.get("active")
        for tab in self.chat_tabs:
            if tab.chat_id == active:
                self.tabs.active = tab.id
        self._chat_number = len(chats)

    async def _open_demo_tabs(self, count: int) -> None:
        from paged_chat.tui.demo import demo_tabs

        for title, system, autopilot in demo_tabs(count, seed=int(time.time())):
            chat = self.store.create_chat(title, self.model_name, system, dict(DEMO_SAMPLING))
            tab = await self.open_chat_tab(chat, activate=False, loaded=True, autopilot=autopilot)
            tab.send(autopilot.first_prompt())
        first = self.chat_tabs[0]
        self.tabs.active = first.id

    def _read_session(self) -> dict:
        try:
            return json.loads(self.session_path.read_text())
        except (OSError, ValueError):
            return {}

    def _save_session(self) -> None:
        if self.demo:
            return
        active = self.active_tab
        state = {"open": [tab.chat_id for tab in self.chat_tabs],
                 "active": active.chat_id if active else None}
        try:
            self.session_path.parent.mkdir(parents=True, exist_ok=True)
            self.session_path.write_text(json.dumps(state))
        except OSError:
            pass

    async def _close_tab(self, tab: ChatTab) -> None:
        if len(self.chat_tabs) == 1:  # there is always a tab: open the next one first
            await self.action_new_chat()
        elif tab is self.active_tab:
            self._cycle(-1 if tab is self.chat_tabs[-1] else +1)
        await self.tabs.remove_pane(tab.id)
        self._tab_infos = None
        self._save_session()

    # ---- actions (each has a key and a palette entry) ----------------------------------

    def _need_tab(self) -> ChatTab | None:
        tab = self.active_tab
        if tab is None:
            self.notify("no chat is open", severity="warning", markup=False)
        return tab

    async def action_new_chat(self) -> None:
        self._chat_number += 1
        chat = self.store.create_chat(f"Chat {self._chat_number}", self.model_name,
                                      self.settings.chat.system_prompt, {})
        await self.open_chat_tab(chat, loaded=True)

    @work(group="dialog")
    async def action_close_chat(self) -> None:
        tab = self._need_tab()
        if tab is None:
            return
        if tab.streaming and not await self.push_screen_wait(
                ConfirmScreen(f"A reply is streaming in {tab.title!r}. Close it anyway?", "Close")):
            return
        await self._close_tab(tab)

    def action_next_chat(self) -> None:
        self._cycle(+1)

    def action_prev_chat(self) -> None:
        self._cycle(-1)

    def _cycle(self, step: int) -> None:
        tabs = self.chat_tabs
        active = self.active_tab
        if not tabs or active is None:
            return
        index = (tabs.index(active) + step) % len(tabs)
        self.tabs.active = tabs[index].id

    @work(group="dialog")
    async def action_rename_chat(self) -> None:
        tab = self._need_tab()
        if tab is None:
            return
        title = await self.push_screen_wait(TextPromptScreen("Rename chat", tab.title))
        if title:
            tab.set_title(title)
            self.store.rename_chat(tab.chat_id, title)

    async def action_fork_chat(self) -> None:
        tab = self._need_tab()
        if tab is None:
            return
        if tab.streaming:
            self.notify("wait for the reply to finish (or stop it) before forking",
                        severity="warning", markup=False)
            return
        await tab.ensure_loaded()
        chat = self.store.fork_chat(tab.chat_id, f"{tab.title} (fork)")
        conversation = copy_conversation(tab.conversation) if tab.conversation else None
        fork = await self.open_chat_tab(chat, conversation=conversation)
        await fork.ensure_loaded()
        self.notify(f"forked {tab.title!r}: the fork shares every full KV block of its history", markup=False)

    @work(group="dialog")
    async def action_chat_settings(self) -> None:
        tab = self._need_tab()
        if tab is None:
            return
        await tab.ensure_loaded()
        result = await self.push_screen_wait(ChatSettingsScreen(
            tab.title, tab.system_prompt, tab.sampling, self.settings.chat.sampling()))
        if result is not None:
            tab.apply_settings(*result)

    def action_stop(self) -> None:
        tab = self.active_tab
        if tab is not None and not tab.stop():
            pass

    def action_regenerate(self) -> None:
        tab = self._need_tab()
        if tab is not None:
            tab.regenerate()

    def action_copy_reply(self) -> None:
        tab = self._need_tab()
        text = tab.last_reply() if tab else None
        if not text:
            self.notify("no reply to copy yet", severity="warning", markup=False)
            return
        self.copy_to_clipboard(text)
        self.notify(f"copied the last reply ({len(text)} characters)", markup=False)

    def action_copy_code(self, index: int = -1) -> None:
        tab = self._need_tab()
        blocks = tab.code_blocks() if tab else []
        if not blocks:
            self.notify("no code block in this chat", severity="warning", markup=False)
            return
        self.copy_to_clipboard(blocks[index])
        self.notify(f"copied a code block ({len(blocks[index].splitlines())} lines)", markup=False)

    @work(group="dialog")
    async def action_broadcast(self) -> None:
        tab = self.active_tab
        text = tab.prompt.text.strip() if tab else ""
        if not text:
            text = await self.push_screen_wait(TextPromptScreen(
                "Broadcast: send this prompt to every open tab", placeholder="prompt"))
            if not text:
                return
        elif tab is not None:
            tab.prompt.remember(text)
        sent = [t for t in self.chat_tabs if not t.streaming and t.send(text)]
        busy = len(self.chat_tabs) - len(sent)
        self.notify(f"sent to {len(sent)} tabs" + (f" ({busy} busy, skipped)" if busy else ""), markup=False)

    def action_toggle_panel(self) -> None:
        self.panel.toggle_class("collapsed")

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        self.push_screen(HelpScreen(self.key_help()))

    @work(group="dialog")
    async def action_delete_chat(self) -> None:
        tab = self._need_tab()
        if tab is None:
            return
        if not await self.push_screen_wait(ConfirmScreen(
                f"Delete {tab.title!r} and its messages from the store?", "Delete")):
            return
        chat_id = tab.chat_id
        await self._close_tab(tab)
        self.store.delete_chat(chat_id)

    def key_help(self) -> list[tuple[str, str]]:
        """(keys, description) per action, as currently bound (keymap applied)."""
        keymap = getattr(self, "_keymap", {})
        rows = []
        for action, keys, _, description, _ in ACTIONS:
            bound = keymap.get(action, keys)
            rows.append((", ".join(self.get_key_display(Binding(k, action)) for k in bound.split(",")),
                         description))
        rows += [("enter", "Send the prompt"), ("shift+enter, ctrl+j", "New line in the prompt"),
                 ("up / down", "Earlier prompts (on the first / last line)"),
                 ("ctrl+p", "Command palette (every action)"), ("ctrl+q", "Quit")]
        return rows

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for action, _, _, description, _ in ACTIONS:
            yield SystemCommand(description, f"action: {action}", partial(self.run_action, action))
        yield SystemCommand("Delete chat", PALETTE_ONLY[0][1], partial(self.run_action, "delete_chat"))
        tab = self.active_tab
        if tab is not None:
            for index, block in enumerate(tab.code_blocks()):
                first = block.strip().splitlines()[0][:40] if block.strip() else ""
                yield SystemCommand(f"Copy code block {index + 1}", first,
                                    partial(self.action_copy_code, index), discover=False)

    # ---- shutdown -------------------------------------------------------------------

    async def on_unmount(self) -> None:
        # The tabs' workers are cancelled by now: their rows got finish_reason "abort".
        if self._owns_engine and self.engine is not None:
            engine, self.engine = self.engine, None
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        if self._demo_dir is not None:
            self.store.close()
            shutil.rmtree(self._demo_dir, ignore_errors=True)


def run_app(settings: "Settings", demo: int | None = None) -> None:
    """The bare `paged-chat` command: open the TUI (with `demo`, N self-chatting tabs)."""
    app = PagedChatApp(settings, demo=demo)
    try:
        app.run()
    finally:
        if app._demo_dir is None:
            app.store.close()
