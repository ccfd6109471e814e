"""The TUI, driven with Textual's Pilot on a tiny random model (the block map and message
widgets alone: test_tui_block_map.py; the real command in tmux: test_tui_tmux.py).

The tiny model here (`chat_model_dir`) has the default model's full vocabulary (the
`tiny_model_dir` of the engine tests has 512 ids, too few for a chat template's special
tokens), so real chat prompts run through the real tokenizer, template, Conversation and
store.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time

import numpy as np
import pytest
from helpers import blocks_owned, engine_config, wait_until
from textual import events
from textual._xterm_parser import XTermParser
from textual.widgets import Tabs
from tui_helpers import (
    TuiTestApp,
    Watcher,
    idle,
    make_app,
    make_settings,
    new_tab,
    press,
    replies,
    text_of,
    type_prompt,
)

from paged_chat.app.chat_session import chat_title
from paged_chat.app.chat_store import ChatStore
from paged_chat.app.text import sanitize_for_terminal as clean
from paged_chat.engine import EngineConfig
from paged_chat.tui.actions import ACTIONS, StoredChats
from paged_chat.tui.dialogs import ChatSettingsScreen, ConfirmScreen, HelpScreen, TextPromptScreen
from paged_chat.tui.markdown_text import hard_line_breaks
from paged_chat.tui.message_widgets import ErrorMessage, UserMessage


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
        await wait_until(lambda: idle(app), timeout=120)
        watcher.stop()
        assert watcher.max_batch > 1, "the engine never batched two tabs"
        assert len(watcher.tab_codes) >= 2, "the block map never showed blocks of two tabs"
        assert watcher.shared_seen, "the shared system-prompt blocks never showed"
        for tab in app.chat_tabs:   # each shown in turn: hidden replies render when shown
            app.tabs.active = tab.id
            await wait_until(lambda: app.active_tab is tab and tab.display)
            await pilot.pause()
            [reply] = replies(tab)
            assert len(tab.session.turn.token_ids) == 300 and reply.text
            # Hidden tabs buffer while streaming; every reply ends fully rendered (once shown:
            # the tab renders what it kept back in its own time, a loaded machine's too).
            await wait_until(lambda: "".join(chunk.source for chunk in reply._chunks)
                             == hard_line_breaks(clean(reply.text)))
            assert "ttft" in reply.footer and "t/s" in app.tabs.get_tab(tab.id).label.plain
        assert engine.stats().prefix_cache_hit_tokens > 0


@pytest.mark.timeout(180)
async def test_fork_shares_every_full_block(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=40))
    async with app.run_test(size=(120, 40)) as pilot:
        await type_prompt(pilot, "tell me about paging")
        await wait_until(lambda: idle(app))
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
        # The keys are events: switch tabs only once the fork has taken them all.
        await wait_until(lambda: fork.streaming)
        app.tabs.active = original.id
        await wait_until(lambda: app.focused is original.prompt)
        await type_prompt(pilot, "and segmentation?")
        await wait_until(lambda: idle(app), timeout=120)
        watching.cancel()
        assert max(shared) >= history // 16
        assert fork.session.turn.num_cached_tokens >= history // 16 * 16


@pytest.mark.timeout(120)
async def test_stop_frees_blocks(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=5000))
    async with app.run_test(size=(120, 40)) as pilot:
        await type_prompt(pilot, "go on forever")
        tab = app.active_tab
        await wait_until(lambda: tab.session.turn is not None and len(tab.session.turn.token_ids) > 8)
        assert engine.stats().blocks_in_use > 0
        await press(pilot, "escape")
        await wait_until(lambda: idle(app))
        await wait_until(lambda: engine.stats().blocks_in_use == 0, timeout=5)
        [reply] = replies(tab)
        assert reply.footer.endswith("stopped") and reply.text
        [stored] = [m for m in app.store.get_chat(tab.chat_id).messages if m.role == "assistant"]
        assert stored.finish_reason == "abort" and stored.token_ids == tab.session.conversation.token_ids[-len(stored.token_ids):]
        # The stopped reply is part of the context: the next turn reuses its blocks.
        tab.session.sampling = {"max_tokens": 4}
        await type_prompt(pilot, "short one")
        await wait_until(lambda: idle(app))
        assert tab.session.turn.num_cached_tokens > 0


@pytest.mark.timeout(180)
async def test_restart_restores_chats_lazily(engine, tmp_path):
    settings = make_settings(max_tokens=16)
    app = make_app(engine, tmp_path, settings)
    async with app.run_test(size=(120, 40)) as pilot:
        await type_prompt(pilot, "first chat")
        await wait_until(lambda: idle(app))
        await new_tab(pilot)
        await type_prompt(pilot, "second chat")
        await wait_until(lambda: idle(app))
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
        await wait_until(lambda: tabs[0]._loaded and replies(tabs[0])
                         and app.focused is tabs[0].prompt)
        assert replies(tabs[0])[0].text == replies_before[0]
        # A follow-up prompt continues from the exact stored ids: the prefix cache hits.
        await type_prompt(pilot, "and again")
        await wait_until(lambda: tabs[0].session.turn is not None and idle(app))
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
    (tmp_path / "session.json").write_text(json.dumps({"open": [chat.id], "active": chat.id}))
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        tab = app.active_tab
        assert len(tab.query(".message")) == 30
        assert tab.query_one(UserMessage).text == "question 85"
        tab.query_one(".earlier").press()
        await wait_until(lambda: len(tab.query(".message")) == 60)
        assert tab.query_one(UserMessage).text == "question 70"


@pytest.mark.timeout(120)
async def test_model_loads_in_a_worker_while_the_ui_is_open(chat_model_dir, tmp_path, monkeypatch):
    import paged_chat.engine

    real_start_client = paged_chat.engine.start_client
    loading_seen = threading.Event()

    class SlowStart:  # the tiny model loads too fast to see "loading"
        def __init__(self, spec):
            self.spec = spec

        def result(self, on_progress):
            on_progress("converting weights", 3, 10)
            loading_seen.wait(60)
            return real_start_client(self.spec).result(on_progress)

    monkeypatch.setattr(paged_chat.engine, "start_client", SlowStart)
    settings = make_settings(max_tokens=8, engine_process=False)
    app = TuiTestApp(settings, engine_config=engine_config(chat_model_dir),
                  store=ChatStore(tmp_path / "chats.db"), session_path=tmp_path / "s.json")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        await wait_until(lambda: "converting weights 3/10" in text_of(app.query_one("#status")))
        assert "loading" in text_of(app.query_one("#status"))
        await type_prompt(pilot, "typed before the model is ready")   # waits for the model
        assert app.engine is None
        loading_seen.set()
        await wait_until(lambda: app.engine is not None, timeout=60)
        await wait_until(lambda: idle(app))
        assert "ready" in text_of(app.query_one("#status"))
        assert replies(app.active_tab)[0].text
        engine = app.engine
    assert engine.transport._thread.is_alive() is False   # the app shut down the engine it loaded


@pytest.mark.timeout(180)
async def test_the_app_runs_its_engine_in_a_process_of_its_own(chat_model_dir, tmp_path):
    """Issue 18: on a thread of the app the engine shares the UI's GIL and loses a fifth or
    more of its speed while tabs stream; by default it runs in a child process, whose
    block map the panel shows as before, and which ends with the app."""
    app = TuiTestApp(make_settings(max_tokens=300), engine_config=engine_config(chat_model_dir),
                     store=ChatStore(tmp_path / "chats.db"), session_path=tmp_path / "s.json")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(lambda: app.engine is not None, timeout=120)
        engine = app.engine
        assert engine.capabilities.where.startswith("in a child process")
        assert engine.transport.pid != os.getpid()
        await type_prompt(pilot, "hello from the app")
        await wait_until(lambda: engine.stats().blocks_in_use > 0, timeout=60)
        assert app.active_tab.chat_id in engine.stats().blocks.request_owners
        await wait_until(lambda: idle(app), timeout=60)
        assert len(app.active_tab.session.turn.token_ids) == 300
        assert replies(app.active_tab)[0].text
    assert engine.transport._process.exitcode == 0 and not engine.running


@pytest.mark.timeout(60)
async def test_model_load_failure_is_shown(tmp_path):
    app = TuiTestApp(make_settings(), engine_config=EngineConfig(model=str(tmp_path / "missing")),
                  store=ChatStore(tmp_path / "chats.db"), session_path=tmp_path / "s.json")
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(lambda: app.load_error is not None)
        assert "failed to load" in text_of(app.query_one("#status"))
        await type_prompt(pilot, "hello?")
        await wait_until(lambda: idle(app))
        assert "failed to load" in text_of(app.active_tab.query_one(ErrorMessage))


@pytest.mark.timeout(120)
async def test_engine_error_shows_in_the_tab_and_the_app_carries_on(engine, tmp_path):
    runner = engine.transport.engine.runner
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
        await wait_until(lambda: idle(app))
        tab = app.active_tab
        assert "simulated device fault" in text_of(tab.query_one(ErrorMessage))
        await type_prompt(pilot, "this one works")
        await wait_until(lambda: idle(app))
        assert replies(tab)[-1].text and len(tab.session.turn.token_ids) == 8


@pytest.mark.timeout(180)
async def test_a_one_megabyte_paste_gets_an_error_and_is_kept(engine, tmp_path):
    paste = ("All work and no play makes Jack a dull boy.\n" * 25_000)[:1_000_000]
    app = make_app(engine, tmp_path, make_settings(max_tokens=8))
    async with app.run_test(size=(120, 40)) as pilot:
        tab = app.active_tab
        tab.prompt.text = paste
        await press(pilot, "enter")
        await wait_until(lambda: idle(app) and tab.query(ErrorMessage), timeout=150)
        assert "max_model_len" in text_of(tab.query_one(ErrorMessage))
        [user] = [m for m in app.store.get_chat(tab.chat_id).messages if m.role == "user"]
        assert user.content == paste, "what the user wrote is kept"
        await type_prompt(pilot, "still here")
        await wait_until(lambda: idle(app))
        assert replies(tab)[-1].text


@pytest.mark.timeout(60)
async def test_prompt_input_keys(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=2))
    async with app.run_test(size=(120, 40)) as pilot:
        prompt = app.active_tab.prompt
        await press(pilot, "a", "ctrl+j", "b", "shift+enter", "c")
        await wait_until(lambda: prompt.text == "a\nb\nc")
        await press(pilot, "enter")
        await wait_until(lambda: prompt.text == "" and idle(app))
        assert [m.text for m in app.active_tab.query(UserMessage)] == ["a\nb\nc"]
        await type_prompt(pilot, "second")
        await wait_until(lambda: prompt.text == "" and idle(app))
        await press(pilot, "x", "up")
        await wait_until(lambda: prompt.text == "second")
        await press(pilot, "up")
        await wait_until(lambda: prompt.text == "a\nb\nc")
        await press(pilot, "down", "down", "down")   # through the last line, back to the draft
        await wait_until(lambda: prompt.text == "x")


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
        await wait_until(lambda: app.focused is prompt and app.active_tab.last_reply())
        await press(pilot, *"draft")
        for key in terminal_keys("\x1bc"):
            app.post_message(key)
        await wait_until(lambda: app.clipboard == "Here:\n```python\nprint(1)\n```\n")
        for key in terminal_keys("\x1bx"):
            app.post_message(key)
        await wait_until(lambda: app.clipboard == "print(1)\n")
        assert prompt.text == "draft" and app.focused is prompt


@pytest.mark.timeout(180)
async def test_an_80x24_terminal_gives_the_chat_the_width_until_it_grows(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=2))
    async with app.run_test(size=(80, 24)) as pilot:
        tab = app.active_tab
        prompt = tab.prompt
        await wait_until(lambda: prompt.size.width >= 60 and not app.panel.display)
        await pilot.resize_terminal(140, 44)
        await wait_until(lambda: app.panel.display and prompt.size.width >= 60)
        await pilot.resize_terminal(80, 24)
        await wait_until(lambda: not app.panel.display and prompt.size.width >= 60)
        await press(pilot, "f8")                              # asked for: shown even here
        await wait_until(lambda: app.panel.display)
        await press(pilot, "f8")
        await wait_until(lambda: not app.panel.display)
        # The sampling line wraps rather than stopping after `temperature 0.2,`.
        tab.apply_settings(tab.session.system_prompt, {"temperature": 0.2, "top_p": 0.9,
                                                       "repetition_penalty": 1.1, "seed": 7})
        info = tab.query_one(".chat-info")
        await wait_until(lambda: info.size.height >= 2)
        assert "seed=7" in text_of(info)
        # Chats are titled as `ask` titles them: the first line, up to TITLE_LENGTH.
        question = "Explain in detail how a paged KV cache shares the blocks of a prefix"
        await type_prompt(pilot, question)
        await wait_until(lambda: idle(app) and app.store.get_chat(tab.chat_id).title != "Chat 1")
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
        await wait_until(lambda: app.active_tab.chat_id == chats[5].id and active_label_shown())
        tab = await new_tab(pilot)
        assert tab.title == "Chat 3"
        await wait_until(active_label_shown)


@pytest.mark.timeout(120)
async def test_keys_typed_right_after_ctrl_n_or_alt_right_land_in_the_new_tab(engine, tmp_path):
    """Keys already queued behind Ctrl+N (a fast typist, a tmux send-keys) went to the
    previous tab's prompt: the focus moved only after them."""
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        first = app.active_tab
        await wait_until(lambda: app.focused is first.prompt)
        await press(pilot, "ctrl+n", *"hi")
        await wait_until(lambda: len(app.chat_tabs) == 2 and app.chat_tabs[1].prompt.text == "hi")
        await press(pilot, "alt+left", *"yo")
        await wait_until(lambda: first.prompt.text == "yo")
        assert first.prompt.text == "yo" and app.chat_tabs[1].prompt.text == "hi"


