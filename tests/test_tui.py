"""The TUI, driven with Textual's Pilot on a tiny random model, plus a tmux smoke test of the
real `paged-chat` command.

The tiny model here (`chat_model_dir`) has the default model's full vocabulary (the
`tiny_model_dir` of the engine tests has 512 ids, too few for a chat template's special
tokens), so real chat prompts run through the real tokenizer, template, Conversation and
store.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from textual import events
from textual._xterm_parser import XTermParser
from textual.widgets import Tabs

from paged_chat.engine import AsyncEngine, Engine, EngineConfig
from paged_chat.engine.stats import BlockMap
from paged_chat.session import chat_title
from paged_chat.settings import ChatSettings, Settings, TuiSettings
from paged_chat.store import ChatStore
from paged_chat.text import sanitize_for_terminal as clean
from paged_chat.tui.actions import ACTIONS, StoredChats
from paged_chat.tui.app import PagedChatApp
from paged_chat.tui.block_map import CACHED, FREE, SHARED, TAB0, BlockMapView, Layout, block_codes, cell_grid, downsample
from paged_chat.tui.chat_tab import ChatTab
from paged_chat.tui.dialogs import ChatSettingsScreen, HelpScreen, TextPromptScreen
from engine_helpers import assert_no_leaks, blocks_owned
from paged_chat.tui.engine_panel import TabInfo, describe_block, format_legend
from paged_chat.tui.markdown_text import hard_line_breaks
from paged_chat.tui.messages import AssistantMessage, ErrorMessage, UserMessage, code_blocks
from paged_chat.tui.prompt_input import PromptInput

SYSTEM = ("You are a careful assistant. You answer in short sentences, you check your facts, "
          "and you say when you do not know something. Keep every answer brief and friendly.")


def engine_config(model_dir: Path, **overrides) -> EngineConfig:
    values = dict(model=str(model_dir), device="cpu", dtype="float32", num_blocks=512,
                  block_size=16, max_num_seqs=16, max_num_batched_tokens=512)
    return EngineConfig(**{**values, **overrides})


@pytest.fixture
def make_async_engine(chat_model_dir):
    engines: list[AsyncEngine] = []

    def make(**overrides) -> AsyncEngine:
        engine = AsyncEngine(Engine(engine_config(chat_model_dir, **overrides)))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
        assert_no_leaks(engine.engine)


@pytest.fixture
def engine(make_async_engine) -> AsyncEngine:
    return make_async_engine()


class TuiTestApp(PagedChatApp):
    """The real app; replies ignore EOS so a random model's reply has a known length."""

    def sampling_params(self, sampling: dict):
        return self.settings.sampling_params(**{"ignore_eos": True, **sampling})


def make_settings(max_tokens: int = 24, system_prompt: str | None = SYSTEM, **tui) -> Settings:
    return Settings(chat=ChatSettings(system_prompt=system_prompt, temperature=0.0,
                                      max_tokens=max_tokens),
                    tui=TuiSettings(**tui))


def make_app(engine, tmp_path: Path, settings: Settings | None = None, **kwargs) -> TuiTestApp:
    return TuiTestApp(settings or make_settings(), engine=engine,
                   store=ChatStore(tmp_path / "chats.db"),
                   session_path=tmp_path / "session.json", **kwargs)


