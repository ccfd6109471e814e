"""Streaming replies as the user sees them: what the reply's Markdown widgets show, compared
with the reply the session stores, across tab switches (issue 15 item 1); and the engine
panel's block map, which redraws only what changed.

A random tiny model writes no poem with line breaks, and the bug needs one (a paragraph of
several lines streaming while its tab is hidden), so the reply here comes from a client
whose stream the test feeds line by line; the app, its tabs and the session are the real
ones, and the model's info and stats are a real (tiny) engine's.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_until
from textual.widgets.markdown import MarkdownBlock
from tui_helpers import press

from paged_chat.app.chat_store import ChatStore
from paged_chat.app.settings import ChatSettings, Settings
from paged_chat.engine import (
    ClientCapabilities,
    Engine,
    EngineConfig,
    RequestOutput,
    SamplingParams,
)
from paged_chat.engine.core.stats import BlockMap
from paged_chat.tui.app import PagedChatApp
from paged_chat.tui.block_map import TAB0, BlockMapView
from paged_chat.tui.chat_tab import ChatTab
from paged_chat.tui.message_widgets import AssistantMessage, UserMessage


class FedClient:
    """An EngineClient whose replies are the pieces of text the test puts in `pieces`
    (None ends the reply)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pieces: asyncio.Queue[str | None] = asyncio.Queue()
        self.last_error: str | None = None
        self.running = True

    @property
    def info(self):
        return self.engine.info

    @property
    def capabilities(self) -> ClientCapabilities:
        return ClientCapabilities(block_map=True, metrics=True, where="fed by the test")

    def stats(self):
        return self.engine.stats()

    async def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     request_id: str | None = None, owner: str | None = None, priority: int = 0
                     ) -> AsyncIterator[RequestOutput]:
        text, ids = "", []
        while True:
            piece = await self.pieces.get()
            if piece is not None:
                text += piece
                ids.append(len(ids) + 1)
            yield RequestOutput(request_id or "fed", [ids[-1]] if piece else [], piece or "",
                                list(ids), text, piece is None, "stop" if piece is None else None,
                                len(prompt), 0)
            if piece is None:
                return

    def abort(self, request_id: str) -> None:
        self.pieces.put_nowait(None)

    def reset_prefix_cache(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def fed_app(model_dir: Path, tmp_path: Path) -> tuple[PagedChatApp, FedClient]:
    """The app on a FedClient over the tiny chat model, its chats under tmp_path."""
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                 num_blocks=64, block_size=16))
    client = FedClient(engine)
    app = PagedChatApp(Settings(chat=ChatSettings(temperature=0.0)), engine=client,
                       store=ChatStore(tmp_path / "chats.db"), session_path=tmp_path / "s.json")
    return app, client


async def streaming_reply(app: PagedChatApp, pilot) -> tuple[ChatTab, AssistantMessage]:
    """Send "hi" in the active tab; its tab and its reply once the turn streams."""
    tab = app.active_tab
    await press(pilot, *"hi", "enter")
    await wait_until(lambda: tab.streaming and tab.session.turn is not None)
    return tab, tab.query_one(AssistantMessage)


def shown_words(reply: AssistantMessage) -> list[str]:
    """The words the reply's Markdown blocks show, in order."""
    return " ".join(block._content.plain for block in reply.query(MarkdownBlock)).split()


POEM_START = ["In the night, the moon's beauty,\n", "a whispered silver song,\n"]
WHILE_HIDDEN = ["over fields of quiet grass,\n", "where the rivers run along.\n"]
AFTER_RETURN = ["A whispered secret, a whispered secret,\n", "the night is never long.\n"]