@pytest.mark.timeout(120)
async def test_regenerate_copy_and_broadcast(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=12))
    async with app.run_test(size=(120, 40)) as pilot:
        await type_prompt(pilot, "hi")
        await wait_until(lambda: idle(app))
        tab = app.active_tab
        first = replies(tab)[0].text
        tab.session.sampling = {"temperature": 1.0, "seed": 7}
        await press(pilot, "ctrl+r")
        await wait_until(lambda: idle(app))
        [reply] = replies(tab)
        assert reply.text != first
        stored = app.store.get_chat(tab.chat_id).messages
        assert [m.role for m in stored] == ["user", "assistant"] and stored[1].content == reply.text
        await press(pilot, "alt+c")
        await wait_until(lambda: app.clipboard == reply.text)   # the key is handled in its turn
        # Broadcast the typed prompt to every tab.
        await new_tab(pilot)
        await press(pilot, *"both", "ctrl+b")
        await wait_until(lambda: all(len(replies(t)) >= 1 for t in app.chat_tabs))
        await wait_until(lambda: idle(app))
        assert [m.text for m in app.chat_tabs[1].query(UserMessage)] == ["both"]
        await press(pilot, "alt+left")   # the hidden tab's turn shows once the tab is shown
        await wait_until(lambda: [m.text for m in app.chat_tabs[0].query(UserMessage)][-1] == "both")