async def wait_until(pilot, condition, timeout: float = 30.0, step: float = 0.02) -> None:
    """Poll `condition` (plain sleeps: Pilot.pause waits for the screen to settle, which
    takes seconds while replies stream)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for the condition on "
                                 f"line {condition.__code__.co_firstlineno}")
        await asyncio.sleep(step)


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
    await wait_until(pilot, lambda: len(app.chat_tabs) == count + 1
                     and app.active_tab is app.chat_tabs[-1]
                     and app.focused is app.chat_tabs[-1].prompt)
    return app.chat_tabs[-1]


def idle(app: PagedChatApp) -> bool:
    return not any(tab.streaming for tab in app.chat_tabs)


class Watcher:
    """Samples the engine and the block map every 10 ms in the background of a test."""

    def __init__(self, app: PagedChatApp, engine: AsyncEngine) -> None:
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
    return list(tab.query(AssistantMessage))


# ---- the block map, without an app ---------------------------------------------------


def _block_map(num_blocks: int, tables: dict[str, list[int]], owners: dict[str, str],
               cached: list[int] = ()) -> BlockMap:
    ref = np.zeros(num_blocks, dtype=np.int32)
    for table in tables.values():
        for block in table:
            ref[block] += 1
    hashed = np.zeros(num_blocks, dtype=bool)
    hashed[list(cached)] = True
    return BlockMap.build(ref, hashed, tables, owners)


@pytest.mark.timeout(30)
def test_block_codes_colour_shared_cached_free():
    blocks = _block_map(8, {"a/1": [0, 1, 2], "b/1": [0, 3], "x": [4]},
                        {"a/1": "tab-a", "b/1": "tab-b", "x": "cli"}, cached=[5])
    codes = block_codes(blocks, {"tab-a": 0, "tab-b": 1})
    assert codes.tolist() == [SHARED, TAB0, TAB0, TAB0 + 1, 3, CACHED, FREE, FREE]


@pytest.mark.timeout(30)
def test_layout_fits_any_pool_size():
    assert Layout.fit(100, 40, 10) == Layout(100, 40, 3, half=False)
    half = Layout.fit(600, 40, 10)
    assert half.half and half.per_pixel == 1 and half.rows == 8
    assert half.blocks_at(0, 0) == (0, 40) and half.cell_of(41) == (1, 0)
    for num_blocks in (10_000, 65_536, 1_000_003):
        layout = Layout.fit(num_blocks, 44, 18)
        assert layout.half and layout.rows <= 18
        assert layout.rows * layout.width * 2 * layout.per_pixel >= num_blocks
        top, bottom = cell_grid(np.zeros(num_blocks, dtype=np.uint8), layout)
        assert top.shape == bottom.shape == (layout.rows, 44)
    # A scaled cell shows the most telling block it stands for.
    assert downsample(np.array([FREE, CACHED, TAB0, FREE, SHARED, TAB0 + 1], np.uint8), 3).tolist() \
        == [TAB0, SHARED]


@pytest.mark.timeout(30)
def test_block_detail_shows_tokens_of_the_block():
    blocks = _block_map(4, {"a/1": [2, 0]}, {"a/1": "tab-a"})
    tokens = list(range(100, 132))
    info = {"tab-a": TabInfo("Alpha", 0, lambda rid: tokens if rid == "a/1" else None)}
    plain = describe_block(0, blocks, 16, info, lambda ids: " ".join(map(str, ids))).plain
    assert "block 0" in plain and "ref 1" in plain and "owners: Alpha" in plain
    # Block 0 is the request's second block (BlockMap.holder_positions): tokens 16..31.
    assert "tokens 16–31" in plain and "116 117" in plain


@pytest.mark.timeout(30)
def test_legend_lists_the_chats_holding_blocks_first():
    tabs = {f"tab-{n}": TabInfo(f"Tab {n}", n, lambda rid: None) for n in range(8)}
    plain = format_legend(tabs, holders=["tab-6", "gone", "tab-2"]).plain.replace("\u00a0", " ")
    assert plain.startswith("█ Tab 6  █ Tab 2  █ Tab 0  █ Tab 1  █ Tab 3")
    assert plain.count("Tab 6") == 1


@pytest.mark.timeout(30)
async def test_escape_sequences_in_text_never_reach_the_terminal():
    from textual.app import App
    from paged_chat.tui.messages import AssistantMessage, UserMessage

    evil = "ok\x1b[2J\x1b]0;pwned\x07 done\r"
    reply, user = AssistantMessage(), UserMessage(evil)

    class Host(App):
        def compose(self):
            yield user
            yield reply

    async with Host().run_test() as pilot:
        await reply.write(evil)
        await reply.finish_stream()
        await pilot.pause()
        assert reply.text == evil                               # exact, for copy
        assert reply._chunks[0].source == "ok done"             # shown clean
        assert "\x1b" not in str(user.content) and "ok done" in str(user.content)


@pytest.mark.timeout(30)
def test_code_blocks_are_found():
    text = "Here:\n```python\nprint(1)\n```\nand\n~~~\nls -l\n~~~\n"
    assert code_blocks(text) == ["print(1)\n", "ls -l\n"]


@pytest.mark.timeout(60)
async def test_long_reply_streams_into_bounded_markdown_chunks():
    """A long reply is split at paragraph breaks outside code fences, so each Markdown
    append stays small (no quadratic re-parse); a hidden tab's reply renders at the end."""
    from textual.app import App
    from paged_chat.tui import messages as m

    paragraph = "word " * 100 + "\n\n"
    fence = "```python\n" + "x = 1\n\n" * 300 + "```\n\n"
    reply = m.AssistantMessage()
    hidden = m.AssistantMessage()

    class Host(App):
        def compose(self):
            yield reply
            yield hidden

    async with Host().run_test() as pilot:
        text = paragraph * 30 + fence + paragraph * 10
        for start in range(0, len(text), 37):
            await reply.write(text[start:start + 37])
            await hidden.write(text[start:start + 37], render=False)
        await reply.finish_stream()
        await hidden.finish_stream(render=False)
        assert hidden._chunks[0].source == ""          # nothing rendered while hidden
        await hidden.catch_up()
        await pilot.pause()
        sources = [chunk.source for chunk in reply._chunks]
        assert "".join(sources) == hard_line_breaks(text) and reply.text == text
        assert len(sources) > 3 and all(s.count("```") % 2 == 0 for s in sources)
        assert max(len(s) for s in sources if "```" not in s) < m.CHUNK_CHARS + 600
        assert hidden._chunks[0].source == hard_line_breaks(text) and len(hidden._chunks) == 1


