"""Snapshot tests (pytest-textual-snapshot) of the main screen, from a deterministic engine
state: a fake engine client whose `stats()` replays a fixed series of snapshots, and a store
with three chats. Update the SVGs with `pytest tests/test_tui_snapshots.py --snapshot-update`
after an intended change of the layout, and look at them before committing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import SNAPSHOT_BLOCK_SIZE, SNAPSHOT_NUM_BLOCKS, snapshot

from paged_chat.app.chat_session import Turn
from paged_chat.app.chat_store import ChatStore
from paged_chat.app.settings import Settings
from paged_chat.engine import ClientCapabilities, ModelInfo
from paged_chat.engine.core.stats import EngineStats
from paged_chat.tui.app import PagedChatApp
from paged_chat.tui.prompt_input import PromptInput

SIZE = (140, 44)


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(f"t{i} " for i in ids)


class FakeEngine:
    """What the app reads of an engine client, with `stats()` replaying `series` in order
    (staying on the last one)."""

    def __init__(self, series: list[EngineStats]) -> None:
        self.series = series
        self.calls = 0
        self.last_error = None
        self.running = True
        self.capabilities = ClientCapabilities(block_map=True, metrics=True, where="fake")
        self.info = ModelInfo(name="smollm2-135m", tokenizer=FakeTokenizer(), chat_template="",
                              device="cuda", dtype="bfloat16", num_blocks=SNAPSHOT_NUM_BLOCKS,
                              block_size=SNAPSHOT_BLOCK_SIZE, max_model_len=8192, num_parameters=0)

    def stats(self) -> EngineStats:
        stats = self.series[min(self.calls, len(self.series) - 1)]
        self.calls += 1
        return stats

    def abort(self, request_id: str) -> None:
        pass


def populated_store(path: Path) -> tuple[ChatStore, list[str]]:
    store = ChatStore(path / "chats.db")
    ids = []
    for title, question, answer in [
        ("Paging explained", "How does paged attention work?",
         "It splits the **KV cache** into fixed-size blocks:\n\n- a block table per sequence\n"
         "- shared prefix blocks\n\n```python\nblock = pool.allocate()\n```"),
        ("Haiku", "Write a haiku about caches.", "Blocks fill, then they free —\nthe prefix stays warm."),
        ("Paging explained (fork)", "How does paged attention work?", "Forked reply."),
    ]:
        chat = store.create_chat(title, "smollm2-135m", "You are concise.", {"temperature": 0.7})
        store.add_message(chat.id, "user", question, [1, 2, 3])
        store.add_message(chat.id, "assistant", answer, [4, 5, 6], "stop",
                          {"ttft_s": 0.123, "tokens_per_s": 45.6})
        ids.append(chat.id)
    (path / "session.json").write_text(json.dumps({"open": ids, "active": ids[0]}))
    return store, ids


def make_app(tmp_path: Path) -> tuple[PagedChatApp, FakeEngine]:
    store, ids = populated_store(tmp_path)
    engine = FakeEngine([snapshot(step, ids) for step in range(60)])
    app = PagedChatApp(Settings(), engine=engine, store=store,
                       session_path=tmp_path / "session.json", frame_s=3600)
    app.animation_level = "none"   # the tab underline would be caught mid-slide
    return app, engine


async def settle(pilot) -> None:
    app = pilot.app
    await pilot.pause()
    for prompt in app.query(PromptInput):
        prompt.cursor_blink = False
    for index, tab in enumerate(app.chat_tabs):   # each tab's live request, as in snapshot()
        tab.session.turn = Turn("", list(range(1000 * index, 1000 * index + 200)),
                                f"{tab.chat_id}/1")
    for _ in range(60):   # the panel's history: 60 deterministic frames
        app.frame_clock.tick()
    await pilot.pause()
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


def settle_then_press(key: str, then=None):
    """A run_before: settle, press `key`, wait for the screen (then `then(app)`, if given)."""
    async def run_before(pilot) -> None:
        await settle(pilot)
        await pilot.press(key)
        await pilot.pause()
        await pilot.pause()   # a dialog's first focus lands on its screen's resume
        if then is not None:
            then(pilot.app)
    return run_before




@pytest.mark.timeout(120)
def test_main_screen_with_a_block_pinned(snap_compare, tmp_path):
    app, _ = make_app(tmp_path)

    async def run_before(pilot) -> None:
        await settle(pilot)
        view = app.query_one("#block-map")
        await pilot.click("#block-map", offset=(1, 0))   # block 1 or 47: shared system prompt
        assert view.selected is not None
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


NARROW = (80, 24)   # many terminals' default size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [SIZE, NARROW], ids=["140x44", "80x24"])
def test_help_screen(snap_compare, tmp_path, size):
    """At 80x24 the help scrolls."""
    app, _ = make_app(tmp_path)
    assert snap_compare(app, terminal_size=size, run_before=settle_then_press("f1"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [SIZE, NARROW], ids=["140x44", "80x24"])
def test_main_screen(snap_compare, tmp_path, size):
    """At 80x24 the engine panel steps aside and the chat gets the width."""
    app, _ = make_app(tmp_path)
    assert snap_compare(app, terminal_size=size, run_before=settle)


@pytest.mark.timeout(120)
def test_settings_dialog_at_80x24_keeps_its_buttons_on_screen(snap_compare, tmp_path):
    app, _ = make_app(tmp_path)

    def stop_blinking(app) -> None:
        app.screen.query_one("#system-prompt").cursor_blink = False

    assert snap_compare(app, terminal_size=NARROW, run_before=settle_then_press("f4", stop_blinking))

