"""The TUI's widgets without an app: the block map (codes, layout, details, legend) and the
message views (escape sequences, code blocks, bounded Markdown chunks, line breaks)."""

from __future__ import annotations

import numpy as np
import pytest

from paged_chat.engine.core.stats import BlockMap
from paged_chat.tui.block_map import (
    CACHED,
    FREE,
    SHARED,
    TAB0,
    Layout,
    block_codes,
    cell_grid,
    downsample,
)
from paged_chat.tui.engine_panel import describe_block
from paged_chat.tui.legend import format_legend
from paged_chat.tui.markdown_text import hard_line_breaks
from paged_chat.tui.message_widgets import AssistantMessage, code_blocks
from paged_chat.tui.tab_info import TabInfo


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
    plain = format_legend(tabs, holders=["tab-6", "gone", "tab-2"]).plain
    assert plain.startswith("█ Tab 6  █ Tab 2  █ Tab 0  █ Tab 1  █ Tab 3")
    assert plain.count("Tab 6") == 1


@pytest.mark.timeout(30)
async def test_the_legend_lays_the_screen_out_only_when_its_height_changes():
    """Issue 32 item 17: the holders change at every turn's start and end (8 demo tabs: 1-2
    times a second), and each change re-laid the whole screen out. A new order of the same
    lines only repaints; fewer lines re-lay it."""
    from textual.app import App

    from paged_chat.tui.legend import Legend

    tabs = {f"tab-{n}": TabInfo(f"Tab {n}", n, lambda rid: None) for n in range(8)}

    class LegendApp(App):
        def compose(self):
            yield Legend()

    app = LegendApp()
    async with app.run_test(size=(45, 20)) as pilot:
        legend = app.query_one(Legend)
        legend.show(tabs, ())
        await pilot.pause()
        height, layouts = legend.size.height, legend._layout_updates
        legend.show(tabs, ("tab-6",))
        await pilot.pause()
        assert legend._layout_updates == layouts and legend.size.height == height
        assert legend.render().plain.startswith("█ Tab 6")
        legend.show({"tab-0": tabs["tab-0"]}, ())
        await pilot.pause()
        assert legend._layout_updates > layouts and legend.size.height < height


@pytest.mark.timeout(30)
async def test_the_legend_follows_the_chats_holding_blocks_in_the_panels_frames():
    """Issue 32 item 17: the legend drew the holders of any snapshot that changed them, a
    screen update between two frames at every turn's start and end. The panel draws only
    when the app's frame gives it a snapshot (issue 45: the app reads one per frame), and
    its legend lists the chats holding blocks first, as that snapshot has them."""
    from helpers import snapshot
    from textual.app import App

    from paged_chat.tui.engine_panel import EnginePanel
    from paged_chat.tui.legend import Legend

    owners = ["tab-a", "tab-b", "tab-c"]
    tabs = {owner: TabInfo(owner, n, lambda rid: None) for n, owner in enumerate(owners)}

    class PanelApp(App):
        def compose(self):
            yield EnginePanel()

    async with PanelApp().run_test(size=(60, 50)) as pilot:
        panel = pilot.app.query_one(EnginePanel)
        legend = panel.query_one(Legend)
        panel.show_stats(snapshot(0, owners), tabs)
        assert legend._holders == tuple(owners)
        panel.show_stats(snapshot(1, owners[::-1]), tabs)
        assert legend._holders == tuple(owners[::-1])
        await pilot.pause()


@pytest.mark.timeout(60)
async def test_the_block_map_takes_a_new_themes_colours():
    """The map keeps its rows' strips and its styles between frames; a new theme (Ctrl+P)
    left the free blocks in the old theme's background until their rows changed."""
    from helpers import wait_until
    from textual.app import App

    from paged_chat.tui.block_map import BlockMapView

    class MapApp(App):
        CSS = "BlockMapView > .blockmap--free { background: $panel; }"

        def compose(self):
            yield BlockMapView()

    def free_background(view: BlockMapView):
        """The background of the map's last cell (a free block) as drawn."""
        return list(view.render_line(0))[-1].style.bgcolor

    async with MapApp().run_test(size=(40, 10)) as pilot:
        pilot.app.theme = "textual-dark"
        view = pilot.app.query_one(BlockMapView)
        view.show(_block_map(64, {"a/1": [0, 1, 2]}, {"a/1": "a"}), {"a": 0})
        await pilot.pause()
        dark = free_background(view)
        assert dark == view.get_component_rich_style("blockmap--free").bgcolor
        pilot.app.theme = "textual-light"
        await wait_until(lambda: free_background(view) != dark, timeout=10)
        assert free_background(view) == view.get_component_rich_style("blockmap--free").bgcolor


@pytest.mark.timeout(30)
async def test_escape_sequences_in_text_never_reach_the_terminal():
    from textual.app import App

    from paged_chat.tui.message_widgets import AssistantMessage, UserMessage

    evil = "ok\x1b[2J\x1b]0;pwned\x07 done\r"
    reply, user = AssistantMessage(), UserMessage(evil)

    class Host(App):
        def compose(self):
            yield user
            yield reply

    async with Host().run_test() as pilot:
        reply.write(evil)
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

    from paged_chat.tui import message_widgets as m

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
            reply.write(text[start:start + 37])
            await reply.catch_up()   # the app's frame: the shown reply renders
            hidden.write(text[start:start + 37])   # a hidden tab's gets no frame
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
async def test_a_streaming_code_block_lays_the_screen_out_only_when_it_grows_a_line():
    """Issue 32 item 17: a streaming reply's code block gets new text at every frame, and
    Textual re-laid the whole screen out for each (25-40 ms at 160x50 on 2 cores). Code
    added to its last line asks for no layout; a new line asks for one."""
    from textual.app import App
    from textual.widgets.markdown import MarkdownFence

    reply = AssistantMessage()

    class Host(App):
        def compose(self):
            yield reply

    async with Host().run_test(size=(100, 30)) as pilot:
        async def frame(piece: str) -> None:   # a piece, and the app's frame
            reply.write(piece)
            await reply.catch_up()
            await pilot.pause()

        await frame("```python\nvalue = 1")
        code = reply.query_one(MarkdownFence).query_one("#code-content")
        assert code.content_size.height == 1
        layouts = code._layout_updates
        for term in (" + 2", " + 3", " + 4"):
            await frame(term)
        assert code.render().plain.rstrip() == "value = 1 + 2 + 3 + 4"
        assert code._layout_updates == layouts
        await frame("\nmore = value * 2")
        assert code._layout_updates > layouts and code.content_size.height == 2


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
            streamed.write(poem[start:start + 3])
            await streamed.catch_up()
        await streamed.finish_stream()
        await pilot.pause()
        for reply in (stored, streamed):
            [paragraph] = reply.query(MarkdownParagraph)
            assert str(paragraph.render()) == "The tide's force,\nA gentle lapping"
            assert reply.text == poem and code_blocks(reply.text) == ["keep\nthis\n"]