async def test_a_hidden_tab_mounts_its_turn_only_once_it_is_shown(chat_model_dir, tmp_path):
    """Issue 32 item 17: a turn mounted its prompt and reply at once, shown or not, and each
    mount re-laid the whole screen out (8 demo tabs: ~1 layout a second for tabs no one saw).
    A hidden tab keeps them, with what streamed, until it is shown; then all of it shows,
    and what streams after."""
    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        hidden = app.active_tab
        await press(pilot, "ctrl+n")
        await wait_until(lambda: len(app.chat_tabs) == 2 and app.active_tab is not hidden)
        layouts = hidden.messages._layout_updates
        assert hidden.send("moon")
        for line in POEM_START:
            client.pieces.put_nowait(line)
        await wait_until(lambda: hidden.session.turn is not None
                         and hidden.session.turn.text == "".join(POEM_START))
        await pilot.pause()
        assert hidden.messages._layout_updates == layouts
        assert not hidden.query(UserMessage) and not hidden.query(AssistantMessage)
        await press(pilot, "alt+left")
        await wait_until(lambda: app.active_tab is hidden and hidden.query(AssistantMessage))
        [sent], [reply] = hidden.query(UserMessage), hidden.query(AssistantMessage)
        assert sent.text == "moon"
        for line in WHILE_HIDDEN:
            client.pieces.put_nowait(line)
        expected = "".join(POEM_START + WHILE_HIDDEN).split()
        await wait_until(lambda: shown_words(reply) == expected,
                         what=lambda: f"the reply shows {shown_words(reply)}")
        client.pieces.put_nowait(None)
        await wait_until(lambda: not hidden.streaming)
        assert shown_words(reply) == expected


async def test_a_hidden_tabs_finished_turn_shows_once_it_is_shown(chat_model_dir, tmp_path):
    """The same for a turn that ends while its tab is hidden: shown whole, footer and all."""
    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        hidden = app.active_tab
        await press(pilot, "ctrl+n")
        await wait_until(lambda: len(app.chat_tabs) == 2 and app.active_tab is not hidden)
        assert hidden.send("moon")
        for line in [*POEM_START, None]:
            client.pieces.put_nowait(line)
        await wait_until(lambda: not hidden.streaming)
        assert not hidden.query(AssistantMessage) and hidden.last_reply() == "".join(POEM_START)
        await press(pilot, "alt+left")
        await wait_until(lambda: hidden.query(AssistantMessage)
                         and shown_words(hidden.query_one(AssistantMessage)) == "".join(POEM_START).split())
        assert hidden.query_one(AssistantMessage).footer.endswith("done")


async def test_the_prompts_cursor_does_not_blink(chat_model_dir, tmp_path):
    """Issue 32 item 17: the focused prompt's cursor blinked, a screen update of its own
    twice a second beside the streaming tabs'. It stays drawn."""
    app, _ = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        prompt = app.active_tab.prompt
        await wait_until(lambda: app.focused is prompt)
        repaints: list[int] = []
        repaint = prompt.refresh_lines
        prompt.refresh_lines = lambda *args, **kwargs: (repaints.append(1), repaint(*args, **kwargs))[1]
        await pilot.pause(1.6)   # three blinks' time: no condition to wait for, an absence
        assert not repaints and prompt._cursor_visible


async def test_a_reply_streamed_while_its_tab_was_hidden_shows_all_its_words(chat_model_dir, tmp_path):
    """Issue 15 item 1: send a prompt, switch away with Alt+Left while the reply streams,
    switch back with Alt+Right: the paragraph that streamed meanwhile keeps its first lines."""
    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await press(pilot, "ctrl+n")
        await wait_until(lambda: len(app.chat_tabs) == 2 and app.focused is app.chat_tabs[1].prompt)
        tab = app.chat_tabs[1]
        await press(pilot, *"moon", "enter")
        await wait_until(lambda: tab.streaming and tab.session.turn is not None)
        reply = tab.query_one(AssistantMessage)

        async def feed(lines: list[str]) -> None:
            for line in lines:
                client.pieces.put_nowait(line)
                await wait_until(lambda: tab.session.turn.text.endswith(line))

        await feed(POEM_START)
        await wait_until(lambda: shown_words(reply) == tab.session.turn.text.split())
        await press(pilot, "alt+left")
        await wait_until(lambda: app.active_tab is app.chat_tabs[0])
        await feed(WHILE_HIDDEN)
        await press(pilot, "alt+right")
        await wait_until(lambda: app.active_tab is tab)
        await feed(AFTER_RETURN)
        expected = "".join(POEM_START + WHILE_HIDDEN + AFTER_RETURN).split()
        await wait_until(lambda: shown_words(reply) == expected,
                         what=lambda: f"the reply shows {shown_words(reply)}")
        client.pieces.put_nowait(None)
        await wait_until(lambda: not tab.streaming)
        stored = app.store.get_chat(tab.chat_id).messages[-1].content
        assert stored.split() == expected == shown_words(reply)


def _pool(held: list[int]) -> BlockMap:
    ref = np.zeros(16, dtype=np.int32)
    ref[held] = 1
    return BlockMap.build(ref, np.zeros(16, dtype=bool), {"a/1": held}, {"a/1": "tab-a"})


