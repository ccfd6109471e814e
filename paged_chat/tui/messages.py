"""Message views: the user's prompt, the assistant's streamed Markdown reply, errors.

A reply streams through Textual's MarkdownStream. To keep the cost of each append bounded
(Markdown.append re-joins and re-parses from its last block), a long reply is split into
several Markdown widgets at paragraph breaks outside code fences: each stays small, so
streaming a reply costs about linear time in its length, not quadratic.
"""

from __future__ import annotations

import re

from rich.text import Text
from textual.containers import Vertical
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from paged_chat.text import sanitize_for_terminal as clean
from paged_chat.tui.markdown_text import hard_line_breaks

CHUNK_CHARS = 2000   # start a new Markdown widget at the next paragraph break past this
_FENCE = re.compile(r"^ {0,3}(```|~~~)", re.MULTILINE)
_CODE_BLOCK = re.compile(r"^ {0,3}(```|~~~)[^\n]*\n(.*?)^ {0,3}\1", re.MULTILINE | re.DOTALL)


def code_blocks(markdown: str) -> list[str]:
    """The fenced code blocks of a Markdown text, in order (contents only)."""
    return [match.group(2) for match in _CODE_BLOCK.finditer(markdown)]


def _inside_fence(text: str) -> bool:
    return len(_FENCE.findall(text)) % 2 == 1


class UserMessage(Static):
    """The user's prompt, as typed (no markup)."""

    def __init__(self, text: str) -> None:
        super().__init__(Text(clean(text)), classes="message user")
        self.text = text
        self.border_title = "you"


class ErrorMessage(Static):
    def __init__(self, text: str) -> None:
        super().__init__(Text(clean(text)), classes="message error")
        self.border_title = "error"


class AssistantMessage(Vertical):
    """A reply: Markdown chunks plus a one-line footer (finish reason, timings).

    `text` is the reply exactly (copy, code blocks); what is shown has escape sequences
    and control characters removed (`sanitize_for_terminal`), piece by piece."""

    def __init__(self, text: str = "", footer: str = "") -> None:
        super().__init__(classes="message assistant")
        self.text = text
        self.border_title = "assistant"
        self.border_subtitle = footer
        self._chunks: list[Markdown] = []
        self._chunk_text = ""
        self._stream: MarkdownStream | None = None
        self._backlog = ""   # written while hidden, not yet rendered
        self._stale = False  # finished while hidden: the final render is still to do

    def compose(self):
        shown = hard_line_breaks(clean(self.text))
        markdown = Markdown(shown or None)
        self._chunks.append(markdown)
        self._chunk_text = shown
        yield markdown

    @property
    def footer(self) -> str:
        return str(self.border_subtitle or "")

    @footer.setter
    def footer(self, value: str) -> None:
        self.border_subtitle = value

    async def write(self, fragment: str, render: bool = True) -> None:
        """Stream a fragment of the reply; with render=False only keep it (the tab is
        hidden) until a later write or finish_stream renders the backlog at once."""
        self.text += fragment
        fragment = hard_line_breaks(clean(fragment), self._chunk_text + self._backlog)
        if not render:
            self._backlog += fragment
            return
        fragment, self._backlog = self._backlog + fragment, ""
        if not fragment:
            return
        if len(self._chunk_text) >= CHUNK_CHARS and "\n\n" in fragment:
            cut = fragment.index("\n\n") + 2
            if not _inside_fence(self._chunk_text + fragment[:cut]):
                await self._append(fragment[:cut])
                await self._new_chunk()
                fragment = fragment[cut:]
        await self._append(fragment)

    async def _append(self, fragment: str) -> None:
        if not fragment:
            return
        if self._stream is None:
            self._stream = Markdown.get_stream(self._chunks[-1])
        self._chunk_text += fragment
        await self._stream.write(fragment)

    async def _new_chunk(self) -> None:
        await self.finish_stream()
        markdown = Markdown()
        self._chunks.append(markdown)
        self._chunk_text = ""
        await self.mount(markdown)

    async def finish_stream(self, render: bool = True) -> None:
        """Flush the stream, then render the last chunk once more from its whole text.
        With render=False (a hidden tab) that last render waits for `catch_up`."""
        streamed = self._stream is not None
        if streamed:
            await self._stream.stop()
            self._stream = None
        if not render:
            self._stale = self._stale or streamed or bool(self._backlog)
            return
        backlog, self._backlog = self._backlog, ""
        self._chunk_text += backlog
        if streamed or backlog or self._stale:
            self._stale = False
            await self._chunks[-1].update(self._chunk_text)

    async def catch_up(self) -> None:
        """Render what a hidden tab kept back (called when the tab is shown)."""
        if self._stale or self._backlog:
            await self.finish_stream()
