"""The block map's legend: a swatch and a name per tab (the chats holding blocks first), then
the key to the map's symbols, laid out in whole entries to the widget's width.

The symbol key always shows, on lines of its own; the tabs get the lines left of MAX_LINES,
and when they need more, the last of their lines ends with "+N more". An entry never breaks
(a terminal's wrap at spaces would split "◆ shared" after its mark), and a long tab title is
cut to TITLE_CHARS.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rich.text import Text
from textual.widget import Widget

from paged_chat.tui.block_map import TAB_COLOURS
from paged_chat.tui.tab_info import TabInfo

MAX_LINES = 4
TITLE_CHARS = 18
GAP = "  "   # between entries on a line

SYMBOL_KEY = (Text.assemble(("◆", "bold"), " shared"), Text.assemble(("░", "dim"), " cached"),
              Text.assemble(("▚", "dim"), " restored"), Text("blank = free", style="dim"))


def tab_entries(tabs: Mapping[str, TabInfo], holders: Sequence[str] = ()) -> list[Text]:
    """One entry per tab, those of `holders` (chats holding blocks now) first: a cut legend
    still names the blocks on the map."""
    entries = []
    for chat_id in dict.fromkeys([*(h for h in holders if h in tabs), *tabs]):
        info = tabs[chat_id]
        title = info.title if len(info.title) <= TITLE_CHARS else info.title[:TITLE_CHARS - 1] + "…"
        entries.append(Text.assemble(("█", TAB_COLOURS[info.colour % len(TAB_COLOURS)]), " ", title))
    return entries


def format_legend(tabs: Mapping[str, TabInfo], holders: Sequence[str] = (), width: int = 45,
                  max_lines: int = MAX_LINES) -> Text:
    """The legend's lines for `width` columns: the tabs' (at most the lines the symbol key
    leaves of `max_lines`), then the symbol key's."""
    key = _lines(list(SYMBOL_KEY), width)
    room = max(1, max_lines - len(key))
    entries = tab_entries(tabs, holders)
    lines = _lines(entries, width)
    kept = len(entries)
    while len(lines) > room:   # drop entries from the end until they and "+N more" fit
        kept -= 1
        lines = _lines([*entries[:kept], Text(f"+{len(entries) - kept} more", style="dim")], width)
    return Text("\n").join(lines + key)


def _lines(entries: list[Text], width: int) -> list[Text]:
    """`entries` in lines of at most `width` cells, GAP between two on a line, none broken
    (one wider than a line is cut to it)."""
    lines: list[Text] = []
    line: Text | None = None
    for entry in entries:
        if line is not None and line.cell_len + len(GAP) + entry.cell_len <= width:
            line.append(GAP)
            line.append_text(entry)
            continue
        if line is not None:
            lines.append(line)
        line = entry.copy()
        line.truncate(max(1, width), overflow="ellipsis")
    if line is not None:
        lines.append(line)
    return lines


class Legend(Widget):
    """The legend as a widget: as tall as its lines for the width it gets."""

    DEFAULT_CSS = "Legend { height: auto; }"

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._tabs: Mapping[str, TabInfo] = {}
        self._holders: Sequence[str] = ()

    def show(self, tabs: Mapping[str, TabInfo], holders: Sequence[str]) -> None:
        """Show `holders` (the requests holding blocks) by their tabs. The screen is re-laid
        out only when the legend's height changes: the holders change at every turn's start
        and end, and a layout pass costs several times a repaint."""
        width, height = self.content_size
        self._tabs, self._holders = tabs, holders
        self.refresh(layout=self._height(width) != height)

    def _height(self, width: int) -> int:
        return len(format_legend(self._tabs, self._holders, width).split("\n"))

    def get_content_height(self, container, viewport, width: int) -> int:
        return self._height(width)

    def render(self) -> Text:
        return format_legend(self._tabs, self._holders, self.content_size.width)