async def test_a_tab_chosen_right_after_ctrl_n_stays_chosen(engine, tmp_path):
    """Alt+Left right behind Ctrl+N: the new tab's focus, reported a few queues late,
    switched back to the new tab (in the full suite the Alt+Left seemed lost)."""
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        first = app.active_tab
        await wait_until(lambda: app.focused is first.prompt)
        await press(pilot, "ctrl+n", "alt+left")
        await wait_until(lambda: len(app.chat_tabs) == 2 and app.focused is first.prompt)
        await pilot.pause()   # nothing streams: the screen settles, late messages land
        assert app.active_tab is first and app.focused is first.prompt


@pytest.mark.timeout(120)
async def test_dialogs_rename_settings_close(engine, tmp_path):
    app = make_app(engine, tmp_path, make_settings(max_tokens=2000))
    async with app.run_test(size=(120, 40)) as pilot:
        tab = app.active_tab
        await press(pilot, "f2")
        await wait_until(lambda: isinstance(app.screen, TextPromptScreen)
                         and app.screen.query("#text"))
        app.screen.query_one("#text").value = "Renamed"
        await press(pilot, "enter")
        await wait_until(lambda: "Renamed" in app.tabs.get_tab(tab.id).label.plain)
        assert tab.title == "Renamed"
        await press(pilot, "f4")
        await wait_until(lambda: isinstance(app.screen, ChatSettingsScreen)
                         and app.screen.query("#f-temperature"))
        app.screen.query_one("#system-prompt").text = "Be terse."
        app.screen.query_one("#f-temperature").value = "-1"
        await press(pilot, "ctrl+s")
        await wait_until(lambda: "temperature" in text_of(app.screen.query_one("#settings-error")))
        app.screen.query_one("#f-temperature").value = "0.5"
        await press(pilot, "ctrl+s")
        await wait_until(lambda: not isinstance(app.screen, ChatSettingsScreen)
                         and tab.session.system_prompt == "Be terse.")
        # Closing a streaming tab asks first.
        await type_prompt(pilot, "long reply")
        await wait_until(lambda: tab.session.turn is not None and len(tab.session.turn.token_ids) > 2)
        # The chat went to the store with its first turn, as renamed and set up.
        chat = app.store.get_chat(tab.chat_id)
        assert (chat.title, chat.system_prompt, chat.sampling) == (
            "Renamed", "Be terse.", {"temperature": 0.5})
        await press(pilot, "ctrl+w")
        await wait_until(lambda: isinstance(app.screen, ConfirmScreen))
        declined = app.screen
        await press(pilot, "n")
        # As a user would, answer the second question once it shows: a "y" that comes while
        # the declined dialog is still leaving answers nothing, and the second waits on.
        await wait_until(lambda: declined not in app.screen_stack)
        assert tab.is_attached and tab.streaming
        await press(pilot, "ctrl+w")
        await wait_until(lambda: isinstance(app.screen, ConfirmScreen))
        await press(pilot, "y")
        await wait_until(lambda: not tab.is_attached)
        assert len(app.chat_tabs) == 1                           # a fresh tab replaced it
        await wait_until(lambda: engine.stats().blocks_in_use == 0, timeout=5)
        stored = app.store.get_chat(tab.chat_id).messages
        assert stored[-1].finish_reason == "abort" and stored[-1].token_ids
        # The closed chat stays in the store; the palette's "Open chat" brings it back.
        assert [c.id for c in app.tabs.closed_chats()] == [tab.chat_id]
        provider = StoredChats(app.screen)
        [hit] = [hit async for hit in provider.search("renamed")]
        assert "Open chat: Renamed" in str(hit.text)
        await hit.command()
        await wait_until(lambda: app.active_tab.chat_id == tab.chat_id
                         and len(app.active_tab.query(UserMessage)) == 1)
        assert app.active_tab.title == "Renamed"