async def test_the_block_map_redraws_only_the_rows_whose_cells_changed():
    """Issue 32 item 17: a frame of 8 streaming chats changes a few of the map's rows, and
    the whole map was rebuilt and repainted (4 ms of the UI thread, five times a second)."""
    from textual.app import App

    view = BlockMapView()
    view.styles.width = 4   # the 16 blocks in 4 rows of 4

    class Host(App):
        def compose(self):
            yield view

    async with Host().run_test() as pilot:
        view.show(_pool([0, 1]), {"tab-a": 0})
        await pilot.pause()
        drawn = list(view._strips or [])
        assert len(drawn) == 4
        view.show(_pool([0, 1]), {"tab-a": 0})   # a new snapshot, the same cells
        await pilot.pause()
        assert view._strips == drawn and all(a is b for a, b in zip(view._strips, drawn))
        view.show(_pool([0, 1, 6]), {"tab-a": 0})   # block 6: the second row
        await pilot.pause()
        assert view.codes[6] == TAB0
        assert [strip is old for strip, old in zip(view._strips, drawn)] == [True, False, True, True]
        assert "█" in view.render_line(1).text


async def test_a_streaming_reply_renders_only_in_the_panels_frames(chat_model_dir, tmp_path):
    """Issue 32 item 17: in a real terminal every frame is escape sequences the app writes
    and the terminal parses, on the engine's cores. The shown reply renders in the engine
    panel's frames (one screen update for both), never on a clock of its own: between two
    renders of the reply the panel has drawn, however fast the deltas come."""
    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        tab, reply = await streaming_reply(app, pilot)
        events: list[str] = []
        panel, show_stats, append = app.panel, app.panel.show_stats, reply._append

        def show_and_log(*args) -> None:
            events.append("frame")
            show_stats(*args)

        async def append_and_log(fragment: str) -> None:
            events.append("render")
            await append(fragment)

        panel.show_stats, reply._append = show_and_log, append_and_log
        for index in range(80):   # a delta every ~10 ms for ~1 s: several panel frames
            client.pieces.put_nowait(f"word{index} ")
            await asyncio.sleep(0.01)
        await wait_until(lambda: "word79" in shown_words(reply)[-1:])
        rendered = list(events)
        client.pieces.put_nowait(None)
        await wait_until(lambda: not tab.streaming)
    renders = rendered.count("render")
    assert renders >= 2, rendered   # it streamed, in several frames
    assert "render,render" not in ",".join(rendered), rendered   # a frame between any two
    assert renders <= rendered.count("frame") + 1


async def test_the_engine_is_read_once_per_frame_and_each_snapshot_is_drawn(chat_model_dir, tmp_path):
    """Issue 45 item 4: the app read stats (the whole block map, over the pipe from the
    engine's process) at 10 Hz for a panel that drew 5 frames a second. One frame clock:
    each frame reads the engine's stats once, and the panel draws that snapshot."""
    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        tab, _ = await streaming_reply(app, pilot)
        reads: list[object] = []
        drawn: list[object] = []
        stats, show_stats = client.stats, app.panel.show_stats

        def read_and_log():
            reads.append(stats())
            return reads[-1]

        def show_and_log(snapshot, tabs) -> None:
            drawn.append(snapshot)
            show_stats(snapshot, tabs)

        client.stats, app.panel.show_stats = read_and_log, show_and_log
        started = time.monotonic()
        for index in range(60):
            client.pieces.put_nowait(f"word{index} ")
            await asyncio.sleep(0.02)
        elapsed = time.monotonic() - started
        client.stats, app.panel.show_stats = stats, show_stats
        client.pieces.put_nowait(None)
        await wait_until(lambda: not tab.streaming)
    assert len(reads) >= 2, reads   # it ran frames
    assert len(reads) <= elapsed / app.frame_clock.period_s + 1
    assert all(a is b for a, b in zip(reads, drawn)) and len(drawn) == len(reads)


def test_the_apps_engine_sends_two_stats_snapshots_a_frame(monkeypatch, tmp_path):
    """Issue 45 item 4: the engine's stats (the whole block map) crossed the pipe 20 times
    a second for a panel that draws 5 frames; the app's engine sends two a frame, so each
    frame still finds one it has not drawn."""
    import paged_chat.engine
    from paged_chat.tui.engine_start import start_engine
    from paged_chat.tui.frame_clock import FRAME_S

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    specs: list = []
    monkeypatch.setattr(paged_chat.engine, "start_client", specs.append)
    for in_a_process in (True, False):
        start_engine(EngineConfig(model="smollm2-135m", device="cpu"), in_a_process)
    assert [spec.stats_interval_s for spec in specs] == [FRAME_S / 2] * 2


