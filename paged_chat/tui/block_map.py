"""The KV block map: one cell per physical block, coloured by the tab that holds it.

Everything per block is computed with numpy from the compact `BlockMap` arrays (who holds
a block from the tables alone, whatever the pool's size); per frame
the widget makes one run-length-merged `Segment` per run of equal cells, so the cost is
bounded by the panel's size, not the pool's (10k+ blocks fit: they are scaled down).

Layouts, picked to fit the widget's size:
- full:   one block per character cell (tab colour `█`, shared `◆`, cached `░`);
- half:   two blocks per cell, stacked as the top and bottom half of `▀`;
- scaled: half, with each half cell standing for `k` blocks (the most telling of them:
          shared > tab > other > cached > free).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.geometry import Region
from textual.message import Message
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from paged_chat.engine.core.stats import BlockMap

FREE, CACHED, SHARED, OTHER, RESTORED, TAB0 = 0, 1, 2, 3, 4, 5

# Distinct on dark and light backgrounds; tab k gets TAB_COLOURS[k % len].
TAB_COLOURS = ("#e15759", "#4e79a7", "#59a14f", "#f28e2b", "#b07aa1", "#76b7b2",
               "#edc948", "#ff9da7", "#9c755f", "#86bcb6", "#d37295", "#8cd17d")
NUM_CODES = TAB0 + len(TAB_COLOURS)

# Which code wins when one half cell stands for several blocks.
_RANK = np.zeros(NUM_CODES, dtype=np.int8)
_RANK[[FREE, CACHED, RESTORED, OTHER, SHARED]] = [0, 1, 1, 2, 4]
_RANK[TAB0:] = 3

_FULL_GLYPHS = {FREE: " ", CACHED: "░", RESTORED: "▚", SHARED: "◆", OTHER: "▒"}


def block_codes(blocks: BlockMap, owner_colour: Mapping[str, int]) -> np.ndarray:
    """Per block: FREE, CACHED, RESTORED (cached, its KV read back from the KV tier), SHARED
    (several holders), OTHER (an owner with no tab) or TAB0 + the colour index of the tab
    (the request's owner) that holds it."""
    ref = np.asarray(blocks.ref_counts)
    codes = np.zeros(len(ref), dtype=np.uint8)
    cached = np.asarray(blocks.cached, dtype=bool) & (ref == 0)
    codes[cached] = CACHED
    codes[cached & np.asarray(blocks.from_tier, dtype=bool)] = RESTORED
    codes[ref > 0] = OTHER   # no table holds it (a table's holder recodes it below)
    cells, first_holder, count = blocks.first_holders()
    if len(cells):
        request_code = np.array(
            [TAB0 + owner_colour[o] % len(TAB_COLOURS) if o in owner_colour else OTHER
             for o in blocks.request_owners], dtype=np.uint8)
        codes[cells] = request_code[first_holder]
    codes[cells[count > 1]] = SHARED
    return codes


@dataclass(frozen=True, slots=True)
class Layout:
    """How `num_blocks` blocks map onto a `width` x `rows` grid of character cells."""

    num_blocks: int
    width: int
    rows: int
    half: bool           # two pixels (blocks or groups) per cell, top and bottom
    per_pixel: int = 1   # blocks per pixel (> 1 only when the pool is too large)

    @classmethod
    def fit(cls, num_blocks: int, width: int, height: int) -> "Layout":
        width, height = max(1, width), max(1, height)
        if num_blocks <= width * height:
            return cls(num_blocks, width, math.ceil(num_blocks / width), half=False)
        if num_blocks <= 2 * width * height:
            return cls(num_blocks, width, math.ceil(num_blocks / (2 * width)), half=True)
        per_pixel = math.ceil(num_blocks / (2 * width * height))
        pixels = math.ceil(num_blocks / per_pixel)
        return cls(num_blocks, width, math.ceil(pixels / (2 * width)), half=True,
                   per_pixel=per_pixel)

    @property
    def blocks_per_cell(self) -> int:
        return self.per_pixel * (2 if self.half else 1)

    def blocks_at(self, x: int, y: int) -> tuple[int, ...]:
        """The block ids under the character cell at (x, y); empty outside the map."""
        if not (0 <= x < self.width and 0 <= y < self.rows):
            return ()
        pixels = (2 * y, 2 * y + 1) if self.half else (y,)
        ids = []
        for pixel_row in pixels:
            first = (pixel_row * self.width + x) * self.per_pixel
            ids.extend(range(first, min(first + self.per_pixel, self.num_blocks)))
        return tuple(ids)

    def cell_of(self, block_id: int) -> tuple[int, int]:
        """The (x, y) cell showing `block_id`."""
        pixel = block_id // self.per_pixel
        row, x = divmod(pixel, self.width)
        return x, (row // 2 if self.half else row)


def downsample(codes: np.ndarray, per_pixel: int) -> np.ndarray:
    """One code per group of `per_pixel` blocks: the highest-ranked code of the group."""
    if per_pixel == 1:
        return codes
    pad = (-len(codes)) % per_pixel
    grouped = np.concatenate([codes, np.zeros(pad, dtype=codes.dtype)]).reshape(-1, per_pixel)
    best = np.argmax(_RANK[grouped], axis=1)
    return grouped[np.arange(len(grouped)), best]


def cell_grid(codes: np.ndarray, layout: Layout) -> tuple[np.ndarray, np.ndarray | None]:
    """(top, bottom) code grids of shape [rows, width]; bottom is None in full layout.

    Cells past the end of the pool get the code -1 (drawn as nothing)."""
    pixels = downsample(codes, layout.per_pixel).astype(np.int16)
    per_row = layout.width * (2 if layout.half else 1)
    total = layout.rows * per_row
    grid = np.full(total, -1, dtype=np.int16)
    grid[:len(pixels)] = pixels
    if not layout.half:
        return grid.reshape(layout.rows, layout.width), None
    grid = grid.reshape(layout.rows, 2, layout.width)
    return grid[:, 0, :], grid[:, 1, :]


@dataclass(frozen=True, slots=True)
class Palette:
    """The map's styles from the theme: a rich Style (its colour) per code, the pool's
    background, and the selected cell's."""

    codes: list[Style]
    pool: Style
    selected: Style


class BlockMapView(Widget):
    """Draws the block map of the last snapshot it was given; reports hover and clicks."""

    COMPONENT_CLASSES = {"blockmap--free", "blockmap--cached", "blockmap--restored", "blockmap--shared",
                         "blockmap--other", "blockmap--selected"}

    DEFAULT_CSS = """
    BlockMapView { height: 1fr; min-height: 3; }
    """

    selected: reactive[int | None] = reactive(None)

    class Hovered(Message):
        """The pointer is over `block_ids` (empty: it left the map)."""

        def __init__(self, block_ids: tuple[int, ...]) -> None:
            super().__init__()
            self.block_ids = block_ids

    class Selected(Message):
        """A click pinned `block_id` (None: unpinned)."""

        def __init__(self, block_id: int | None) -> None:
            super().__init__()
            self.block_id = block_id

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.codes: np.ndarray = np.zeros(0, dtype=np.uint8)
        self.layout_: Layout = Layout.fit(0, 1, 1)
        self._strips: list[Strip] | None = None
        self._keys: np.ndarray | None = None   # the cells `_strips` draw (one row each)
        self._hover: tuple[int, ...] = ()
        # Kept until the CSS changes: Textual drops a widget's component styles at every
        # refresh, and each changed row is one (a style lookup per symbol, every frame).
        self._palette: Palette | None = None

    def show(self, blocks: BlockMap | None, owner_colour: Mapping[str, int]) -> None:
        """Take a new snapshot's block map; redraws on the next frame only the rows whose
        cells changed (a frame of streaming chats changes a few of the map's rows)."""
        codes = np.zeros(0, dtype=np.uint8) if blocks is None else block_codes(blocks, owner_colour)
        if np.array_equal(codes, self.codes):
            return  # nothing to redraw
        same_layout = len(codes) == len(self.codes)
        self.codes = codes
        if self._strips is None or self._keys is None or not same_layout:
            self._strips = None
            self.refresh()
            return
        keys = self._cell_keys()
        changed = np.flatnonzero((keys != self._keys).any(axis=1))
        self._keys = keys
        rows = self._row_strips(keys, changed)
        width = self.size.width
        for y, strip in zip(changed.tolist(), rows):
            self._strips[y] = strip
            self.refresh(Region(0, y, width, 1))

    def on_resize(self, event: events.Resize) -> None:
        self._strips = None

    def watch_selected(self) -> None:
        self._strips = None
        self.refresh()

    # ---- drawing --------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        if self._strips is None:
            self._strips = self._build_strips()
        return self._strips[y] if y < len(self._strips) else Strip.blank(self.size.width)

    def notify_style_update(self) -> None:
        """The CSS changed (a theme, a class): the map's colours come from it."""
        super().notify_style_update()
        self._palette = None
        self._strips = None

    def _theme_palette(self) -> Palette:
        if self._palette is None:
            free = self.get_component_rich_style("blockmap--free")
            background = free.bgcolor
            styles = [Style(bgcolor=background)] * NUM_CODES
            for code, name in ((CACHED, "cached"), (RESTORED, "restored"), (SHARED, "shared"),
                               (OTHER, "other")):
                styles[code] = Style(color=self.get_component_rich_style(f"blockmap--{name}").color)
            for index, colour in enumerate(TAB_COLOURS):
                styles[TAB0 + index] = Style(color=colour)
            styles[FREE] = Style(color=background)
            self._palette = Palette(styles, Style(bgcolor=background),
                                    self.get_component_rich_style("blockmap--selected"))
        return self._palette

    def _build_strips(self) -> list[Strip]:
        width, height = self.size
        self._keys = None
        if width <= 0 or height <= 0:
            return []
        self.layout_ = Layout.fit(len(self.codes), width, height)
        if not len(self.codes):
            return []
        self._keys = self._cell_keys()
        return self._row_strips(self._keys, range(len(self._keys)))

    def _cell_keys(self) -> np.ndarray:
        """One key per cell of the map as `layout_` lays the codes out: the cell's code, or
        with two pixels a cell, one per (top, bottom) pair (-1, past the pool, maps to 0)."""
        top, bottom = cell_grid(self.codes, self.layout_)
        if bottom is None:
            return top.astype(np.int32)
        return (top.astype(np.int32) + 1) * (NUM_CODES + 1) + (bottom.astype(np.int32) + 1)

    def _row_strips(self, keys: np.ndarray, rows: Sequence[int]) -> list[Strip]:
        """The strips of `rows` of the map whose cells are `keys`."""
        width = self.size.width
        half_cells = self.layout_.half
        palette = self._theme_palette()
        styles, pool = palette.codes, palette.pool
        base = self.rich_style
        pair_cache: dict[int, tuple[str, Style]] = {}

        def look(key: int) -> tuple[str, Style]:
            found = pair_cache.get(key)
            if found is None:
                if not half_cells:
                    if key < 0:
                        found = (" ", base)
                    else:
                        found = (_FULL_GLYPHS.get(key, "█"), base + pool + styles[key])
                else:
                    upper, lower = divmod(key, NUM_CODES + 1)
                    found = self._half_cell(upper - 1, lower - 1, styles, base)
                pair_cache[key] = found
            return found

        selected_cell = None
        if self.selected is not None and self.selected < self.layout_.num_blocks:
            selected_cell = self.layout_.cell_of(self.selected)
        strips = []
        for y in rows:
            row = keys[y]
            starts = np.flatnonzero(np.diff(row)) + 1
            bounds = np.concatenate(([0], starts, [len(row)]))
            segments = []
            for start, end in zip(bounds[:-1], bounds[1:]):
                glyph, style = look(int(row[start]))
                segments.append(Segment(glyph * int(end - start), style))
            strip = Strip(segments, width)
            if selected_cell is not None and selected_cell[1] == y:
                x = selected_cell[0]
                left, cell, right = strip.divide([x, x + 1, width])
                cell = Strip([Segment(s.text, s.style + palette.selected) for s in cell], 1)
                strip = Strip.join([left, cell, right])
            strips.append(strip)
        return strips

    @staticmethod
    def _half_cell(upper: int, lower: int, styles: list[Style], base: Style) -> tuple[str, Style]:
        """The glyph and style of a cell holding two pixels (codes; -1 = past the pool).
        Free halves show the pool's background, so a free cell is blank."""
        pool = styles[FREE].color

        def background(code: int):
            return pool if code == FREE else base.bgcolor

        upper_blank, lower_blank = upper in (FREE, -1), lower in (FREE, -1)
        if upper_blank and lower_blank:
            return " ", base + Style(bgcolor=background(max(upper, lower)))
        if upper_blank:
            return "▄", base + Style(color=styles[lower].color, bgcolor=background(upper))
        if lower_blank:
            return "▀", base + Style(color=styles[upper].color, bgcolor=background(lower))
        if upper == lower:
            return "█", base + Style(color=styles[upper].color)
        return "▀", base + Style(color=styles[upper].color, bgcolor=styles[lower].color)

    # ---- pointer --------------------------------------------------------------------

    def _blocks_under(self, event: events.MouseEvent) -> tuple[int, ...]:
        offset = event.get_content_offset(self)
        if offset is None:
            return ()
        return self.layout_.blocks_at(offset.x, offset.y)

    def on_mouse_move(self, event: events.MouseMove) -> None:
        blocks = self._blocks_under(event)
        if blocks != self._hover:
            self._hover = blocks
            self.post_message(self.Hovered(blocks))

    def on_leave(self, event: events.Leave) -> None:
        if self._hover:
            self._hover = ()
            self.post_message(self.Hovered(()))

    def on_click(self, event: events.Click) -> None:
        blocks = self._blocks_under(event)
        block = self.most_telling(blocks) if blocks else None
        self.selected = None if block == self.selected else block
        self.post_message(self.Selected(self.selected))

    def most_telling(self, blocks: tuple[int, ...]) -> int | None:
        """The block of `blocks` worth describing: the highest-ranked state, lowest id."""
        ids = [b for b in blocks if b < len(self.codes)]
        if not ids:
            return None
        ranks = _RANK[self.codes[ids]]
        return ids[int(np.argmax(ranks))]