@pytest.mark.timeout(60)
async def test_single_line_breaks_in_a_reply_are_shown_as_line_breaks():
    """A poem stored as `force,\nA gentle lapping` showed `force, A gentle lapping`."""
    from textual.app import App
    from textual.widgets._markdown import MarkdownParagraph

    poem = "The tide's force,\nA gentle lapping\n\n```\nkeep\nthis\n```\n"
    stored, streamed = AssistantMessage(poem), AssistantMessage()

    class Host(App):
        def compose(self):
            yield stored
            yield streamed

    async with Host().run_test(size=(80, 24)) as pilot:
        for start in range(0, len(poem), 3):
            await streamed.write(poem[start:start + 3])
        await streamed.finish_stream()
        await pilot.pause()
        for reply in (stored, streamed):
            [paragraph] = reply.query(MarkdownParagraph)
            assert str(paragraph.render()) == "The tide's force,\nA gentle lapping"
            assert reply.text == poem and code_blocks(reply.text) == ["keep\nthis\n"]


# ---- Pilot tests ---------------------------------------------------------------------


@pytest.mark.timeout(180)
async def test_tabs_stream_concurrently_and_share_blocks(engine, tmp_path):
    """Four tabs, prompts typed in each: every tab gets a reply, the engine batches them,
    and the block map shows blocks of several tabs and the shared system-prompt blocks."""
    app = make_app(engine, tmp_path, make_settings(max_tokens=300))
    async with app.run_test(size=(140, 44)) as pilot:
        watcher = Watcher(app, engine)
        for index in range(4):
            if index:
                await new_tab(pilot)
            await type_prompt(pilot, f"hello from tab {index}")
        assert len(app.chat_tabs) == 4
        await wait_until(pilot, lambda: idle(app), timeout=120)
        watcher.stop()
        assert watcher.max_batch > 1, "the engine never batched two tabs"
        assert len(watcher.tab_codes) >= 2, "the block map never showed blocks of two tabs"
        assert watcher.shared_seen, "the shared system-prompt blocks never showed"
        for tab in app.chat_tabs:   # each shown in turn: hidden replies render when shown
            app.tabs.active = tab.id
            await wait_until(pilot, lambda: app.active_tab is tab and tab.display)
            await pilot.pause()
            [reply] = replies(tab)
            assert len(tab.session.turn.token_ids) == 300 and reply.text
            # Hidden tabs buffer while streaming; every reply ends fully rendered.
            assert "".join(chunk.source for chunk in reply._chunks) == hard_line_breaks(clean(reply.text))
            assert "ttft" in reply.footer and "t/s" in app.tabs.get_tab(tab.id).label.plain
        assert engine.stats().prefix_cache_hit_tokens > 0


@pytest.mark.timeout(180)
async def test_fork_shares_every_full_block(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=40))
    async with app.run_test(size=(120, 40)) as pilot:
        await type_prompt(pilot, "tell me about paging")
        await wait_until(pilot, lambda: idle(app))
        original = app.active_tab
        history = len(original.session.conversation.token_ids)
        fork = await new_tab(pilot, "ctrl+f")
        assert fork is not original and fork.title.endswith("(fork)")
        assert [m.text for m in fork.query(UserMessage)] == ["tell me about paging"]
        assert fork.session.conversation.token_ids == original.session.conversation.token_ids
        # Both tabs answer the same follow-up at once: their histories' blocks are shared.
        original.session.sampling = fork.session.sampling = {"max_tokens": 300}
        shared = []

        async def watch():
            while True:
                stats = engine.stats()
                shared.append(len(np.intersect1d(blocks_owned(stats, original.chat_id),
                                                 blocks_owned(stats, fork.chat_id))))
                await asyncio.sleep(0.01)

        watching = asyncio.get_running_loop().create_task(watch())
        await type_prompt(pilot, "and segmentation?")
        app.tabs.active = original.id
        await wait_until(pilot, lambda: app.focused is original.prompt)
        await type_prompt(pilot, "and segmentation?")
        await wait_until(pilot, lambda: idle(app), timeout=120)
        watching.cancel()
        assert max(shared) >= history // 16
        assert fork.session.turn.num_cached_tokens >= history // 16 * 16


@pytest.mark.timeout(120)
async def test_stop_frees_blocks(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=5000))
    async with app.run_test(size=(120, 40)) as pilot:
        await type_prompt(pilot, "go on forever")
        tab = app.active_tab
        await wait_until(pilot, lambda: tab.session.turn is not None and len(tab.session.turn.token_ids) > 8)
        assert engine.stats().blocks_in_use > 0
        await press(pilot, "escape")
        await wait_until(pilot, lambda: idle(app))
        await wait_until(pilot, lambda: engine.stats().blocks_in_use == 0, timeout=5)
        [reply] = replies(tab)
        assert reply.footer.endswith("stopped") and reply.text
        [stored] = [m for m in app.store.get_chat(tab.chat_id).messages if m.role == "assistant"]
        assert stored.finish_reason == "abort" and stored.token_ids == tab.session.conversation.token_ids[-len(stored.token_ids):]
        # The stopped reply is part of the context: the next turn reuses its blocks.
        tab.session.sampling = {"max_tokens": 4}
        await type_prompt(pilot, "short one")
        await wait_until(pilot, lambda: idle(app))
        assert tab.session.turn.num_cached_tokens > 0


