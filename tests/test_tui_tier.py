"""The TUI over the KV tier: chats reopened after a restart are prefilled from disk."""

from __future__ import annotations

import pytest
from helpers import assert_no_leaks, engine_config, wait_until
from tui_helpers import idle, make_app, make_settings, new_tab, type_prompt

from paged_chat.engine import ClientSpec, Engine, make_client

LONG_SYSTEM = ("You are a meticulous assistant for a team of engineers. " * 12).strip()


@pytest.mark.timeout(400)
async def test_chats_reopened_after_a_restart_prefill_from_the_kv_tier(chat_model_dir, tmp_path):
    """Quit with 4 chats of a few hundred tokens, start again (a new engine: an empty pool),
    send in each: every chat's history comes back from the disk tier, not the model."""
    settings = make_settings(max_tokens=48, system_prompt=LONG_SYSTEM)
    config = engine_config(chat_model_dir, cache_dir=str(tmp_path / "cache"))
    first_engine = make_client(ClientSpec(engine=Engine(config)))
    app = make_app(first_engine, tmp_path, settings)
    async with app.run_test(size=(120, 40)) as pilot:
        for index in range(4):
            if index:
                await new_tab(pilot)
            await type_prompt(pilot, f"chat number {index} tell me about caches")
        await wait_until(lambda: len(app.chat_tabs) == 4 and idle(app), timeout=240)
        histories = [len(tab.session.conversation.token_ids) for tab in app.chat_tabs]
    app.store.close()
    first_engine.shutdown()   # waits for the tier's writes
    assert_no_leaks(first_engine.transport.engine)
    assert min(histories) > 200

    engine = make_client(ClientSpec(engine=Engine(config)))
    app = make_app(engine, tmp_path, settings)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            tabs = app.chat_tabs
            assert len(tabs) == 4
            for tab in tabs:
                app.tabs.active = tab.id
                await wait_until(lambda: app.active_tab is tab)
                assert tab.send("and again")
                await wait_until(lambda: idle(app) and tab.session.turn is not None
                                 and tab.session.turn.finished, timeout=120)
            block_size = engine.info.block_size
            for tab, history in zip(tabs, histories):
                # Each chat's own blocks come from the tier; the system prompt's blocks, read
                # back for the first chat, are pool hits for the others.
                turn = tab.session.turn
                assert turn.num_cached_tokens >= (history - 1) // block_size * block_size
                assert turn.num_tier_cached_tokens > 0
            first = tabs[0].session.turn
            assert first.num_tier_cached_tokens == first.num_cached_tokens
            assert engine.stats().tier.hit_blocks > 0
    finally:
        engine.shutdown()
        assert_no_leaks(engine.transport.engine)
