"""A one-line sparkline scaled from 0 (Textual's Sparkline scales from the data's minimum,
so a steady batch of 8 draws as flat bottom bars). It draws its line as one segment (the
line API): its data change in each of the panel's frames, and Textual's content rendering
(a Text, wrapped and styled) cost more than the frame's other work on the graphs."""

from __future__ import annotations

from collections.abc import Sequence

from rich.segment import Segment
from rich.style import Style
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

BARS = "▁▂▃▄▅▆▇█"


def bars(values: Sequence[float], width: int, ceiling: float | None = None) -> str:
    """The last `width` values as bar characters, 0 at the bottom, `ceiling` (default: the
    largest value) at the top."""
    values = list(values)[-width:] if width > 0 else []
    top = ceiling if ceiling else max(values, default=0.0)
    if top <= 0:
        return BARS[0] * len(values)
    last = len(BARS) - 1
    return "".join(BARS[min(last, max(0, round(v / top * last)))] for v in values)


class Spark(Widget):
    DEFAULT_CSS = """
    Spark { height: 1; color: $primary; }
    """

    data: reactive[tuple[float, ...]] = reactive(tuple)

    def __init__(self, *, ceiling: float | None = None, id: str | None = None) -> None:
        super().__init__(id=id)
        self.ceiling = ceiling

    def render_line(self, y: int) -> Strip:
        width, style = self.size.width, self.rich_style
        line = bars(self.data, width, self.ceiling) if y == 0 else ""
        return Strip([Segment(line, style)], len(line)).extend_cell_length(
            width, Style(bgcolor=style.bgcolor))