@pytest.mark.timeout(180)
async def test_restart_restores_chats_lazily(engine, tmp_path):
    settings = make_settings(max_tokens=16)
    app = make_app(engine, tmp_path, settings)
    async with app.run_test(size=(120, 40)) as pilot:
        await type_prompt(pilot, "first chat")
        await wait_until(pilot, lambda: idle(app))
        await new_tab(pilot)
        await type_prompt(pilot, "second chat")
        await wait_until(pilot, lambda: idle(app))
        first, second = app.chat_tabs
        ids = [first.chat_id, second.chat_id]
        history = list(first.session.conversation.token_ids)
        replies_before = [replies(t)[0].text for t in (first, second)]
    app.store.close()

    app = make_app(engine, tmp_path, settings)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        tabs = app.chat_tabs
        assert [t.chat_id for t in tabs] == ids
        assert [t.title for t in tabs] == ["first chat", "second chat"]
        assert app.active_tab is tabs[1]           # the tab that was active
        assert tabs[0]._loaded is False            # not loaded until shown
        assert replies(tabs[1])[0].text == replies_before[1]
        await asyncio.sleep(0.3)   # the tab bar's own activation messages from the restore
        await press(pilot, "ctrl+pageup")
        await wait_until(pilot, lambda: tabs[0]._loaded and replies(tabs[0])
                         and app.focused is tabs[0].prompt)
        assert replies(tabs[0])[0].text == replies_before[0]
        # A follow-up prompt continues from the exact stored ids: the prefix cache hits.
        await type_prompt(pilot, "and again")
        await wait_until(pilot, lambda: idle(app))
        assert tabs[0].session.conversation.token_ids[:len(history)] == history
        assert tabs[0].session.turn.num_cached_tokens >= len(history) // 16 * 16


@pytest.mark.timeout(120)
async def test_long_chat_mounts_lazily(engine, tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat("long", "tiny")
    for index in range(100):
        store.add_message(chat.id, "user", f"question {index}", [1])
        store.add_message(chat.id, "assistant", f"answer {index}", [2], "stop")
    store.close()
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        tab = app.active_tab
        assert len(tab.query(".message")) == 30
        assert tab.query_one(UserMessage).text == "question 85"
        tab.query_one(".earlier").press()
        await wait_until(pilot, lambda: len(tab.query(".message")) == 60)
        assert tab.query_one(UserMessage).text == "question 70"


@pytest.mark.timeout(120)
async def test_model_loads_in_a_worker_while_the_ui_is_open(chat_model_dir, tmp_path, monkeypatch):
    from_config = AsyncEngine.from_config.__func__
    loading_seen = threading.Event()

    def slow_load(cls, config, on_progress):  # the tiny model loads too fast to see "loading"
        on_progress("converting weights", 3, 10)
        loading_seen.wait(60)
        return from_config(cls, config)

    monkeypatch.setattr(AsyncEngine, "from_config", classmethod(slow_load))
    settings = make_settings(max_tokens=8)
    app = TuiTestApp(settings, engine_config=engine_config(chat_model_dir),
                  store=ChatStore(tmp_path / "chats.db"), session_path=tmp_path / "s.json")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        await wait_until(pilot, lambda: "converting weights 3/10" in text_of(app.query_one("#status")))
        assert "loading" in text_of(app.query_one("#status"))
        await type_prompt(pilot, "typed before the model is ready")   # waits for the model
        assert app.engine is None
        loading_seen.set()
        await wait_until(pilot, lambda: app.engine is not None, timeout=60)
        await wait_until(pilot, lambda: idle(app))
        assert "ready" in text_of(app.query_one("#status"))
        assert replies(app.active_tab)[0].text
        engine = app.engine
    assert engine._thread.is_alive() is False   # the app shut down the engine it loaded


@pytest.mark.timeout(60)
async def test_model_load_failure_is_shown(tmp_path):
    app = TuiTestApp(make_settings(), engine_config=EngineConfig(model=str(tmp_path / "missing")),
                  store=ChatStore(tmp_path / "chats.db"), session_path=tmp_path / "s.json")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.load_error is not None)
        assert "failed to load" in text_of(app.query_one("#status"))
        await type_prompt(pilot, "hello?")
        await wait_until(pilot, lambda: idle(app))
        assert "failed to load" in text_of(app.active_tab.query_one(ErrorMessage))


@pytest.mark.timeout(120)
async def test_engine_error_shows_in_the_tab_and_the_app_carries_on(engine, tmp_path):
    runner = engine.engine.runner
    execute = runner.execute
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device fault")
        return execute(*args, **kwargs)

    runner.execute = failing_once
    app = make_app(engine, tmp_path, make_settings(max_tokens=8))
    async with app.run_test(size=(120, 40)) as pilot:
        await type_prompt(pilot, "this one fails")
        await wait_until(pilot, lambda: idle(app))
        tab = app.active_tab
        assert "simulated device fault" in text_of(tab.query_one(ErrorMessage))
        await type_prompt(pilot, "this one works")
        await wait_until(pilot, lambda: idle(app))
        assert replies(tab)[-1].text and len(tab.session.turn.token_ids) == 8


