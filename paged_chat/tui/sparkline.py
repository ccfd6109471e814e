"""A one-line sparkline scaled from 0 (Textual's Sparkline scales from the data's minimum,
so a steady batch of 8 draws as flat bottom bars)."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.reactive import reactive
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

    def render(self) -> Text:
        return Text(bars(self.data, self.size.width, self.ceiling), no_wrap=True)
