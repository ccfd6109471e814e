"""What a reply's Markdown is shown as: a model's single line breaks stay line breaks.

Markdown joins the lines of a paragraph (a "soft" break); chat models mean their line
breaks (a poem, an address, steps). Outside code fences each line ending that closes a
non-blank line becomes a hard break (two spaces before the newline). Only what is shown
changes: the reply's stored and copied text stays exact. A hard break before a blank
line, a heading's end or a new block is ignored by Markdown, so paragraphs, lists and
tables render as before.
"""

from __future__ import annotations

import re

HARD_BREAK = "  \n"
_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")


def _fence_state(lines: list[str], fence: str | None) -> str | None:
    """The fence open after `lines` (complete lines), given the one open before them."""
    for line in lines:
        marker = _FENCE.match(line)
        if marker is None:
            continue
        run = marker.group(1)
        if fence is None:
            fence = run
        elif run[0] == fence[0] and len(run) >= len(fence) and not line.strip(" " + run[0]):
            fence = None
    return fence


def hard_line_breaks(fragment: str, shown_before: str = "") -> str:
    """`fragment` with its single line breaks outside code fences made hard breaks.

    `shown_before` is what was shown of the same Markdown before `fragment` (its output
    from earlier calls, when a reply streams in pieces): it says whether the fragment
    starts inside a fence and where its first line began. A newline is decided only once
    its whole line is known, so pieces give the same result as the whole text."""
    head, _, partial = shown_before.rpartition("\n")
    fence = _fence_state(head.split("\n") if head else [], None)
    pieces = []
    line_start = partial
    for line in fragment.split("\n")[:-1]:
        whole = line_start + line
        line_start = ""
        outside = fence is None
        fence = _fence_state([whole], fence)
        hard = outside and fence is None and whole.strip() and not whole.endswith(("  ", "\\"))
        pieces.append(line + (HARD_BREAK if hard else "\n"))
    pieces.append(fragment.rpartition("\n")[2])
    return "".join(pieces)
