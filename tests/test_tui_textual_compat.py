"""Issue 45 item 3: textual_compat's overrides apply on the Textual they were written for
(the pinned version) and fall back to Textual's stock behaviour on any other; the app shows
the same either way."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from helpers import wait_until
from test_tui_streaming import fed_app, shown_words, streaming_reply
from textual._compositor import Compositor
from textual.app import App
from textual.content import Content
from textual.widgets import Static, Tab

from paged_chat.tui import textual_compat
from paged_chat.tui.chat_screen import ChatScreen
from paged_chat.tui.message_widgets import AssistantMessage
from paged_chat.tui.textual_compat import UpdateCroppedCompositor


@pytest.fixture(params=["pinned", "another"])
def textual_version(request, monkeypatch) -> str:
    """Which path the compat module takes: the Textual it was written for, or another."""
    if request.param == "another":
        monkeypatch.setattr(textual_compat, "version", lambda name: "99.0.0")
    textual_compat.overrides_apply.cache_clear()
    yield request.param
    textual_compat.overrides_apply.cache_clear()


def test_the_compat_module_was_written_for_the_textual_the_package_pins():
    """A new pin is a new Textual: its overrides are checked against it before they apply."""
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert f"textual=={textual_compat.WRITTEN_FOR}" in pyproject["project"]["dependencies"]


def test_the_overrides_apply_on_the_pinned_textual_only(textual_version):
    assert textual_compat.overrides_apply() == (textual_version == "pinned")
    compositor = type(ChatScreen()._compositor)
    assert compositor is (UpdateCroppedCompositor if textual_version == "pinned" else Compositor)


async def test_a_tab_header_and_a_border_subtitle_show_the_same_on_either_path(textual_version):
    class Headers(App):
        def compose(self):
            yield Tab("one", id="tab")
            yield Static("body", id="body")

    async with Headers().run_test(size=(40, 10)) as pilot:
        header, body = pilot.app.query_one(Tab), pilot.app.query_one("#body", Static)
        textual_compat.relabel_tab(header, Content("two"))
        textual_compat.set_border_subtitle(body, Content("a footer"))
        await pilot.pause()
        assert header.label.plain == "two" and "two" in header.render().plain
        assert body.border_subtitle == "a footer"


async def test_a_reply_streams_and_ends_with_its_footer_on_either_path(
        textual_version, chat_model_dir, tmp_path):
    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        tab, reply = await streaming_reply(app, pilot)
        for piece in ["A first line\n", "\n", "```\n", "code\n", "```\n", "and words."]:
            client.pieces.put_nowait(piece)
        client.pieces.put_nowait(None)
        await wait_until(lambda: not tab.streaming)
        await pilot.pause()
        assert shown_words(reply)[:3] == ["A", "first", "line"]
        assert shown_words(reply)[-2:] == ["and", "words."]
        assert isinstance(reply, AssistantMessage) and reply.footer
        assert reply.border_subtitle   # the footer, in the bottom border
