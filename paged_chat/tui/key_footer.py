"""The footer of keys, showing only the keys that fit whole.

Textual's footer lays its keys out in one row under the palette key docked at its right, so
on a narrow terminal the last keys shown were cut mid-word under it ("^r Rege▏^p palette").
This one hides, from the end of its row (the app lists the most needed keys first), every
key that would not fit whole beside the palette key; they stay in the palette and in F1.
"""

from __future__ import annotations

from textual.widgets import Footer


class KeyFooter(Footer):
    def on_resize(self) -> None:
        self._fit()

    async def recompose(self) -> None:
        await super().recompose()   # the bindings changed: new keys, all shown
        self.call_after_refresh(self._fit)

    def _fit(self) -> None:
        keys = list(self.query("FooterKey"))   # Textual exports no FooterKey: by its name
        palette = [key for key in keys if key.has_class("-command-palette")]
        room = self.size.width - sum(key.outer_size.width for key in palette)
        for key in keys:
            if key in palette:
                continue
            room -= key.render().cell_len + key.styles.margin.width
            key.display = room >= 0