@pytest.mark.timeout(180)
async def test_a_one_megabyte_paste_gets_an_error_and_is_kept(engine, tmp_path):
    paste = ("All work and no play makes Jack a dull boy.\n" * 25_000)[:1_000_000]
    app = make_app(engine, tmp_path, make_settings(max_tokens=8))
    async with app.run_test(size=(120, 40)) as pilot:
        tab = app.active_tab
        tab.prompt.text = paste
        await press(pilot, "enter")
        await wait_until(pilot, lambda: idle(app) and tab.query(ErrorMessage), timeout=150)
        assert "max_model_len" in text_of(tab.query_one(ErrorMessage))
        [user] = [m for m in app.store.get_chat(tab.chat_id).messages if m.role == "user"]
        assert user.content == paste, "what the user wrote is kept"
        await type_prompt(pilot, "still here")
        await wait_until(pilot, lambda: idle(app))
        assert replies(tab)[-1].text


@pytest.mark.timeout(60)
async def test_prompt_input_keys(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=2))
    async with app.run_test(size=(120, 40)) as pilot:
        prompt = app.active_tab.prompt
        await press(pilot, "a", "ctrl+j", "b", "shift+enter", "c")
        await wait_until(pilot, lambda: prompt.text == "a\nb\nc")
        await press(pilot, "enter")
        await wait_until(pilot, lambda: prompt.text == "" and idle(app))
        assert [m.text for m in app.active_tab.query(UserMessage)] == ["a\nb\nc"]
        await type_prompt(pilot, "second")
        await wait_until(pilot, lambda: prompt.text == "" and idle(app))
        await press(pilot, "x", "up")
        await wait_until(pilot, lambda: prompt.text == "second")
        await press(pilot, "up")
        await wait_until(pilot, lambda: prompt.text == "a\nb\nc")
        await press(pilot, "down", "down", "down")   # through the last line, back to the draft
        await wait_until(pilot, lambda: prompt.text == "x")


def terminal_keys(data: str) -> list[events.Key]:
    """The key events Textual's terminal parser makes of `data` as a terminal sends it
    (Alt+C arrives as ESC c: key `alt+c` with the printable character `c`)."""
    parser = XTermParser()
    return [*parser.feed(data), *parser.feed("")]


@pytest.mark.timeout(180)
async def test_alt_c_and_alt_x_in_the_focused_prompt_copy_and_type_nothing(engine, tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat("Code", "tiny", None, {})
    store.add_message(chat.id, "user", "show me", [1])
    store.add_message(chat.id, "assistant", "Here:\n```python\nprint(1)\n```\n", [2], "stop")
    (tmp_path / "session.json").write_text(json.dumps({"open": [chat.id], "active": chat.id}))
    app = TuiTestApp(make_settings(), engine=engine, store=store,
                     session_path=tmp_path / "session.json")
    async with app.run_test(size=(80, 24)) as pilot:
        prompt = app.active_tab.prompt
        await wait_until(pilot, lambda: app.focused is prompt and app.active_tab.last_reply())
        await press(pilot, *"draft")
        for key in terminal_keys("\x1bc"):
            app.post_message(key)
        await wait_until(pilot, lambda: app.clipboard == "Here:\n```python\nprint(1)\n```\n")
        for key in terminal_keys("\x1bx"):
            app.post_message(key)
        await wait_until(pilot, lambda: app.clipboard == "print(1)\n")
        assert prompt.text == "draft" and app.focused is prompt


@pytest.mark.timeout(180)
async def test_an_80x24_terminal_gives_the_chat_the_width_until_it_grows(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=2))
    async with app.run_test(size=(80, 24)) as pilot:
        tab = app.active_tab
        prompt = tab.prompt
        await wait_until(pilot, lambda: prompt.size.width >= 60 and not app.panel.display)
        await pilot.resize_terminal(140, 44)
        await wait_until(pilot, lambda: app.panel.display and prompt.size.width >= 60)
        await pilot.resize_terminal(80, 24)
        await wait_until(pilot, lambda: not app.panel.display and prompt.size.width >= 60)
        await press(pilot, "f8")                              # asked for: shown even here
        await wait_until(pilot, lambda: app.panel.display)
        await press(pilot, "f8")
        await wait_until(pilot, lambda: not app.panel.display)
        # The sampling line wraps rather than stopping after `temperature 0.2,`.
        tab.apply_settings(tab.session.system_prompt, {"temperature": 0.2, "top_p": 0.9,
                                                       "repetition_penalty": 1.1, "seed": 7})
        info = tab.query_one(".chat-info")
        await wait_until(pilot, lambda: info.size.height >= 2)
        assert "seed 7" in text_of(info)
        # Chats are titled as `ask` titles them: the first line, up to TITLE_LENGTH.
        question = "Explain in detail how a paged KV cache shares the blocks of a prefix"
        await type_prompt(pilot, question)
        await wait_until(pilot, lambda: idle(app) and app.store.get_chat(tab.chat_id).title != "Chat 1")
        assert tab.title == app.store.get_chat(tab.chat_id).title == chat_title(question)
        assert len(tab.title) > 25


