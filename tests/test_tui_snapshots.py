"""Snapshot tests (pytest-textual-snapshot) of the main screen, from a deterministic engine
state: a fake engine client whose `stats()` replays a fixed series of snapshots, and a store
with three chats. Update the SVGs with `pytest tests/test_tui_snapshots.py --snapshot-update`
after an intended change of the layout, and look at them before committing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from paged_chat.chat_session import Turn
from paged_chat.chat_store import ChatStore
from paged_chat.engine import ClientCapabilities, ModelInfo
from paged_chat.engine.stats import BlockMap, EngineStats
from paged_chat.settings import Settings
from paged_chat.tui.app import PagedChatApp
from paged_chat.tui.prompt_input import PromptInput

SIZE = (140, 44)
NUM_BLOCKS = 640
BLOCK_SIZE = 16


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
        self.capabilities = ClientCapabilities(block_map=True, metrics=True, where="fake")
        self.info = ModelInfo(name="smollm2-135m", tokenizer=FakeTokenizer(), chat_template="",
                              device="cuda", dtype="bfloat16", num_blocks=NUM_BLOCKS,
                              block_size=BLOCK_SIZE, max_model_len=8192, num_parameters=0)

    def stats(self) -> EngineStats:
        stats = self.series[min(self.calls, len(self.series) - 1)]
        self.calls += 1
        return stats

    def abort(self, request_id: str) -> None:
        pass


def snapshot(step: int, owners: list[str]) -> EngineStats:
    """Three streaming tabs: the first two share a 3-block system prompt, the third is a
    fork of the first (sharing its whole 6-block history); all grow with `step`."""
    system = [0, 1, 2]
    history = [3, 4, 5]
    grow = lambda start, n: list(range(start, start + n))  # noqa: E731
    tables = {
        f"{owners[0]}/1": system + history + grow(10, 2 + step // 8),
        f"{owners[1]}/1": system + grow(40, 4 + step // 6),
        f"{owners[2]}/1": system + history + grow(80, 1 + step // 10),
    }
    ref = np.zeros(NUM_BLOCKS, dtype=np.int32)
    for table in tables.values():
        for block in table:
            ref[block] += 1
    cached = np.zeros(NUM_BLOCKS, dtype=bool)
    cached[:6] = True
    cached[200:260] = True          # an earlier chat's blocks, evictable
    blocks = BlockMap.build(ref, cached, tables, {rid: rid.split("/")[0] for rid in tables})
    in_use = int(np.count_nonzero(ref))
    cached_free = int(np.count_nonzero(cached & (ref == 0)))
    return EngineStats(
        num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, blocks_in_use=in_use,
        blocks_cached=cached_free, blocks_free=NUM_BLOCKS - in_use - cached_free,
        num_running=3, num_waiting=1, num_preemptions=2, num_evictions=0,
        batch_size=3 if step % 7 else 4, batch_tokens=3 if step % 7 else 260,
        prompt_tokens_per_s=180.0 + step, generation_tokens_per_s=90.0 + (step % 13) * 5,
        prefix_cache_queried_tokens=1200, prefix_cache_hit_tokens=780, kv_slots_wasted=20,
        step_time_s=0.021, forward_time_s=0.019, blocks=blocks)


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
                       session_path=tmp_path / "session.json", poll_s=3600)
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
    app.panel.refresh_every_s = 0.0   # every poll draws, whatever the machine's speed
    for _ in range(60):   # the panel's history: 60 deterministic polls
        app._poll()
    await pilot.pause()
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


def settle_then_press(key: str, then=None):
    """A run_before: settle, press `key`, wait for the screen (then `then(app)`, if given)."""
    async def run_before(pilot) -> None:
        await settle(pilot)
        await pilot.press(key)
        await pilot.pause()
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

