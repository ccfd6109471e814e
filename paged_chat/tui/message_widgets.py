"""Message widgets: the user's prompt, the assistant's streamed Markdown reply, errors.

A reply streams through Textual's MarkdownStream. To keep the cost of each append bounded
(Markdown.append re-joins and re-parses from its last block), a long reply is split into
several Markdown widgets at paragraph breaks outside code fences: each stays small, so
streaming a reply costs about linear time in its length, not quadratic. A reply keeps what
it is written until the app's next frame (its FrameClock: `catch_up`), where it renders
as one append beside the panel's redraw, so the terminal gets one screen
update per frame however many tabs stream; a hidden tab renders nothing until it is shown.
A frame re-lays the screen out only when the reply's last paragraph grows a line
(`ReplyParagraph`) or its code block a line or a column (`ReplyFence`): most frames only
add words to one. A reasoning model's thinking shows apart, above the answer, collapsed to
one line (`ThinkingSection`).
"""

from __future__ import annotations

import asyncio
import re

from markdown_it import MarkdownIt
from rich.cells import cell_len
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.geometry import Region
from textual.visual import VisualType
from textual.widgets import Collapsible, Label, Markdown, Static
from textual.widgets.markdown import MarkdownBlock, MarkdownStream

from paged_chat.app.text import sanitize_for_terminal as clean
from paged_chat.tui.fit_parts import SEPARATOR, fit_parts
from paged_chat.tui.markdown_text import hard_line_breaks
from paged_chat.tui.textual_compat import set_border_subtitle

CHUNK_CHARS = 2000   # start a new Markdown widget at the next paragraph break past this
BORDER_CELLS = 6      # of a bubble's outer width, what its bottom border keeps (corners, ends, spaces)
_FENCE = re.compile(r"^ {0,3}(```|~~~)", re.MULTILINE)
_CODE_BLOCK = re.compile(r"^ {0,3}(```|~~~)[^\n]*\n(.*?)^ {0,3}\1", re.MULTILINE | re.DOTALL)


def code_blocks(markdown: str) -> list[str]:
    """The fenced code blocks of a Markdown text, in order (contents only)."""
    return [match.group(2) for match in _CODE_BLOCK.finditer(markdown)]


def _inside_fence(text: str) -> bool:
    return len(_FENCE.findall(text)) % 2 == 1


class ReplyParagraph(Markdown.BLOCKS["paragraph_open"]):
    """A paragraph whose new text asks for a layout only if its height changes. Textual
    re-lays the whole screen out for any new text of a block (Static.update), then repaints
    every widget, where most frames of a streaming reply only add words to its last line."""

    def update(self, content: VisualType = "", *, layout: bool = True) -> None:
        width, height = self.content_size
        if (layout and width and isinstance(content, Content)
                and content.get_height(self.styles, width) == height):
            layout = False
        super().update(content, layout=layout)


class FenceCode(Label):
    """A ReplyFence's code, whose new text asks for a layout only if its size changes: a
    streaming code block gets new text at every frame, most of it on its last line. The
    code is as wide as the block until a line is longer (then it scrolls)."""

    def update(self, content: VisualType = "", *, layout: bool = True) -> None:
        shown = self.content
        if (layout and self.is_mounted and isinstance(content, Content)
                and isinstance(shown, Content)
                and content.plain.count("\n") == shown.plain.count("\n")
                and _longest_line(content.plain) <= self.content_size.width):
            layout = False
        super().update(content, layout=layout)


class ReplyFence(Markdown.BLOCKS["fence"]):
    """A code block whose new text asks for a layout only if its size changes (FenceCode)."""

    def compose(self) -> ComposeResult:
        for code in super().compose():   # Textual's Label of the highlighted code
            yield FenceCode(code.content, id="code-content", expand=True)


def _longest_line(text: str) -> int:
    return max(cell_len(line) for line in text.split("\n"))


# Every reply parses with this one parser (it keeps no state between parses): Textual's
# Markdown builds a new one for each append, at every frame of every streaming reply.
_PARSER = MarkdownIt("gfm-like")


class ReplyMarkdown(Markdown):
    """A reply's Markdown, its paragraphs ReplyParagraphs and its code blocks ReplyFences."""

    BLOCKS: dict[str, type[MarkdownBlock]] = Markdown.BLOCKS | {
        "paragraph_open": ReplyParagraph, "fence": ReplyFence, "code_block": ReplyFence}

    def __init__(self, markdown: str | None = None) -> None:
        super().__init__(markdown, parser_factory=lambda: _PARSER)