async def test_a_streaming_paragraph_lays_the_screen_out_only_when_it_grows_a_line(
        chat_model_dir, tmp_path):
    """Issue 32 item 17: any new text of a Markdown block re-lays the whole screen out and
    repaints it (25-40 ms at 160x50), and a streaming reply's last paragraph gets new text
    at every frame. Words that stay on its last line ask for no layout; the word that wraps
    asks for one, and the paragraph is a line taller."""
    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        tab, reply = await streaming_reply(app, pilot)

        async def feed(piece: str) -> None:
            client.pieces.put_nowait(piece)
            await wait_until(lambda: shown_words(reply) == tab.session.turn.text.split()
                             and tab.session.turn.text.endswith(piece))

        await feed("One ")
        paragraph = reply.query(MarkdownBlock).only_one()
        await wait_until(lambda: paragraph.content_size.height == 1)
        layouts = paragraph._layout_updates
        for word in ("short", "words", "on", "one", "line "):
            await feed(f"{word} ")
        assert paragraph._layout_updates == layouts and paragraph.content_size.height == 1
        await feed("and then a long run of words that cannot fit beside them " * 2)
        await wait_until(lambda: paragraph.content_size.height >= 2)
        assert paragraph._layout_updates > layouts
        client.pieces.put_nowait(None)
        await wait_until(lambda: not tab.streaming)


async def test_a_tab_header_keeps_its_width_from_one_turn_to_the_next(chat_model_dir, tmp_path):
    """Issue 32 item 17: a header that changes width re-lays the tab bar out and animates the
    shown tab's underline (8 demo tabs: 4-5 screen updates a second). The header of a tab
    that has had a turn keeps one width: at the next turn's start (no figures yet), at its
    first token and at its end; and a new label of the same width lays nothing out."""
    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        tab, _ = await streaming_reply(app, pilot)
        header = app.tabs.get_tab(tab.id)
        client.pieces.put_nowait("one ")
        client.pieces.put_nowait(None)
        await wait_until(lambda: not tab.streaming and "t/s" in header.label.plain)
        widths = {"after the first turn": header.label.cell_length}
        await press(pilot, *"hi", "enter")
        await wait_until(lambda: tab.streaming and "t/s" not in header.label.plain)
        widths["at the next turn's start"] = header.label.cell_length
        layouts = header._layout_updates
        client.pieces.put_nowait("two ")
        await wait_until(lambda: "t/s" in header.label.plain)
        widths["with its figures"] = header.label.cell_length
        client.pieces.put_nowait(None)
        await wait_until(lambda: not tab.streaming)
        await pilot.pause()
        widths["at its end"] = header.label.cell_length
        assert "●" not in header.label.plain
    assert len(set(widths.values())) == 1, widths
    assert header._layout_updates == layouts   # a label as wide as the last only repaints


async def test_tabs_that_send_at_once_reach_the_engine_together(chat_model_dir, tmp_path):
    """Issue 32 item 17: each tab's request went out only once its turn's views had mounted,
    behind every other tab's mounts, so the engine got the first alone and prefilled it
    before the others came (8 tabs: 62-95 ms after the sends). The requests go first now:
    when the last tab's stream starts, none of the four replies has mounted."""
    app, client = fed_app(chat_model_dir, tmp_path)
    mounted_when_sent: list[int] = []
    stream = client.stream

    def recording_stream(*args, **kwargs):
        mounted_when_sent.append(sum(reply.is_mounted for reply in app.query(AssistantMessage)))
        return stream(*args, **kwargs)

    client.stream = recording_stream
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(3):
            await press(pilot, "ctrl+n")
        await wait_until(lambda: len(app.chat_tabs) == 4)
        for tab in app.chat_tabs:
            assert tab.send("hi")
        await wait_until(lambda: len(mounted_when_sent) == 4)
        for _ in range(4):
            client.pieces.put_nowait(None)
        await wait_until(lambda: not any(tab.streaming for tab in app.chat_tabs))
    assert mounted_when_sent == [0, 0, 0, 0]


