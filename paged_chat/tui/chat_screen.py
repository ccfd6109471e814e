"""The app's main screen: Textual's Screen, whose screen updates render only what they show.

For an update, Textual's compositor renders every widget whose parent's visible area (its
clip) meets the updated area, and every visible row of each: a new line in one paragraph of
a reply rendered each block of every reply in view, and all their containers, in full (a
fixed ~5 ms an update at 160x50, with 8 tabs streaming 12 updates a second on the cores
the engine needs). This screen's updates render the widgets whose own visible part meets
one of the updated areas, only those areas' rows, and of each widget only the rows that
the widgets in front of it leave a cell of (the containers behind a chat's messages are
covered whole on most rows): a layout that moves every line in view renders about half
the rows it did, and a frame that updates a reply's paragraph and the panel's readout
renders those two, not every widget in the box around them. What reaches the terminal is
the same: each cell of an update comes from the widget in front at that cell, which meets
the area and is rendered on its rows.

`Compositor._get_renders` is Textual's own (textual is pinned, 8.2.8): it yields, front to
back, each widget's region, its clip and its rendered rows within both; the compositor
places the rows it needs.
"""

from __future__ import annotations

from collections.abc import Iterable

from textual._compositor import ChopsUpdate, Compositor
from textual.geometry import Region
from textual.screen import Screen
from textual.strip import Strip


class UpdateCroppedCompositor(Compositor):
    """A compositor that renders, for an update, only the rows of it that widgets show."""

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


class ChatScreen(Screen):
    """The app's default screen, on an UpdateCroppedCompositor."""

    def __init__(self, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name, id, classes)
        self._compositor = UpdateCroppedCompositor()
