"""Make untrusted text safe to print on a terminal.

The engine hands back the model's text exactly as decoded, and users paste whatever they
like. Either can hold control characters and escape sequences: an ESC [ 2 J clears the
screen, an OSC sets the window title or plants a hyperlink, a carriage return overwrites
the line, and any of them can wreck a TUI's layout. Everything that prints such text (the
CLI, the TUI) passes it through `sanitize_for_terminal` first; the stored text stays exact.
"""

from __future__ import annotations

import re

# Whole escape sequences go, parameters included, so no "[31m" debris is left behind.
# Strings (OSC, DCS, SOS, PM, APC) run to their terminator (BEL or ST) or to the end of the
# text: a terminal would swallow all of it anyway. Then CSI, then the other ESC sequences
# (ESC, intermediates, a final byte). Both the 7-bit (ESC x) and 8-bit (C1) introducers count.
_ESCAPE_SEQUENCE = re.compile(
    r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f]).*?(?:\x07|\x1b\\|\x9c|\Z)"
    r"|(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
    r"|\x1b[ -/]*[0-~]",
    re.DOTALL)
# What is left of C0 (but tab and newline), DEL and C1: a lone ESC, CR, BEL, backspace...
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def sanitize_for_terminal(text: str) -> str:
    """`text` without ANSI escape sequences and control characters, newline and tab kept.

    Printable text, non-ASCII included, is unchanged, and so is a second pass. Text
    streamed in pieces is best sanitized whole: a sequence split across two pieces loses
    its ESC in the first and shows its tail, harmless, in the second.
    """
    return _CONTROL.sub("", _ESCAPE_SEQUENCE.sub("", text))