async def test_a_hidden_tabs_reply_footer_waits_until_it_is_shown(chat_model_dir, tmp_path):
    """Issue 32 item 17: every streaming tab refreshed its reply's footer twice a second on
    a clock of its own, shown or not; only the shown tab's does, in the panel's frames, and
    a hidden one's when it is shown."""
    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        tab, reply = await streaming_reply(app, pilot)
        for index in range(400):   # until the footer shows the turn's figures (a frame)
            client.pieces.put_nowait(f"first{index} ")
            await asyncio.sleep(0.025)
            if "ttft" in reply.footer:
                break
        assert "ttft" in reply.footer, reply.footer
        await press(pilot, "ctrl+n")
        await wait_until(lambda: len(app.chat_tabs) == 2 and not tab.region)
        hidden_footer = reply.footer
        for index in range(40):   # ~1 s of deltas, two of the old clock's refreshes
            client.pieces.put_nowait(f"word{index} ")
            await asyncio.sleep(0.025)
        await wait_until(lambda: tab.session.turn.text.endswith("word39 "))
        assert reply.footer == hidden_footer
        await press(pilot, "alt+left")
        await wait_until(lambda: reply.footer != hidden_footer and "ttft" in reply.footer)
        client.pieces.put_nowait(None)
        await wait_until(lambda: not tab.streaming)


@pytest.mark.timeout(90)   # on the old code the close itself never returned
async def test_closing_a_tab_never_waits_on_a_replys_render(chat_model_dir, tmp_path, monkeypatch):
    """A tab shown again renders its replies (`catch_up`); closing it must not wait for that
    render (in the full suite a streaming tab closed from its confirm dialog stayed, its
    removal held up behind a handler awaiting the reply's Markdown). A render that never
    ends stands in for the one that hung."""
    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        tab, _ = await streaming_reply(app, pilot)
        client.pieces.put_nowait("A reply. ")
        client.pieces.put_nowait(None)
        await wait_until(lambda: not tab.streaming)
        await press(pilot, "ctrl+n")
        # Hidden on screen, not only in the tabs' state: a tab the compositor never saw hidden
        # gets no Show event when it is chosen again.
        await wait_until(lambda: len(app.chat_tabs) == 2 and app.active_tab is app.chat_tabs[1]
                         and not tab.region)
        rendering = asyncio.Event()

        async def render_forever(reply: AssistantMessage) -> None:
            rendering.set()
            await asyncio.Event().wait()

        monkeypatch.setattr(AssistantMessage, "catch_up", render_forever)
        await press(pilot, "alt+left")
        await wait_until(lambda: app.active_tab is tab and rendering.is_set())
        await press(pilot, "ctrl+w")
        await wait_until(lambda: not tab.is_attached, timeout=20)
        assert app.chat_tabs == [app.active_tab] and app.active_tab is not tab


async def test_a_ready_app_keeps_its_start_up_heap_out_of_full_collections(chat_model_dir, tmp_path):
    """What start-up built lives as long as the app: once the engine is ready it is frozen
    (a full collection while tabs stream walked ~300,000 objects, a third of a second of
    the UI thread each), and the app that exits unfreezes it for the process that goes on."""
    app, _ = fed_app(chat_model_dir, tmp_path)
    assert gc.get_freeze_count() == 0
    async with app.run_test(size=(120, 40)):
        await wait_until(lambda: app.engine is not None)
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