def branch_title(label: str, branch: tuple[int, int] | None) -> str:
    """A message's border title: who said it and, where the message has other versions
    (an edit, a regenerate), which of them it is: `you ◀ 2/3 ▶`."""
    return label if branch is None else f"{label} ◀ {branch[0]}/{branch[1]} ▶"


class UserMessage(Static):
    """The user's prompt, as typed (no markup). `message_id` is its row in the chat store
    (None until the store has it); `branch` which of its versions it is, when it has several."""

    def __init__(self, text: str, message_id: int | None = None,
                 branch: tuple[int, int] | None = None) -> None:
        super().__init__(Text(clean(text)), classes="message user")
        self.text = text
        self.message_id = message_id
        self.show_branch(branch)

    def show_branch(self, branch: tuple[int, int] | None) -> None:
        self.border_title = branch_title("you", branch)


class ErrorMessage(Static):
    def __init__(self, text: str) -> None:
        super().__init__(Text(clean(text)), classes="message error")
        self.border_title = "error"


def thinking_title(tokens: int) -> str:
    return f"thinking · {tokens} token{'' if tokens == 1 else 's'}"


class ThinkingSection(Collapsible):
    """A reply's thinking, collapsed to one line (`thinking · 412 tokens`) that expands
    on a click, Enter on it, or the app's show_thinking key. Its text is rendered only
    while it is expanded: a collapsed one costs a title per frame, however long it gets."""

    def __init__(self, text: str, tokens: int) -> None:
        self._body = Static(classes="thinking-text")
        super().__init__(self._body, title=thinking_title(tokens), collapsed=True,
                         classes="thinking")
        self.text = text
        self._rendered: str | None = None   # the text the body shows

    def show(self, text: str, tokens: int) -> None:
        """The thinking so far and its token count."""
        self.text = text
        self.title = thinking_title(tokens)
        if not self.collapsed:
            self._render_body()

    def on_collapsible_expanded(self) -> None:
        self._render_body()

    def _render_body(self) -> None:
        if self._rendered != self.text:
            self._rendered = self.text
            self._body.update(Text(clean(self.text)))