@pytest.mark.timeout(180)
async def test_restored_tabs_show_the_active_label_and_new_chats_count_open_tabs(engine, tmp_path):
    """With 6 stored chats and 2 tabs open, the next new tab is `Chat 3` (it was `Chat 7`),
    and the active tab's label is in view after a restart though it is the last one."""
    store = ChatStore(tmp_path / "chats.db")
    chats = [store.create_chat(f"A chat with quite a long title, number {n}", "tiny", None, {})
             for n in range(6)]
    open_ids = [chats[0].id, chats[5].id]
    (tmp_path / "session.json").write_text(json.dumps({"open": open_ids, "active": chats[5].id}))
    app = TuiTestApp(make_settings(), engine=engine, store=store,
                     session_path=tmp_path / "session.json")

    def active_label_shown() -> bool:
        bar = app.tabs.query_one(Tabs)
        header = app.tabs.get_tab(app.active_tab.id)
        return header.region.width > 0 and bar.region.contains_region(header.region)

    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: app.active_tab.chat_id == chats[5].id and active_label_shown())
        tab = await new_tab(pilot)
        assert tab.title == "Chat 3"
        await wait_until(pilot, active_label_shown)


@pytest.mark.timeout(120)
async def test_keys_typed_right_after_ctrl_n_or_alt_right_land_in_the_new_tab(engine, tmp_path):
    """Keys already queued behind Ctrl+N (a fast typist, a tmux send-keys) went to the
    previous tab's prompt: the focus moved only after them."""
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        first = app.active_tab
        await wait_until(pilot, lambda: app.focused is first.prompt)
        await press(pilot, "ctrl+n", *"hi")
        await wait_until(pilot, lambda: len(app.chat_tabs) == 2 and app.chat_tabs[1].prompt.text == "hi")
        await press(pilot, "alt+left", *"yo")
        await wait_until(pilot, lambda: first.prompt.text == "yo")
        assert first.prompt.text == "yo" and app.chat_tabs[1].prompt.text == "hi"


@pytest.mark.timeout(120)
async def test_regenerate_copy_and_broadcast(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=12))
    async with app.run_test(size=(120, 40)) as pilot:
        await type_prompt(pilot, "hi")
        await wait_until(pilot, lambda: idle(app))
        tab = app.active_tab
        first = replies(tab)[0].text
        tab.session.sampling = {"temperature": 1.0, "seed": 7}
        await press(pilot, "ctrl+r")
        await wait_until(pilot, lambda: idle(app))
        [reply] = replies(tab)
        assert reply.text != first
        stored = app.store.get_chat(tab.chat_id).messages
        assert [m.role for m in stored] == ["user", "assistant"] and stored[1].content == reply.text
        await press(pilot, "alt+c")
        assert app.clipboard == reply.text
        # Broadcast the typed prompt to every tab.
        await new_tab(pilot)
        await press(pilot, *"both", "ctrl+b")
        await wait_until(pilot, lambda: all(len(replies(t)) >= 1 for t in app.chat_tabs))
        await wait_until(pilot, lambda: idle(app))
        assert [m.text for m in app.chat_tabs[0].query(UserMessage)][-1] == "both"
        assert [m.text for m in app.chat_tabs[1].query(UserMessage)] == ["both"]


@pytest.mark.timeout(120)
async def test_dialogs_rename_settings_close(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=2000))
    async with app.run_test(size=(120, 40)) as pilot:
        tab = app.active_tab
        await press(pilot, "f2")
        await wait_until(pilot, lambda: isinstance(app.screen, TextPromptScreen))
        app.screen.query_one("#text").value = "Renamed"
        await press(pilot, "enter")
        await wait_until(pilot, lambda: "Renamed" in app.tabs.get_tab(tab.id).label.plain)
        assert tab.title == app.store.get_chat(tab.chat_id).title == "Renamed"
        await press(pilot, "f4")
        await wait_until(pilot, lambda: isinstance(app.screen, ChatSettingsScreen))
        app.screen.query_one("#system-prompt").text = "Be terse."
        app.screen.query_one("#f-temperature").value = "-1"
        await press(pilot, "ctrl+s")
        await wait_until(pilot, lambda: "temperature" in text_of(app.screen.query_one("#settings-error")))
        app.screen.query_one("#f-temperature").value = "0.5"
        await press(pilot, "ctrl+s")
        await wait_until(pilot, lambda: not isinstance(app.screen, ChatSettingsScreen)
                         and tab.session.system_prompt == "Be terse.")
        chat = app.store.get_chat(tab.chat_id)
        assert chat.system_prompt == "Be terse." and chat.sampling == {"temperature": 0.5}
        # Closing a streaming tab asks first.
        await type_prompt(pilot, "long reply")
        await wait_until(pilot, lambda: tab.session.turn is not None and len(tab.session.turn.token_ids) > 2)
        await press(pilot, "ctrl+w")
        await wait_until(pilot, lambda: app.screen.__class__.__name__ == "ConfirmScreen")
        await press(pilot, "n")
        assert tab.is_attached and tab.streaming
        await press(pilot, "ctrl+w")
        await wait_until(pilot, lambda: app.screen.__class__.__name__ == "ConfirmScreen")
        await press(pilot, "y")
        await wait_until(pilot, lambda: not tab.is_attached)
        assert len(app.chat_tabs) == 1                           # a fresh tab replaced it
        await wait_until(pilot, lambda: engine.stats().blocks_in_use == 0, timeout=5)
        stored = app.store.get_chat(tab.chat_id).messages
        assert stored[-1].finish_reason == "abort" and stored[-1].token_ids
        # The closed chat stays in the store; the palette's "Open chat" brings it back.
        assert [c.id for c in app.closed_chats()] == [tab.chat_id]
        provider = StoredChats(app.screen)
        [hit] = [hit async for hit in provider.search("renamed")]
        assert "Open chat: Renamed" in str(hit.text)
        await hit.command()
        await wait_until(pilot, lambda: app.active_tab.chat_id == tab.chat_id
                         and len(app.active_tab.query(UserMessage)) == 1)
        assert app.active_tab.title == "Renamed"


