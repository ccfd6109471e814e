"""The modal dialogs on their own: what a fast typist does to them."""

from __future__ import annotations

from textual import events
from textual.app import App

from paged_chat.tui.dialogs import ConfirmScreen, TextPromptScreen


async def test_a_question_answered_before_its_screen_mounts_is_taken():
    """A key that answers as the screen is pushed counts, and nothing crashes (the suite once
    saw a ConfirmScreen answered before it mounted: its on_mount focus found no button);
    a question left alone has Cancel focused."""
    answers = []
    app = App()
    async with app.run_test() as pilot:
        for _ in range(10):
            app.push_screen(ConfirmScreen("Close the streaming tab?"), answers.append)
            app.post_message(events.Key("y", "y"))
            await pilot.pause()
        assert answers == [True] * 10
        app.push_screen(ConfirmScreen("Close the streaming tab?"), answers.append)
        await pilot.pause()
        assert app.focused is app.screen.query_one("#no")
        await pilot.press("enter")   # the focused Cancel
        await pilot.pause()
        assert answers == [True] * 10 + [False]


async def test_a_text_prompt_takes_the_typing_at_once():
    answers = []
    app = App()
    async with app.run_test() as pilot:
        app.push_screen(TextPromptScreen("Rename chat", "old"), answers.append)
        await pilot.press("end", "!", "enter")
        await pilot.pause()
        assert answers == ["old!"]
