"""Make untrusted text safe to print on a terminal.

The engine hands back the model's text exactly as decoded, and users paste whatever they
like. Either can hold control characters and escape sequences: an ESC [ 2 J clears the
screen, an OSC sets the window title or plants a hyperlink, a carriage return overwrites
the line, and any of them can wreck a TUI's layout. Everything that prints such text (the
CLI, the TUI) passes it through `sanitize_for_terminal` first; the stored text stays exact.
Text that arrives in pieces (a streamed reply) goes through a `StreamSanitizer`, which
holds back a sequence cut between two pieces until it is whole, so the screen shows
exactly what sanitizing the whole text would.

Text from outside (argv, JSON) can also hold lone surrogates, which are not text at all:
`check_text` refuses them with a message naming where they came from.
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
# A tail that more text could still turn into (or extend as) an escape sequence: a string
# not yet terminated (its last char may be the ESC that starts ST), a CSI before its final byte,
# an ESC before its final byte. Found leftmost, so a string holding other introducers is
# held from its own start.
_INCOMPLETE_TAIL = re.compile(
    r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])(?:(?!\x07|\x1b\\|\x9c).)*\Z"
    r"|(?:\x1b\[|\x9b)[0-?]*[ -/]*\Z"
    r"|\x1b[ -/]*\Z",
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


class StreamSanitizer:
    """`sanitize_for_terminal` for text that arrives in pieces: what `feed` returns, joined,
    then `flush`, equals `sanitize_for_terminal` of the whole text. An escape sequence cut
    between two pieces is held back until it is complete (or the text ends), so neither
    half reaches the terminal and no debris of it shows."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, text: str) -> str:
        text = self._pending + text
        tail = _INCOMPLETE_TAIL.search(text)
        cut = len(text) if tail is None else tail.start()
        self._pending = text[cut:]
        return sanitize_for_terminal(text[:cut])

    def flush(self) -> str:
        """The sanitized rest, at the end of the text: a sequence still open is dropped."""
        rest, self._pending = self._pending, ""
        return sanitize_for_terminal(rest)


def check_text(text: str, what: str) -> str:
    """`text` if it is valid Unicode; else a ValueError naming `what` (e.g. "the prompt
    argument") and the first bad character. Python hands undecodable bytes of argv over as
    lone surrogates (U+DC80-U+DCFF), and JSON can spell one (\\ud800): no tokenizer,
    database or terminal takes them."""
    bad = _SURROGATE.search(text)
    if bad is None:
        return text
    code = ord(bad.group())
    found = (f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF
             else f"a lone surrogate U+{code:04X}")
    raise ValueError(f"{what} is not valid UTF-8 text: {found} at character {bad.start() + 1}")


_SURROGATE = re.compile(r"[\ud800-\udfff]")