async def test_a_screen_update_renders_only_the_widgets_on_its_rows_and_shows_the_same(
        chat_model_dir, tmp_path):
    """Issue 32 item 17: for a screen update, Textual rendered every widget whose parent's
    visible area met the updated area, all their visible rows: a new line in a reply's last
    paragraph rendered every block of the replies in view and their containers, in full.
    The app's screen renders only the widgets whose own visible part meets the update, only
    its rows, and none of the rows that widgets in front cover whole; the terminal gets the
    same escape sequences, for a paragraph, a panel readout, a tab header, the status line,
    two far apart in one update, the chat's whole view (a layout) and the screen. A
    paragraph's update renders under a quarter of the rows, a layout under half, and two
    far-apart areas (a reply's paragraph and the panel's readout, in one frame) under a
    tenth: not every row of the box around them."""
    from types import MethodType

    from textual._compositor import Compositor
    from textual.geometry import Region

    from paged_chat.tui.textual_compat import UpdateCroppedCompositor

    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(160, 50)) as pilot:
        tab, reply = await streaming_reply(app, pilot)
        for line in [*POEM_START, "\n", *WHILE_HIDDEN, "\n", *AFTER_RETURN]:
            client.pieces.put_nowait(line)
        await wait_until(lambda: len(reply.query(MarkdownBlock)) == 3)
        client.pieces.put_nowait(None)
        await wait_until(lambda: not tab.streaming)
        await pilot.pause()
        compositor = app.screen._compositor
        assert isinstance(compositor, UpdateCroppedCompositor)
        paragraph = reply.query(MarkdownBlock).last()
        block_map = app.query_one(BlockMapView).region

        def map_row(y: int) -> Region:
            return Region(block_map.x, block_map.y + y, block_map.width, 1)

        areas = {"paragraph": [paragraph.region],
                 "readout": [app.query_one("#numbers").region],
                 "header": [app.query_one("ContentTab").region],
                 "status": [app.query_one("#status").region],
                 "paragraph and readout": [paragraph.region, app.query_one("#numbers").region],
                 "a graph and two rows of the block map": [
                     app.query_one("#spark-gen").region, map_row(1), map_row(5)],
                 "the chat's view (a layout)": [tab.messages.region],
                 "the screen": [app.screen.region]}

        def update(regions: list, renders) -> tuple[str, int]:
            """The update's escape sequences, and how many widget rows it rendered."""
            rows: list[int] = []
            compositor._get_renders = MethodType(
                lambda self, crop=None: (rows.append(len(r[2])) or r for r in renders(self, crop)),
                compositor)
            try:
                compositor._dirty_regions.update(regions)
                return compositor.render_partial_update().render_segments(app.console), sum(rows)
            finally:
                del compositor._get_renders

        for name, regions in areas.items():
            cropped, cropped_rows = update(regions, UpdateCroppedCompositor._get_renders)
            whole, whole_rows = update(regions, Compositor._get_renders)
            assert cropped == whole, name
            assert cropped_rows <= whole_rows, name
        for name, share in (("paragraph", 1 / 4), ("the chat's view (a layout)", 1 / 2),
                            ("paragraph and readout", 1 / 10)):
            cropped_rows = update(areas[name], UpdateCroppedCompositor._get_renders)[1]
            whole_rows = update(areas[name], Compositor._get_renders)[1]
            assert cropped_rows < whole_rows * share, (name, cropped_rows, whole_rows)


async def test_streaming_replies_share_one_markdown_parser(chat_model_dir, tmp_path, monkeypatch):
    """Issue 32 item 17: Textual's Markdown builds a new parser for each append, so each
    frame of each streaming reply built one (~0.5 ms). The replies share one now."""
    import textual.widgets._markdown as textual_markdown

    built: list[tuple] = []

    class CountedParser(textual_markdown.MarkdownIt):
        def __init__(self, *args, **kwargs) -> None:
            built.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(textual_markdown, "MarkdownIt", CountedParser)
    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        tab, reply = await streaming_reply(app, pilot)
        for line in [*POEM_START, "\n", *WHILE_HIDDEN]:
            client.pieces.put_nowait(line)
            if line.strip():   # each line in a frame of its own
                await wait_until(lambda: line.split()[-1] in shown_words(reply))
        client.pieces.put_nowait(None)
        await wait_until(lambda: not tab.streaming)
        assert len(reply.query(MarkdownBlock)) == 2
    assert built == []


async def test_a_new_footer_repaints_only_the_replys_bottom_border(chat_model_dir, tmp_path):
    """Issue 32 item 17: a reply's new footer (a streaming one's, twice a second) repainted
    the whole bubble, every line of the reply, in a screen update of that size. Only the
    bottom border's row is repainted now, and it shows the new footer."""
    from textual.geometry import Region

    app, client = fed_app(chat_model_dir, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        tab, reply = await streaming_reply(app, pilot)
        lines = POEM_START + WHILE_HIDDEN
        for line in lines:
            client.pieces.put_nowait(line)
        await wait_until(lambda: shown_words(reply) == "".join(lines).split())
        await pilot.pause()
        crops: list[Region] = []
        render_lines = reply.render_lines
        reply.render_lines = lambda crop: (crops.append(crop), render_lines(crop))[1]
        reply.footer = "ttft 0.10s · 12 tok · 30.0 tok/s"
        await wait_until(lambda: crops)
        width, height = reply.outer_size
        assert height > 4 and {(crop.y, crop.height) for crop in crops} == {(height - 1, 1)}
        assert "30.0 tok/s" in render_lines(Region(0, height - 1, width, 1))[0].text
        client.pieces.put_nowait(None)
        await wait_until(lambda: not tab.streaming)
