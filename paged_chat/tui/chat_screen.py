"""The app's main screen: Textual's Screen, whose screen updates render only what they show.

For an update, Textual's compositor renders every widget whose parent's visible area (its
clip) meets the updated area, and every visible row of each: a new line in one paragraph of
a reply rendered each block of every reply in view, and all their containers, in full (a
fixed ~5 ms an update at 160x50, with 8 tabs streaming 12 updates a second on the cores
the engine needs). This screen's updates render the widgets whose own visible part meets
the updated area, and only its rows. What reaches the terminal is the same: the cells of
an update come from the widgets in front at each of its cells, all of which meet it.

`Compositor._get_renders` is Textual's own (textual is pinned, 8.2.8): it yields, front to
back, each widget's region, its clip and its rendered rows within both; the compositor
places the rows it needs.
"""

from __future__ import annotations

from collections.abc import Iterable

from textual._compositor import Compositor
from textual.geometry import Region
from textual.screen import Screen
from textual.strip import Strip


class UpdateCroppedCompositor(Compositor):
    """A compositor that renders, for an update, only the rows of it that widgets show."""

    def _get_renders(self, crop: Region | None = None
                     ) -> Iterable[tuple[Region, Region, list[Strip]]]:
        if crop is None:
            yield from super()._get_renders(crop)
            return
        rows = Region(0, crop.y, self.size.width, crop.height)
        for widget, (region, clip) in self.visible_widgets.items():
            clip = clip.intersection(rows)
            shown = region.intersection(clip)
            if shown and crop.overlaps(shown):
                yield region, clip, widget.render_lines(shown.translate((-region.x, -region.y)))


class ChatScreen(Screen):
    """The app's default screen, on an UpdateCroppedCompositor."""

    def __init__(self, name: str | None = None, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(name, id, classes)
        self._compositor = UpdateCroppedCompositor()