@pytest.mark.timeout(60)
async def test_palette_help_keymap_and_theme(engine, tmp_path):
    settings = make_settings(theme="gruvbox", keys={"new_chat": "ctrl+t", "help": "f10"})
    app = make_app(engine, tmp_path, settings)
    async with app.run_test(size=(120, 40)) as pilot:
        assert app.theme == "gruvbox" and app.current_theme.name == "gruvbox"
        app.theme = "textual-light"   # the app finds the theme itself (Textual's way is slow)
        assert app.current_theme.name == "textual-light" and not app.current_theme.dark
        app.theme = "gruvbox"
        commands = {command.title: command.help for command in app.get_system_commands(app.screen)}
        assert {description for _, _, _, description, _ in ACTIONS} <= set(commands)
        assert commands["New chat"] == "key: ^t" and commands["Copy the last reply"] == "key: alt+c"
        assert not any(help.startswith("action:") for help in commands.values())
        await new_tab(pilot, "ctrl+t")
        await press(pilot, "f10")
        await wait_until(lambda: isinstance(app.screen, HelpScreen))
        assert ("^t", "New chat") in app.key_help()
        await press(pilot, "escape")
        await wait_until(lambda: not isinstance(app.screen, HelpScreen))
        await press(pilot, "f8")
        await wait_until(lambda: app.panel.has_class("collapsed"))


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


@pytest.mark.perf
@pytest.mark.timeout(240)
async def test_keypress_echo_latency_while_eight_tabs_stream(engine, tmp_path):
    """Time from a key event reaching the app to its character being in the input, while
    eight other tabs stream (nine demo tabs; the one typed into is paused)."""
    app = make_app(engine, tmp_path, make_settings(max_tokens=900), demo=9)
    async with app.run_test(size=(140, 44)) as pilot:
        tab = app.active_tab
        app.tabs.pause_demo(tab)
        await wait_until(lambda: not tab.streaming, timeout=120)
        await wait_until(lambda: engine.stats().num_running >= 6, timeout=60)
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