class AssistantMessage(Vertical):
    """A reply: its thinking (a ThinkingSection, where it has one), Markdown chunks plus a
    one-line footer (finish reason, timings).

    `text` is the reply's answer exactly (copy, code blocks), `reasoning` its thinking (None:
    it has none); what is shown has escape sequences and control characters removed
    (`sanitize_for_terminal`), piece by piece. `message_id` and `branch` are as for
    UserMessage."""

    def __init__(self, text: str = "", footer: str = "", reasoning: str | None = None,
                 reasoning_tokens: int = 0, message_id: int | None = None,
                 branch: tuple[int, int] | None = None) -> None:
        super().__init__(classes="message assistant")
        self.text = text
        self.reasoning = reasoning
        self.reasoning_tokens = reasoning_tokens
        self.thinking: ThinkingSection | None = None
        self._thinking_stale = False   # thinking written since the last frame
        self.message_id = message_id
        self.show_branch(branch)
        self._footer = footer   # " · "-joined parts (timings, how the reply ended)
        self._show_footer(footer)
        self._chunks: list[Markdown] = []
        self._chunk_text = hard_line_breaks(clean(text))   # what the last chunk shows
        self._stream: MarkdownStream | None = None
        self._backlog = ""   # written since the last frame (or while hidden), not yet rendered
        self._stale = False  # finished while hidden: the final render is still to do
        self._rendering = asyncio.Lock()  # one render at a time: the turn's and the tab's (shown)

    def compose(self):
        # Not from `text`: a reply written before it mounts (a hidden tab's) keeps that in
        # its backlog, for its first frame.
        if self.reasoning is not None and not self._thinking_stale:
            self.thinking = ThinkingSection(self.reasoning, self.reasoning_tokens)
            yield self.thinking
        markdown = ReplyMarkdown(self._chunk_text or None)
        self._chunks.append(markdown)
        yield markdown

    def show_branch(self, branch: tuple[int, int] | None) -> None:
        self.border_title = branch_title("assistant", branch)

    @property
    def footer(self) -> str:
        return self._footer

    @footer.setter
    def footer(self, value: str) -> None:
        self._footer = value
        self._fit_footer()

    def on_resize(self) -> None:
        self._fit_footer()

    def _fit_footer(self) -> None:
        """The footer's " · " parts that fit the bottom border whole (a narrow bubble cut
        it mid-number): the last part (how the reply ended) and the first (TTFT) stay
        longest, the ones before the last go first."""
        parts = self._footer.split(SEPARATOR) if self._footer else []
        ranks = [0 if index == len(parts) - 1 else index + 1 for index in range(len(parts))]
        width = self.outer_size.width - BORDER_CELLS if self.outer_size.width else len(self._footer)
        self._show_footer(fit_parts(parts, width, ranks).plain)

    def _show_footer(self, footer: str) -> None:
        """The footer in the bottom border, that row repainted: Textual's `border_subtitle`
        repaints the whole bubble, every line of the reply, where a streaming reply's
        footer changes at every FOOTER_EVERY_S (textual_compat.set_border_subtitle)."""
        set_border_subtitle(self, Content(footer))
        width, height = self.outer_size
        if not height:
            self.refresh()
            return
        self.refresh(Region(0, height - 1, width, 1).translate(-self.content_offset))

    def write(self, fragment: str) -> None:
        """Stream a fragment of the reply: it is kept, with the others of its frame, until
        the next `catch_up` (the app's frame, or the tab being shown) or `finish_stream`."""
        self.text += fragment
        self._backlog += hard_line_breaks(clean(fragment), self._chunk_text + self._backlog)

    def write_thinking(self, fragment: str, tokens: int) -> None:
        """Stream a fragment of the reply's thinking, `tokens` long so far: kept, like
        `write`'s, until the next frame."""
        self.reasoning = (self.reasoning or "") + fragment
        self.reasoning_tokens = tokens
        self._thinking_stale = True

    def toggle_thinking(self) -> bool:
        """Expand or collapse the thinking; False when the reply has none shown."""
        if self.thinking is None:
            return False
        self.thinking.collapsed = not self.thinking.collapsed
        return True

    async def _render_thinking(self) -> None:
        if not self._thinking_stale:
            return
        self._thinking_stale = False
        if self.thinking is None:
            self.thinking = ThinkingSection(self.reasoning or "", self.reasoning_tokens)
            await self.mount(self.thinking, before=self._chunks[0])
        else:
            self.thinking.show(self.reasoning or "", self.reasoning_tokens)

    async def _render_backlog(self) -> None:
        """Append the backlog to the stream: Markdown.append re-parses from the start of the
        last block it has, so lines a hidden tab kept back join their paragraph whole."""
        fragment, self._backlog = self._backlog, ""
        if not fragment:
            return
        while (cut := self._chunk_end(fragment)) is not None:
            await self._append(fragment[:cut])
            await self._new_chunk()
            fragment = fragment[cut:]
        await self._append(fragment)

    def _chunk_end(self, fragment: str) -> int | None:
        """Where `fragment` ends the current chunk: after its first paragraph break outside
        a code fence that makes the chunk at least CHUNK_CHARS long; None if none does."""
        search = max(0, CHUNK_CHARS - len(self._chunk_text) - 2)
        while (found := fragment.find("\n\n", search)) != -1:
            cut = found + 2
            if not _inside_fence(self._chunk_text + fragment[:cut]):
                return cut
            search = cut
        return None

    async def _append(self, fragment: str) -> None:
        if not fragment:
            return
        if self._stream is None:
            self._stream = Markdown.get_stream(self._chunks[-1])
        self._chunk_text += fragment
        await self._stream.write(fragment)

    async def _new_chunk(self) -> None:
        await self._stop_stream(render=True)
        markdown = ReplyMarkdown()
        self._chunks.append(markdown)
        self._chunk_text = ""
        await self.mount(markdown)

    async def finish_stream(self, render: bool = True) -> None:
        """The reply is complete: flush the stream, then render the last chunk once more from
        its whole text. With render=False (a hidden tab) that waits for `catch_up`."""
        async with self._rendering:
            if render:
                await self._render_thinking()
                await self._render_backlog()
            await self._stop_stream(render)

    async def _stop_stream(self, render: bool) -> None:
        """End the chunk's stream and re-render it whole (Markdown.update). Only a chunk that
        gets no more appends is updated: update leaves Markdown's incremental parser at the
        document's last line, so a later append would replace the last block's earlier lines."""
        streamed = self._stream is not None
        if streamed:
            await self._stream.stop()
            self._stream = None
        if not render:
            self._stale = self._stale or streamed or bool(self._backlog)
            return
        self._chunk_text += self._backlog
        self._backlog = ""
        if streamed or self._stale:
            self._stale = False
            await self._chunks[-1].update(self._chunk_text)

    async def catch_up(self) -> None:
        """Render what was kept back (the app's frame, or a hidden tab being shown): a
        streaming reply's backlog goes through its stream, a finished one's last chunk is
        re-rendered."""
        async with self._rendering:
            await self._render_thinking()
            if self._stale:
                await self._stop_stream(render=True)
            else:
                await self._render_backlog()
