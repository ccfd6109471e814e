"""Where the TUI goes past Textual's public API, for speed: on the Textual it was written
for only (`WRITTEN_FOR`, the version pyproject pins), and Textual's stock behaviour on any
other, which shows the same and costs more. No other module of the package touches a
Textual private (tests/test_tui_textual_api.py checks).

- `crop_screen_updates`: for an update, Textual's compositor renders every widget whose
  parent's visible area (its clip) meets the updated area, every visible row of each: a
  new line in one paragraph of a reply renders each block of every reply in view and all
  their containers. The cropped compositor renders the widgets whose own visible part
  meets one of the updated areas, only those areas' rows, and of each widget only the rows
  that the widgets in front of it leave a cell of. What reaches the terminal is the same:
  each cell of an update comes from the widget in front at that cell, which meets the area
  and is rendered on its rows.
- `relabel_tab`: Tab's label setter re-lays the whole screen out; a label as wide as the
  one shown needs only a repaint.
- `set_border_subtitle`: the `border_subtitle` setter repaints the whole widget (every
  line of a reply, for its footer); here the caller repaints the border's row.
- `INPUT_THREAD_NAME`: Textual's terminal input thread is not a daemon, and on a terminal
  that hung up (a closed window: SIGHUP, which the app answers as Ctrl+Q) its select
  reports end of file at once, for ever: if the app's exit could not stop it, the
  interpreter's exit would wait on it spinning a core. The CLI ends the process past it.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from importlib.metadata import version

from textual.content import Content
from textual.geometry import Region
from textual.screen import Screen
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Static, Tab

try:
    from textual._compositor import ChopsUpdate, Compositor
except ImportError:   # a Textual without it: `overrides_apply` is False there
    Compositor = object

WRITTEN_FOR = "8.2.8"
INPUT_THREAD_NAME = "textual-input"   # LinuxDriver's


@cache
def overrides_apply() -> bool:
    """Whether the installed Textual is the one this module was written for."""
    return version("textual") == WRITTEN_FOR and Compositor is not object


def crop_screen_updates(screen: Screen) -> None:
    """`screen`'s partial updates render only the rows of the updated areas that widgets
    show (call from its constructor); stock updates on another Textual."""
    if overrides_apply():
        screen._compositor = UpdateCroppedCompositor()


def relabel_tab(header: Tab, label: Content) -> None:
    """Show `label`, as wide as the header's label now, in the header: repainted, without
    the layout the label setter asks for (that setter on another Textual)."""
    if not overrides_apply():
        header.label = label
        return
    header._label = label
    Static.update(header, label, layout=False)


def set_border_subtitle(widget: Widget, subtitle: Content) -> None:
    """Set `widget`'s border subtitle without repainting it (the caller repaints the border's
    row); through the setter, which repaints the whole widget, on another Textual."""
    if overrides_apply():
        widget._border_subtitle = subtitle
    else:
        widget.border_subtitle = subtitle


class UpdateCroppedCompositor(Compositor):
    """A compositor that renders, for an update, only the rows of it that widgets show.

    `Compositor._get_renders` yields, front to back, each widget's region, its clip and its
    rendered rows within both; the compositor places the rows it needs."""

    def __init__(self) -> None:
        super().__init__()
        self._updated: list[Region] = []   # the areas of the partial update being rendered

    def render_partial_update(self) -> ChopsUpdate | None:
        # Textual renders within the areas' bounding box: a panel readout and a reply's
        # paragraph in one update rendered every widget between them, row by row.
        self._updated = list(self._dirty_regions)
        try:
            return super().render_partial_update()
        finally:
            self._updated = []

    def _get_renders(self, crop: Region | None = None
                     ) -> Iterable[tuple[Region, Region, list[Strip]]]:
        if crop is None:
            yield from super()._get_renders(crop)
            return
        areas = [area.intersection(crop) for area in self._updated] or [crop]
        in_front = RowCover()
        for widget, (region, clip) in self.visible_widgets.items():
            shown = region.intersection(clip)
            # Only the rows of the areas this widget meets: no widget behind it needs others.
            for first, end in _merged(sorted((max(area.y, shown.y), min(area.bottom, shown.bottom))
                                             for area in areas if area.overlaps(shown))):
                needed = Region(shown.x, first, shown.width, end - first)
                for first_uncovered, end_uncovered in in_front.uncovered_runs(needed):
                    band = Region(shown.x, first_uncovered, shown.width, end_uncovered - first_uncovered)
                    yield region, band, widget.render_lines(band.translate((-region.x, -region.y)))
                in_front.add(needed)


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted (first, end) runs with the overlapping and touching ones merged."""
    merged: list[tuple[int, int]] = []
    for first, end in runs:
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((first, end))
    return merged


class RowCover:
    """The cells of each row that widgets in front already take, as sorted, merged spans:
    a widget's row inside them would be rendered for nothing (the compositor keeps, for
    each cell, the first widget's, front to back)."""

    def __init__(self) -> None:
        self._spans: dict[int, list[tuple[int, int]]] = {}

    def uncovered_runs(self, area: Region) -> Iterable[tuple[int, int]]:
        """The runs of `area`'s rows (first, end) with a cell no widget in front takes."""
        start = None
        for y in range(area.y, area.bottom):
            covered = any(x1 <= area.x and area.right <= x2 for x1, x2 in self._spans.get(y, ()))
            if covered and start is not None:
                yield start, y
                start = None
            elif not covered and start is None:
                start = y
        if start is not None:
            yield start, area.bottom

    def add(self, area: Region) -> None:
        for y in range(area.y, area.bottom):
            self._spans[y] = _merged(sorted([*self._spans.get(y, ()), (area.x, area.right)]))