@pytest.mark.timeout(60)
async def test_palette_help_keymap_and_theme(engine, tmp_path):
    settings = make_settings(theme="gruvbox", keys={"new_chat": "ctrl+t", "help": "f10"})
    app = make_app(engine, tmp_path, settings)
    async with app.run_test(size=(120, 40)) as pilot:
        assert app.theme == "gruvbox"
        commands = {command.title: command.help for command in app.get_system_commands(app.screen)}
        assert {description for _, _, _, description, _ in ACTIONS} <= set(commands)
        assert commands["New chat"] == "key: ^t" and commands["Copy the last reply"] == "key: alt+c"
        assert not any(help.startswith("action:") for help in commands.values())
        await new_tab(pilot, "ctrl+t")
        await press(pilot, "f10")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
        assert ("^t", "New chat") in app.key_help()
        await press(pilot, "escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, HelpScreen))
        await press(pilot, "f8")
        await wait_until(pilot, lambda: app.panel.has_class("collapsed"))


@pytest.mark.timeout(240)
async def test_demo_tabs_chat_by_themselves(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=24), demo=4)
    async with app.run_test(size=(140, 44)) as pilot:
        assert len(app.chat_tabs) == 4
        max_batch = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                len(replies(t)) >= 2 for t in app.chat_tabs):
            max_batch = max(max_batch, engine.stats().batch_size)
            await pilot.pause(0.02)
        assert all(len(replies(t)) >= 2 for t in app.chat_tabs)
        assert max_batch > 1
        systems = [t.session.system_prompt for t in app.chat_tabs]
        assert systems[0] == systems[2]   # shared system prompt across demo tabs


