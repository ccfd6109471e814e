"""What a reply is shown as: single line breaks outside code fences become hard breaks."""

from __future__ import annotations

import random

import pytest

from paged_chat.tui.markdown_text import hard_line_breaks

POEM = "The tide's force,\nA gentle lapping\n\nthe moon stays"
REPLY = ("Steps:\nfirst\nsecond\n\n```python\nx = 1\ny = 2\n```\nafter the fence\n"
         "~~~\n```\nstill code\n~~~\n- a\n- b\n")


@pytest.mark.timeout(30)
def test_single_newlines_become_hard_breaks_outside_fences():
    assert hard_line_breaks(POEM) == "The tide's force,  \nA gentle lapping  \n\nthe moon stays"
    shown = hard_line_breaks(REPLY)
    assert "```python\nx = 1\ny = 2\n```\n" in shown               # code stays exact
    assert "~~~\n```\nstill code\n~~~\n" in shown                  # ``` does not close ~~~
    assert shown.startswith("Steps:  \nfirst  \nsecond  \n\n")
    assert "after the fence  \n" in shown and shown.endswith("- a  \n- b  \n")


@pytest.mark.timeout(30)
def test_lines_that_already_break_are_left_alone():
    assert hard_line_breaks("two spaces  \nbackslash\\\nend") == "two spaces  \nbackslash\\\nend"


@pytest.mark.timeout(30)
def test_streamed_pieces_show_the_same_as_the_whole_reply():
    rng = random.Random(0)
    whole = hard_line_breaks(REPLY)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(REPLY)), rng.randint(1, 12)))
        shown = ""
        for start, end in zip([0, *cuts], [*cuts, len(REPLY)]):
            shown += hard_line_breaks(REPLY[start:end], shown)
        assert shown == whole
