"""Issue 32, the TUI items a new user met in the first hour (Pilot; 80x24 where the issue
says so): F4's focus, the block map's legend, the narrow terminal's lines, the palette's
search, and the first start."""

from __future__ import annotations

import pytest
from helpers import wait_until
from textual.geometry import Region
from textual.widgets import Label
from tui_helpers import idle, make_app, make_settings, new_tab, press, text_of, type_prompt

from paged_chat.app.chat_session import chat_title
from paged_chat.app.chat_store import ChatStore
from paged_chat.tui.demo import PROMPTS
from paged_chat.tui.dialogs import ChatSettingsScreen, HelpScreen


def keys_of(text: str) -> list[str]:
    return [{" ": "space"}.get(c, c) for c in text]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait_for_the_dialog", [True, False])
async def test_f4_focuses_the_system_prompt_so_what_is_typed_lands_there(
        engine, tmp_path, wait_for_the_dialog):
    app = make_app(engine, tmp_path, make_settings(system_prompt=None))
    async with app.run_test(size=(120, 40)) as pilot:
        await press(pilot, "f4")
        if wait_for_the_dialog:
            await wait_until(lambda: isinstance(app.screen, ChatSettingsScreen), timeout=20)
        await press(pilot, *keys_of("You are a pirate"))
        await wait_until(lambda: isinstance(app.screen, ChatSettingsScreen)
                         and app.screen.query("#system-prompt")
                         and app.screen.query_one("#system-prompt").text == "You are a pirate",
                         timeout=20, what=lambda: f"focused: {app.focused!r}, "
                                                  f"the chat's prompt: {app.active_tab.prompt.text!r}")
        assert app.active_tab.prompt.text == ""


def shown_lines(widget) -> list[str]:
    """The widget's lines as the terminal gets them (clipped to its size)."""
    width, height = widget.size
    return [strip.text.replace("\u00a0", " ").rstrip()
            for strip in widget.render_lines(Region(0, 0, width, height))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [4, 5, 9])
async def test_the_legend_wraps_whole_entries_and_keeps_the_symbol_key_at_160x50(
        engine, tmp_path, count):
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(160, 50)) as pilot:
        titles = [chat_title(prompt) for prompt in PROMPTS[:count]]
        app.active_tab.set_title(titles[0])
        for title in titles[1:]:
            (await app.tabs.open_new_chat()).set_title(title)
        legend = app.query_one("#legend")
        await wait_until(lambda: len(app.tabs.tab_infos()) == count
                         and any(titles[0][:12] in line for line in shown_lines(legend)), timeout=20)
        await pilot.pause()
        lines = shown_lines(legend)
        assert lines[-1] == "◆ shared  ░ cached  ▚ restored  blank = free", lines
        assert legend.region.bottom <= app.panel.content_region.bottom, "the legend is on screen"
        assert not any(line.endswith(("◆", "░", "▚", "█")) for line in lines), lines
        shown = "\n".join(lines)
        named = [title for title in titles if title[:12] in shown]
        left_out = len(titles) - len(named)
        assert named == titles[:len(named)]
        assert (f"+{left_out} more" in shown) if left_out else ("more" not in shown), lines
        assert len(named) >= min(count, 4)


@pytest.mark.timeout(60)
async def test_an_empty_tab_is_not_saved_as_a_chat(engine, tmp_path):
    """Not even while the app runs (a kill -9 deletes nothing): a chat's row is written
    with its first message."""
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(lambda: len(app.tabs.chat_tabs) == 1, timeout=20)
        closed = await new_tab(pilot)
        sent = await new_tab(pilot)
        with ChatStore(tmp_path / "chats.db") as beside_the_app:  # as after a kill -9
            assert beside_the_app.list_chats() == []
        await app.tabs.close_tab(closed)
        await type_prompt(pilot, "Hi")
        await wait_until(lambda: sent.session.in_store, timeout=20)
        with ChatStore(tmp_path / "chats.db") as beside_the_app:
            [chat] = beside_the_app.list_chats()
            assert (chat.id, chat.title) == (sent.chat_id, sent.title)
        await wait_until(lambda: idle(app), timeout=30)
        await press(pilot, "ctrl+q")
    with ChatStore(tmp_path / "chats.db") as store:
        assert [chat.id for chat in store.list_chats()] == [sent.chat_id]


@pytest.mark.timeout(60)
async def test_the_help_says_how_to_close_it(engine, tmp_path):
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await press(pilot, "f1")
        await wait_until(lambda: isinstance(app.screen, HelpScreen) and app.screen.query(Label),
                         timeout=20)
        shown = "\n".join(text_of(widget) for widget in app.screen.query(Label))
        assert "Esc closes this help" in shown, shown


@pytest.mark.timeout(60)
async def test_the_tab_s_system_line_fits_80x24(engine, tmp_path):
    app = make_app(engine, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        tab = app.active_tab
        await wait_until(lambda: tab is not None and tab.is_attached, timeout=20)
        tab.session.update_settings(tab.session.system_prompt, {"max_tokens": 256, "temperature": 0.7})
        tab.refresh_info()
        await pilot.pause()
        info = tab.query_one(".chat-info")
        lines = [line for line in shown_lines(info) if line.strip()]
        assert len(lines) == 1 and lines[0].endswith("max_tokens=256, temperature=0.7"), lines