@pytest.mark.timeout(240)
async def test_keypress_echo_latency_while_eight_tabs_stream(engine, tmp_path):
    """Time from a key event reaching the app to its character being in the input, while
    eight other tabs stream (nine demo tabs; the one typed into is paused)."""
    app = make_app(engine, tmp_path, make_settings(max_tokens=900), demo=9)
    async with app.run_test(size=(140, 44)) as pilot:
        tab = app.active_tab
        app.pause_demo(tab)
        await wait_until(pilot, lambda: not tab.streaming, timeout=120)
        await wait_until(pilot, lambda: engine.stats().num_running >= 6, timeout=60)
        prompt = tab.prompt
        prompt.focus()
        samples, running = [], []
        deadline = time.monotonic() + 120
        while len(samples) < 40 and time.monotonic() < deadline:
            streaming = engine.stats().num_running
            if streaming < 6:   # between demo turns: wait for the batch to refill
                await asyncio.sleep(0.05)
                continue
            char = "abcdefghij"[len(samples) % 10]
            before = prompt.text
            started = time.perf_counter()
            app.post_message(events.Key(char, char))
            while prompt.text == before:
                await asyncio.sleep(0.0005)
            samples.append(time.perf_counter() - started)
            running.append(streaming)
            await asyncio.sleep(0.05)
        samples.sort()
        print(f"\nkeypress->echo while {min(running)}-{max(running)} sequences stream "
              f"(mean {statistics.mean(running):.1f}): median {samples[len(samples) // 2] * 1000:.1f} ms, "
              f"p90 {samples[int(len(samples) * 0.9)] * 1000:.1f} ms, "
              f"p95 {samples[int(len(samples) * 0.95)] * 1000:.1f} ms, max {samples[-1] * 1000:.1f} ms")
        assert len(samples) >= 20
        assert samples[len(samples) // 2] < 0.1


# ---- the real command in tmux ----------------------------------------------------------


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


class TmuxApp:
    """The real `paged-chat` (python -m paged_chat) in a 120x40 tmux pane, with its own
    config and chat store under `tmp_path`."""

    def __init__(self, model_dir: Path, tmp_path: Path, max_tokens: int) -> None:
        config = tmp_path / "config.toml"
        config.write_text(f'[engine]\nmodel = "{model_dir}"\ndevice = "cpu"\ndtype = "float32"\n'
                          f'num_blocks = 512\n\n[chat]\ntemperature = 0.0\nmax_tokens = {max_tokens}\n')
        self.store_path = tmp_path / "data" / "chats.db"
        # Without COLUMNS/LINES (set by pytest plugins): Textual would take them over the pane's size.
        env = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
        env = {**env, "PAGED_CHAT_CONFIG": str(config), "PAGED_CHAT_DATA_DIR": str(tmp_path / "data"),
               "PAGED_CHAT_CACHE_DIR": os.environ["PAGED_CHAT_CACHE_DIR"], "TERM": "xterm-256color"}
        self.session = f"paged-chat-test-{os.getpid()}"
        self.socket = ["-L", self.session]
        subprocess.run(["tmux", *self.socket, "new-session", "-d", "-s", self.session, "-x", "120",
                        "-y", "40",
                        *[arg for key in ("PAGED_CHAT_CONFIG", "PAGED_CHAT_DATA_DIR",
                                          "PAGED_CHAT_CACHE_DIR", "HF_HUB_OFFLINE", "TERM")
                          for arg in ("-e", f"{key}={env[key]}")],
                        f"{sys.executable} -m paged_chat"], check=True, env=env)

    def screen(self) -> str:
        return _tmux(*self.socket, "capture-pane", "-p", "-t", self.session)

    def keys(self, *keys: str, literal: bool = False) -> None:
        _tmux(*self.socket, "send-keys", "-t", self.session, *(["-l"] if literal else []), *keys)

    def wait_for(self, predicate, timeout: float = 180.0) -> str:
        """The screen once `predicate` holds for it (a generous bound: the machine may be
        busy, and nothing here depends on time)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if predicate(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; the screen was:\n{text}")
            time.sleep(0.1)

    def kill_server(self) -> None:
        subprocess.run(["tmux", *self.socket, "kill-server"], capture_output=True)


def new_tab_shown(screen: str) -> bool:
    """Chat 2's empty tab is on screen: the handler that showed it also asked for its
    prompt's focus, so keys sent from now on land in it."""
    return "Chat 2" in screen and "╭─ you" not in screen


needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (apt-get install tmux)")


@pytest.mark.timeout(600)
@needs_tmux
def test_paged_chat_in_tmux(chat_model_dir, tmp_path):
    app = TmuxApp(chat_model_dir, tmp_path, max_tokens=24)
    try:
        app.wait_for(lambda s: "ready" in s and "KV cache" in s)
        app.keys("hello from tmux one", literal=True)
        app.keys("Enter")
        app.wait_for(lambda s: "24 tok" in s)
        app.keys("C-n")
        app.wait_for(new_tab_shown)
        app.keys("second tab says hi", literal=True)
        app.wait_for(lambda s: "second tab says hi" in s)   # in the shown (new) tab's prompt
        app.keys("Enter")
        text = app.wait_for(lambda s: "second tab says hi" in s and "24 tok" in s)
        assert "hello from tmux one" in text          # the first tab's title
        assert "assistant" in text and "blocks × 16" in text
        app.keys("C-q")
        app.wait_for(lambda s: "KV cache" not in s)
    finally:
        app.kill_server()
    store = ChatStore(app.store_path)
    chats = store.list_chats()
    assert sorted(c.title for c in chats) == ["hello from tmux one", "second tab says hi"]
    for chat in chats:
        roles = [m.role for m in store.get_chat(chat.id).messages]
        assert roles == ["user", "assistant"]
    store.close()


@pytest.mark.timeout(600)
@needs_tmux
def test_kill_9_while_two_tabs_stream_keeps_every_committed_message(chat_model_dir, tmp_path):
    app = TmuxApp(chat_model_dir, tmp_path, max_tokens=4000)
    try:
        app.wait_for(lambda s: "ready" in s and "KV cache" in s)
        app.keys("first long reply", literal=True)
        app.wait_for(lambda s: "first long reply" in s)
        app.keys("Enter")
        app.keys("C-n")
        app.wait_for(new_tab_shown)
        app.keys("second long reply", literal=True)
        app.wait_for(lambda s: "second long reply" in s)   # in the shown (new) tab's prompt
        app.keys("Enter")
        # Both replies stream; the TUI saves them as they grow. Kill once each has been saved.
        wait_for_store(app.store_path, lambda saved: saved == {"first long reply", "second long reply"})
        pid = _tmux(*app.socket, "display-message", "-p", "-t", app.session, "#{pane_pid}").strip()
        os.kill(int(pid), signal.SIGKILL)
    finally:
        app.kill_server()
    store = ChatStore(app.store_path)
    chats = {c.title: store.get_chat(c.id) for c in store.list_chats()}
    assert set(chats) == {"first long reply", "second long reply"}
    for chat in chats.values():
        user, reply = chat.messages
        assert user.role == "user" and user.content == chat.title and user.token_ids
        assert reply.role == "assistant" and reply.finish_reason == "interrupted"
        assert reply.content and reply.token_ids, "the partial reply is kept"
    store.close()


def wait_for_store(path: Path, predicate, timeout: float = 240.0) -> None:
    """Wait until `predicate` holds for the titles of the chats with saved reply tokens."""
    deadline = time.monotonic() + timeout
    while not predicate(saved := _saved_replies(path)):
        assert time.monotonic() < deadline, f"replies saved so far: {saved}"
        time.sleep(0.2)


def _saved_replies(path: Path) -> set[str]:
    """Titles of the chats whose streaming reply already has tokens in the store."""
    if not path.exists():
        return set()
    with ChatStore(path) as store:
        return {chat.title for chat in store.list_chats()
                if any(m.role == "assistant" and m.token_ids for m in store.get_chat(chat.id).messages)}
