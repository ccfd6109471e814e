"""One-line texts made of parts joined by " · " (the status line, a reply's footer), fitted to
a width by leaving out whole parts, the least needed first, never by cutting one mid-word
(a cut line ended "tokens/seq ·" or "241 tok…")."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

SEPARATOR = " · "


def fit_parts(parts: Sequence[Text | str], width: int, ranks: Sequence[int] | None = None,
              style: str = "") -> Text:
    """`parts` in their order, joined by SEPARATOR (in `style`), leaving out the parts of the
    highest rank first (`ranks`, one per part; by default the later parts go first) until
    the line fits `width` cells. The part of the lowest rank stays, cut with an ellipsis if
    it alone is too wide."""
    parts = [part if isinstance(part, Text) else Text(part) for part in parts]
    ranks = list(ranks) if ranks is not None else list(range(len(parts)))
    assert len(ranks) == len(parts)
    kept = list(range(len(parts)))
    while len(kept) > 1 and _width(parts, kept) > width:
        kept.remove(max(kept, key=lambda index: (ranks[index], index)))
    line = Text(no_wrap=True, overflow="ellipsis")
    for position, index in enumerate(kept):
        if position:
            line.append(SEPARATOR, style=style)
        line.append_text(parts[index])
    line.truncate(max(0, width), overflow="ellipsis")
    return line


def _width(parts: list[Text], kept: list[int]) -> int:
    return sum(parts[index].cell_len for index in kept) + len(SEPARATOR) * (len(kept) - 1)
