"""The paged-chat Textual app: chat tabs on one engine client, and the engine panel.

The UI opens at once; a thread worker waits for the engine, by default in a process of its
own (`[tui] engine_process`: no GIL shared with the UI) that the bare command launched before
it imported this module (start.py), and the status line says when the
model is ready (a prompt sent before then waits for it), and when the engine stops or stops
responding (a dead or stopped child): a tab then keeps a new message in its prompt rather
than send it, and F5 restarts the engine (not the app). Each tab is a view of one ChatSession
and streams its replies in its own worker on the app's event loop. At each tick of the app's
FrameClock it reads `stats()` (which never blocks) once, the engine panel draws it and the
shown tab's streaming reply renders. The app talks to the engine only through
the EngineClient surface, and takes an injected engine, store and settings, so tests can
drive it with a tiny model and a throwaway store. Its actions live in `actions.py`; its tabs
are one widget, `ChatTabs` (`tabs.py`), that owns their state.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.css.query import NoMatches
from textual.widgets import Static

from paged_chat.app.chat_store import ChatStore
from paged_chat.app.settings import Settings, data_dir
from paged_chat.engine.core.errors import PagedChatError, describe_error
from paged_chat.tui.actions import ACTIONS, ChatActions, StoredChats, make_bindings
from paged_chat.tui.chat_screen import ChatScreen
from paged_chat.tui.chat_search import ChatSearch
from paged_chat.tui.engine_panel import EnginePanel, with_request_owners
from paged_chat.tui.engine_start import app_engine_config, start_engine
from paged_chat.tui.fit_parts import SEPARATOR, fit_parts
from paged_chat.tui.frame_clock import FRAME_S, FrameClock
from paged_chat.tui.key_footer import KeyFooter
from paged_chat.tui.open_tabs import OpenTabs
from paged_chat.tui.tabs import ChatTabs

if TYPE_CHECKING:
    from textual.theme import Theme

    from paged_chat.engine import (
        ClientCapabilities,
        EngineClient,
        EngineConfig,
        ModelInfo,
        SamplingParams,
        StartingClient,
    )
    from paged_chat.engine.models.loader import ProgressHook
    from paged_chat.server import ApiServer
    from paged_chat.tui.chat_tab import ChatTab

LABELS_EVERY_S = 1.0        # how often streaming tabs' headers (TTFT, tokens/s) refresh
WIDE_FROM = 112   # columns from which the engine panel (48) leaves the prompt 60 or more
QUIT_GRACE_S = 1.0     # what a quitting app gives a busy engine child before killing it
RESTART_GRACE_S = 5.0  # ... and a restart (a stopped or hung child is killed at once)
# The signals that end the app as Ctrl+Q does; the exit status says which, as a shell's would.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class PagedChatApp(ChatActions, App):
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "paged-chat"
    BINDINGS = make_bindings()
    COMMANDS = App.COMMANDS | {StoredChats, ChatSearch}
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (WIDE_FROM, "-wide")]
    _theme_by_name: tuple[str, Theme | None] = ("", None)   # current_theme's last: name, theme

    def __init__(self, settings: Settings | None = None, *, engine: EngineClient | None = None,
                 engine_config: EngineConfig | None = None,
                 engine_start: StartingClient | None = None, store: ChatStore | None = None,
                 session_path: Path | None = None, demo: int | None = None,
                 restore: bool = True, frame_s: float = FRAME_S, serve_port: int | None = None) -> None:
        super().__init__()
        self.serve_port = serve_port   # --serve: the API on this app's engine, on this port
        self.api_server: ApiServer | None = None
        self.settings = settings or Settings()
        self.engine = engine
        self._owns_engine = engine is None
        if engine_config is None and engine is None:
            engine_config = app_engine_config(self.settings, demo)
        self.engine_config = engine_config
        self._engine_start = engine_start   # an engine launched before the app (start.py)
        self.demo = demo
        self.demo_dir: Path | None = None   # --demo: its throwaway store, removed at unmount
        if store is None:
            if demo:  # demo chats are throwaway: keep them out of the user's history
                self.demo_dir = Path(tempfile.mkdtemp(prefix="paged-chat-demo-"))
                store = ChatStore(self.demo_dir / "chats.db")
            else:
                store = ChatStore()
        self.store = store
        self._caught_signals: list[int] = []   # STOP_SIGNALS whose handlers are installed
        self._chat_tabs: ChatTabs | None = None  # kept: on_unmount asks it, off the DOM by then
        self.open_tabs = OpenTabs(None if demo else session_path or data_dir() / "tui-session.json")
        self.restore = restore
        self.frame_clock = FrameClock(self._draw_frame, frame_s)
        self.load_error: str | None = None
        self.load_seconds: float | None = None
        self._load_started = time.monotonic()
        self._load_progress = ""     # what a slow load is doing (a GGUF's first conversion)
        self._engine_ready: asyncio.Event | None = None
        self._last_engine_error: str | None = None
        self._restarting = False            # F5: the engine is being restarted
        self._shown_trouble: str | None = None   # what the status line says is wrong with the engine
        self._labels_at = 0.0    # when the streaming tabs' headers last refreshed
        self.keymap: dict[str, str] = {}   # [tui.keys] as applied: action -> its keys

    # ---- layout ---------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            self._chat_tabs = ChatTabs(self.store, self.open_tabs, model_name=lambda: self.model_name,
                                       system_prompt=self.settings.chat.system_prompt,
                                       wait_for_engine=self.wait_for_engine,
                                       sampling_params=self.sampling_params,
                                       engine_trouble=self.engine_trouble, id="tabs")
            yield self._chat_tabs
            yield EnginePanel(id="engine-panel")
        yield Static(id="status")
        yield KeyFooter()

    def get_default_screen(self) -> ChatScreen:
        return ChatScreen(id="_default")

    @property
    def tabs(self) -> ChatTabs:
        return self.query_one(ChatTabs)

    @property
    def panel(self) -> EnginePanel:
        return self.query_one(EnginePanel)

    @property
    def chat_tabs(self) -> list[ChatTab]:
        return self.tabs.chat_tabs

    @property
    def active_tab(self) -> ChatTab | None:
        return self.tabs.active_tab

    @property
    def current_theme(self) -> Theme:
        """The theme by its name, looked up once per name: Textual's copies every registered
        theme into a new dict to find it, twice for each widget a screen update renders."""
        name, theme = self._theme_by_name
        if name != self.theme or theme is None:
            theme = super().current_theme
            self._theme_by_name = (self.theme, theme)
        return theme

    def register_theme(self, theme: Theme) -> None:
        super().register_theme(theme)
        self._theme_by_name = ("", None)   # the current name's theme may be another now

    def unregister_theme(self, theme_name: str) -> None:
        super().unregister_theme(theme_name)
        self._theme_by_name = ("", None)

    @property
    def model_name(self) -> str:
        if self.engine is not None:
            return self.engine.info.name
        return self.engine_config.model if self.engine_config is not None else "?"

    async def on_mount(self) -> None:
        self._engine_ready = asyncio.Event()
        self._catch_stop_signals()
        theme = self.settings.tui.theme
        if theme in self.available_themes:
            self.theme = theme
        else:
            self.notify(f"[tui] theme {theme!r} is unknown; themes: "
                        f"{', '.join(sorted(self.available_themes))}", severity="warning", markup=False)
        self._apply_keymap(self.settings.tui.keys)
        if self.store.notice:
            self.notify(self.store.notice, severity="warning", timeout=15, markup=False)
        if self.engine is None:
            self._load_engine()
        else:
            self._engine_loaded(self.engine, 0.0)
        self.panel.decode = self._decode
        if self.demo:
            await self.tabs.open_demo_tabs(self.demo)
        elif self.restore:
            await self.tabs.restore()
        if not self.chat_tabs:
            await self.tabs.open_new_chat()
        if self.active_tab is not None:
            await self.active_tab.ensure_loaded()
            self.active_tab.prompt.focus()
        self._update_status()
        self.frame_clock.start(self)

    def _apply_keymap(self, keys: dict[str, str]) -> None:
        known = {action for action, *_ in ACTIONS}
        unknown = sorted(set(keys) - known)
        if unknown:
            self.notify(f"[tui.keys]: unknown action(s) {', '.join(unknown)}; known: "
                        f"{', '.join(sorted(known))}", severity="error", timeout=15, markup=False)
        self.keymap = {action: key for action, key in keys.items() if action in known}
        self.set_keymap(self.keymap)

    # ---- the engine -----------------------------------------------------------------

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False)
    def _load_engine(self) -> None:
        started = time.monotonic()

        def progress(stage: str, done: int, total: int) -> None:  # the status line shows it
            self._load_progress = f"{stage} {done}/{total}"

        try:
            engine = self._start_engine(progress)
        except BaseException as error:  # shown in the status line and in any waiting tab
            try:
                self.call_from_thread(self._engine_failed, describe_error(error))
            except RuntimeError:
                pass
            return
        try:
            self.call_from_thread(self._engine_loaded, engine, time.monotonic() - started)
        except RuntimeError:  # the app closed while the model loaded
            engine.shutdown()

    def _start_engine(self, progress: ProgressHook) -> EngineClient:
        """The engine launched before the app, else one started now: in a process of its own
        ([tui] engine_process), or on a thread of the app."""
        starting = self._engine_start or start_engine(self.engine_config,
                                                      self.settings.tui.engine_process)
        self._engine_start = None
        return starting.result(progress)

    def _engine_loaded(self, engine: EngineClient, seconds: float) -> None:
        self.engine = engine
        self.load_seconds = seconds
        self._engine_ready.set()
        self._update_status()
        # What start-up built (Textual, the tokenizer, the restored chats) lives as long as
        # the app; frozen, a full collection while tabs stream does not walk it (a stall of
        # the UI thread, and of the engine beside it).
        gc.freeze()
        if seconds:
            self.notify(f"{engine.info.name} is ready ({seconds:.1f} s)", timeout=3, markup=False)
        if self.serve_port is not None:
            self._serve_api(engine)

    def _serve_api(self, engine: EngineClient) -> None:
        """--serve: the OpenAI-compatible API on this engine, on the app's event loop; its
        requests show in the block map under their own owner."""
        from paged_chat.server import ApiServer

        try:
            self.api_server = ApiServer(engine, port=self.serve_port, embedded=True,
                                        allowed_origins=self.settings.server.allowed_origins,
                                        share_cache_with_tui=self.settings.server.share_cache_with_tui,
                                        defaults=self.settings.request_defaults(
                                            engine.info.generation_defaults))
        except PagedChatError as error:
            self.notify(f"--serve: {error}", severity="error", timeout=30, markup=False)
            return
        self.run_worker(self.api_server.serve(), group="api", exit_on_error=False)
        self.notify(f"serving the API on {self.api_server.url}/v1", timeout=5, markup=False)

    def _engine_failed(self, message: str) -> None:
        self.load_error = message
        self._engine_ready.set()
        self._update_status()
        self.notify(f"the model failed to load: {message}", severity="error", timeout=30, markup=False)

    async def wait_for_engine(self) -> EngineClient:
        """The engine, once loaded; raises PagedChatError if it failed to load."""
        await self._engine_ready.wait()
        if self.engine is None:
            raise PagedChatError(f"the model failed to load: {self.load_error}")
        return self.engine

    def engine_trouble(self) -> str | None:
        """Why the engine cannot take a turn now (stopped, not responding, restarting);
        None while it serves or still loads (a turn then waits for it)."""
        engine = self.engine
        if self._restarting:
            return "the engine is restarting"
        if engine is None:
            return None
        restart = f"{self.keys_of('restart_engine')} restarts it"   # first: a narrow line keeps it
        if not engine.running:
            return f"the engine has stopped · {restart} · {engine.last_error or 'it was shut down'}"
        if engine.capabilities.restart and not engine.responding:
            return f"the engine is not responding · {restart} · its process is stopped or hung"
        return None

    def restart_engine(self) -> None:
        """Restart the engine the app started (its open replies end); the tabs stay."""
        if self._restarting:
            return
        if self.engine is None or not self.engine.capabilities.restart:
            self.notify("no engine of this app to restart" if self.engine is None else
                        "a remote engine is restarted where it runs", severity="warning", markup=False)
            return
        self._restarting = True
        self._load_started = time.monotonic()
        self._load_progress = ""
        self._update_status()
        self._restart(self.engine)

    @work(thread=True, exclusive=True, group="engine", exit_on_error=False)
    def _restart(self, engine: EngineClient) -> None:
        started = time.monotonic()
        try:
            engine.restart(RESTART_GRACE_S)
            failure = None
        except Exception as error:  # shown; the engine stays stopped, F5 tries again
            failure = describe_error(error)
        try:
            self.call_from_thread(self._restarted, time.monotonic() - started, failure)
        except RuntimeError:  # the app closed meanwhile: its unmount shuts the engine down
            pass

    def _restarted(self, seconds: float, failure: str | None) -> None:
        self._restarting = False
        if failure is None:
            self.load_seconds = seconds
            self._last_engine_error = None
            self.notify(f"the engine was restarted ({seconds:.1f} s)", timeout=3, markup=False)
        else:
            self.notify(f"the engine could not be restarted: {failure}", severity="error",
                        timeout=15, markup=False)
        self.frame_clock.tick()

    def model_sampling(self) -> dict:
        """What a tab samples with where it sets nothing: the model's generation config,
        else `[chat]` (Settings.model_sampling, as `ask`'s and `serve`'s)."""
        defaults = self.engine.info.generation_defaults if self.engine is not None else {}
        return self.settings.model_sampling(defaults)

    def sampling_params(self, sampling: dict) -> SamplingParams:
        """A tab's turn: its own sampling values over the model's (model_sampling)."""
        return self.settings.sampling_params(self.model_sampling(), **sampling)

    def _decode(self, ids) -> str:
        if self.engine is None:
            return ""
        return self.engine.info.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _draw_frame(self) -> None:
        """A frame: the status line while the engine loads or is in trouble; else the engine's
        latest snapshot (never blocks) in the panel, the shown tab's streaming reply, and
        every LABELS_EVERY_S the streaming tabs' headers."""
        if self.engine is None:
            if self.load_error is None:
                self._update_status()
            return
        if not self.screen_stack or not self.screen.is_attached:
            return  # shutting down
        trouble = self.engine_trouble()
        if trouble != self._shown_trouble:
            self._shown_trouble = trouble
            self._update_status()
            if trouble is not None and not self._restarting:
                self.notify(trouble, severity="error", timeout=10, markup=False)
        if trouble is not None:   # the last snapshot no longer says what runs
            if self._restarting:
                self._update_status()   # its seconds count up
            self.panel.show_trouble(trouble)
            return
        stats = self.engine.stats()
        try:
            self.panel.capabilities = self.engine.capabilities
            self.panel.show_stats(stats, with_request_owners(self.tabs.tab_infos(), stats.blocks))
        except NoMatches:  # the panel is being built or torn down
            return
        self.tabs.render_frame()
        if time.monotonic() - self._labels_at >= LABELS_EVERY_S:
            self._labels_at = time.monotonic()
            self.tabs.refresh_streaming_labels()
        error = self.engine.last_error
        if error and error != self._last_engine_error:
            self._last_engine_error = error
            self.notify(f"engine step failed: {error}", severity="error", timeout=10, markup=False)

    def on_resize(self) -> None:
        self._update_status()   # its parts are fitted to the width

    def _update_status(self) -> None:
        """The status line: its parts, the least needed left out first on a narrow terminal."""
        status = self.query_one("#status", Static)
        parts: list[Text] = []
        ranks: list[int] = []

        def part(text: Text | str, rank: int, style: str = "") -> None:
            parts.append(text if isinstance(text, Text) else Text(text, style=style))
            ranks.append(rank)

        trouble = self.engine_trouble()
        if self._restarting:
            part(f"◌ restarting the engine (the model loads again) … "
                 f"{time.monotonic() - self._load_started:.0f} s", 0, "yellow")
        elif trouble is not None:
            for rank, piece in enumerate(trouble.split(SEPARATOR)):
                part(("✖ " if not rank else "") + piece, rank, "bold red")
        elif self.engine is not None:
            info = self.engine.info
            part(Text.assemble(("● ", "green"), (info.name, "bold")), 0)
            for rank, piece in zip((2, 4, 5, 6), describe_where(self.engine.capabilities, info)
                                   .split(SEPARATOR)):
                part(piece, rank)
            if info.weights:
                part(info.weights, 8)
            part(f"max {info.max_model_len:,} tokens/seq", 7)
            if self.load_seconds:
                part(f"ready (loaded in {self.load_seconds:.1f} s)", 1, "dim")
        elif self.load_error is not None:
            part(f"✖ model failed to load: {self.load_error}", 0, "red")
        else:
            config = self.engine_config
            elapsed = time.monotonic() - self._load_started
            doing = f" · {self._load_progress}" if self._load_progress else ""
            part(f"◌ loading {config.model} ({config.device}, {config.dtype}){doing} … "
                 f"{elapsed:.0f} s — you can type already", 0, "yellow")
        if self.demo:
            part(f"demo: {self.demo} tabs chat by themselves (Esc pauses one)", 3, "italic")
        width = status.content_size.width or self.size.width - 2
        status.update(fit_parts(parts, width, ranks), layout=False)

    # ---- shutdown -------------------------------------------------------------------

    def _catch_stop_signals(self) -> None:
        """SIGTERM and SIGHUP quit as Ctrl+Q does: the terminal leaves the alternate screen
        with mouse reporting off, and a streaming reply is saved as stopped. Off the main
        thread signals cannot be caught: they act as usual."""
        loop = asyncio.get_running_loop()
        for signum in STOP_SIGNALS:
            try:
                loop.add_signal_handler(signum, self.exit, None, 128 + signum)
            except (ValueError, RuntimeError):
                return
            self._caught_signals.append(signum)

    async def on_unmount(self) -> None:
        gc.unfreeze()   # a process that goes on (a test's) collects what the app left
        loop = asyncio.get_running_loop()
        for signum in self._caught_signals:
            loop.remove_signal_handler(signum)
        if self.api_server is not None:
            self.api_server.stop()
        if self._owns_engine and self.engine is not None:
            engine, self.engine = self.engine, None
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown, QUIT_GRACE_S)
        if self.demo_dir is not None:
            self.store.close()
            shutil.rmtree(self.demo_dir, ignore_errors=True)


def describe_where(capabilities: ClientCapabilities, info: ModelInfo) -> str:
    """The status line's word on the engine: its device, dtype and pool, or where it is and
    what it does not show."""
    if capabilities.block_map:
        return f"{info.device} · {info.dtype} · {info.num_blocks:,} blocks × {info.block_size}"
    where = f"{capabilities.where} · no block map"
    return where if capabilities.metrics else where + " · no vLLM /metrics"
