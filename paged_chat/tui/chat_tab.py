"""One chat tab: a view of one ChatSession, its messages and its prompt input.

The tab gets what it needs passed down (its session, a way to wait for the engine, the
app's sampling defaults) and reports up with messages; it never reaches into the app.
Its turn worker streams the session's deltas on the app's event loop (the engine thread
hands over one batch of deltas per step, never one call per token) into a MarkdownStream;
the session keeps the store and the conversation. The first message the user sends is
shown at once; if the model is still loading, the turn waits.

Branches: Alt+Up / Alt+Down select a message; an edit of a selected user message (the
prompt takes its text; Enter sends it) or a regenerate of a selected reply branches the
chat there (the session's `edit` / `regenerate`), and the views from that message on give
way to the new branch's. A message with other versions shows which it is (`◀ 2/3 ▶`);
switching versions shows the branch below the one switched to, as the store reads it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.markup import escape
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Button, Static, TabPane
from textual.worker import Worker

from paged_chat.app.chat_session import ChatSession, chat_title
from paged_chat.app.finish_labels import finish_label
from paged_chat.app.text import sanitize_for_terminal as clean
from paged_chat.engine.core.errors import describe_error
from paged_chat.tui.block_map import TAB_COLOURS
from paged_chat.tui.message_widgets import AssistantMessage, ErrorMessage, UserMessage, code_blocks
from paged_chat.tui.prompt_input import PromptInput

if TYPE_CHECKING:
    from textual.widget import AwaitMount, Widget

    from paged_chat.engine import EngineClient, SamplingParams

FOOTER_EVERY_S = 0.5   # how often a shown reply's footer (TTFT, tokens/s) refreshes as it streams
MOUNT_AT_ONCE = 30     # messages mounted when a chat opens; older ones on demand
SYSTEM_PREVIEW = 60     # characters of the system prompt the tab's info line shows at most (then …)
SYSTEM_PREVIEW_MIN = 16  # fewer would say nothing: the line wraps instead
HEADER_FIGURES = " {ttft_s:.2f}s {tokens_per_s:3.0f}t/s"   # one width up to 9.99 s and 999 t/s
# Engine priorities (the lower served first): the reply the user watches goes before those
# of hidden tabs (the demo's, a broadcast's), which wait while it needs the budget or the pool.
SHOWN_TAB_PRIORITY = 0
HIDDEN_TAB_PRIORITY = 1

WaitForEngine = Callable[[], Awaitable["EngineClient"]]
MakeParams = Callable[[dict], "SamplingParams"]
EngineTrouble = Callable[[], "str | None"]   # None while the engine can take a turn


class ChatTab(TabPane):
    """A tab pane showing one chat. Its chat id doubles as the engine `owner` tag."""

    streaming: reactive[bool] = reactive(False)

    class Changed(Message):
        """The tab's header (title, streaming state, metrics) needs redrawing."""

        def __init__(self, tab: ChatTab) -> None:
            super().__init__()
            self.tab = tab

    class Rekeyed(Changed):
        """The tab now shows another chat (the demo starting over)."""

    class TurnEnded(Changed):
        """A reply finished (stopped, failed or complete)."""

    def __init__(self, session: ChatSession, colour: int, *, wait_for_engine: WaitForEngine,
                 sampling_params: MakeParams, engine_trouble: EngineTrouble) -> None:
        super().__init__(session.title)
        self.session = session
        self.colour = colour
        self.wait_for_engine = wait_for_engine
        self.sampling_params = sampling_params
        self.engine_trouble = engine_trouble
        self.error: str | None = None
        self._loaded = False                   # the stored messages are mounted
        self._streaming_reply: AssistantMessage | None = None   # the reply the turn streams into
        self._frame: Worker | None = None      # the last frame's render of it
        self._footer_at = 0.0                  # when a frame last refreshed its footer
        self._earlier: list = []               # stored messages not mounted yet
        self._unshown: list[Widget] = []       # a hidden tab's new views, mounted once it is shown
        self._selected: UserMessage | AssistantMessage | None = None   # Alt+Up / Alt+Down's
        self._editing: UserMessage | None = None   # the message Enter sends the prompt in place of
        self._draft = ""                           # the prompt's text before the edit, for Esc

    @property
    def chat_id(self) -> str:
        return self.session.chat_id

    @property
    def title(self) -> str:
        return self.session.title

    @property
    def priority(self) -> int:
        """The engine priority of this tab's turns: the shown tab's go first."""
        return SHOWN_TAB_PRIORITY if self.display else HIDDEN_TAB_PRIORITY

    def reprioritize(self) -> None:
        """The tab was shown or hidden: its streaming reply moves to its new priority."""
        self.session.reprioritize(self.priority)

    # ---- layout ---------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(self._info_text(), classes="chat-info")
        with VerticalScroll(classes="messages"):
            yield Button("show earlier messages", classes="earlier hidden")
        yield PromptInput(placeholder="Message (Enter sends, Shift+Enter or Ctrl+J: new line)")

    @property
    def messages(self) -> VerticalScroll:
        return self.query_one(".messages", VerticalScroll)

    @property
    def prompt(self) -> PromptInput:
        return self.query_one(PromptInput)

    def on_mount(self) -> None:
        self.messages.anchor()

    def render_frame(self) -> None:
        """The app's frame: the streaming reply renders what it has kept since the last one
        (one Markdown append per frame however many deltas came), and its footer every
        FOOTER_EVERY_S; a hidden tab's wait until it is shown. Drawn in the app's frames
        only (its FrameClock), never on a clock of the tab's own, which would be a screen
        update of its own. The reply renders in a worker, not a callback on this tab's queue: closing the tab
        cancels the worker, where a callback waiting on the reply's Markdown held the tab's
        removal up for good. A frame that comes while the last one still renders is skipped
        (its text waits for the next)."""
        reply = self._streaming_reply
        if reply is None or not self.display or self._unshown or (
                self._frame is not None and not self._frame.is_finished):
            return
        if time.monotonic() - self._footer_at >= FOOTER_EVERY_S:
            self._footer_at = time.monotonic()
            self._refresh_streaming_footer(reply)
        self._frame = self.run_worker(reply.catch_up(), group="frame")

    def _refresh_streaming_footer(self, reply: AssistantMessage) -> None:
        """The streaming reply's footer, once its first token came (until then it says what
        the turn waits for)."""
        turn = self.session.turn
        if turn is not None and not turn.finished and turn.ttft_s is not None:
            reply.footer = self._footer()

    def on_show(self) -> None:
        """Replies that streamed or finished while the tab was hidden render now, in a worker
        of this tab, as a frame's render does and for the same reason: a handler on this
        tab's queue waiting on a reply's Markdown holds the tab's removal up for good (a
        dismissed dialog shows the tab again; its Ctrl+W confirm is one)."""
        self.run_worker(self._catch_up_replies(), group="show")

    async def _catch_up_replies(self) -> None:
        await self._mount_unshown()
        if self._streaming_reply is not None:
            self._refresh_streaming_footer(self._streaming_reply)
        for reply in self.query(AssistantMessage):
            await reply.catch_up()

    def _info_text(self) -> Text:
        """System prompt and sampling overrides on one line: the system prompt's preview is
        cut to leave the overrides their room; where even that does not fit, the line wraps
        between two settings (the settings are never cut)."""
        # name=value, no space: a wrap falls between two settings; unset (None) ones are defaults
        overrides = [f"{k}={v}" for k, v in sorted(self.session.sampling.items()) if v is not None]
        if self.session.thinking is not None:   # the chat's thinking switch (F3)
            overrides.append(f"thinking={'on' if self.session.thinking else 'off'}")
        settings = "  ·  " + ", ".join(overrides) if overrides else ""
        mark, label = "█ ", "system: "
        shown = self.query(".chat-info")
        width = shown.first().content_size.width if shown else 0   # 0: not laid out yet
        # One cell to spare: a line exactly content_size wide showed without its last character.
        used = len(mark) + len(label) + len("…") + len(settings) + 1
        room = SYSTEM_PREVIEW if width <= 0 else width - used
        limit = max(SYSTEM_PREVIEW_MIN, min(SYSTEM_PREVIEW, room))
        system = clean((self.session.system_prompt or "").replace("\n", " "))
        text = Text()
        text.append(mark, style=TAB_COLOURS[self.colour % len(TAB_COLOURS)])
        text.append(f"{label}{system[:limit] + '…' if len(system) > limit else system or '(none)'}")
        if settings:
            text.append(settings, style="dim")
        return text

    def refresh_info(self) -> None:
        self.query_one(".chat-info", Static).update(self._info_text())

    def on_resize(self) -> None:
        self.refresh_info()   # the system prompt's preview is fitted to the width

    def label(self) -> str:
        """The tab header: its colour's mark (a dot while a reply streams), its title, and the
        turn's TTFT and tokens/s. It keeps its width from a turn's start to the next turn
        (a dot takes the mark's place; the figures' place is blank until the first token):
        a header that changes width re-lays the tab bar out, moves the tabs after it and
        animates the shown tab's underline, screen updates of their own."""
        colour = TAB_COLOURS[self.colour % len(TAB_COLOURS)]
        mark = "●" if self.streaming else "█"
        label = f"[{colour}]{mark}[/] {escape(clean(self.title))}"
        turn = self.session.turn
        if turn is not None and turn.ttft_s is not None:
            figures = HEADER_FIGURES.format(ttft_s=turn.ttft_s, tokens_per_s=turn.tokens_per_s)
            return label + f"[dim]{figures}[/dim]"
        if self.streaming:
            return label + " " * len(HEADER_FIGURES.format(ttft_s=0.0, tokens_per_s=0.0))
        return label

    def watch_streaming(self) -> None:
        self.post_message(self.Changed(self))

    def set_title(self, title: str) -> None:
        self.session.rename(title)
        self.post_message(self.Changed(self))

    def _add_views(self, *views: Widget) -> AwaitMount | None:
        """Mount `views` after the messages if the tab is shown; a hidden tab keeps them until
        it is (`_mount_unshown`): a mount re-lays the whole screen out, shown or not, a
        layout no one would see."""
        if self.display and not self._unshown:
            return self.messages.mount(*views)
        self._unshown.extend(views)
        return None

    async def _mount_unshown(self) -> None:
        """Mount the views a hidden tab kept back, after the stored ones; views added while
        they mount go after them."""
        if not self._unshown:
            return
        await self.ensure_loaded()
        while self._unshown:
            views = list(self._unshown)
            await self.messages.mount_all(views)
            del self._unshown[:len(views)]
        self.messages.scroll_end(animate=False)

    # ---- lazy loading from the store --------------------------------------------------

    async def ensure_loaded(self) -> None:
        """Mount the stored chat's latest messages (once); older ones on demand."""
        if self._loaded:
            return
        self._loaded = True
        messages = list(self.session.load())
        self.refresh_info()
        self.prompt.prompt_history = [m.content for m in messages if m.role == "user"]
        self._earlier, recent = messages[:-MOUNT_AT_ONCE], messages[-MOUNT_AT_ONCE:]
        await self.messages.mount_all([self._view_of(m) for m in recent])
        self._show_earlier_button()
        self.messages.scroll_end(animate=False)

    def _show_earlier_button(self) -> None:
        button = self.query_one(".earlier", Button)
        button.label = f"show {len(self._earlier)} earlier messages"
        button.set_class(not self._earlier, "hidden")

    @on(Button.Pressed, ".earlier")
    async def show_earlier(self) -> None:
        batch, self._earlier = self._earlier[-MOUNT_AT_ONCE:], self._earlier[:-MOUNT_AT_ONCE]
        button = self.query_one(".earlier", Button)
        await self.messages.mount_all([self._view_of(m) for m in batch], after=button)
        self._show_earlier_button()

    # ---- the public actions -----------------------------------------------------------

    def tokens_of(self, request_id: str) -> Sequence[int] | None:
        """Token ids (prompt + reply so far) of this tab's live request, for the block map."""
        turn = self.session.turn
        return turn.live_ids if turn is not None and turn.request_id == request_id else None

    @on(PromptInput.Submitted)
    def _on_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        editing = self._editing
        if self._start_turn(event.text, branch_at=editing):
            event.prompt.remember(event.text)
            if editing is not None:
                self._stop_editing()

    def send(self, text: str) -> bool:
        """Start a turn with `text`; False (and a notice) while a reply is streaming or the
        engine cannot take it (the text then stays in the prompt, and nothing is stored)."""
        return self._start_turn(text)

    def regenerate(self) -> bool:
        """Answer again the selected reply's question (none selected: the last one's), as
        a branch beside that reply."""
        target = self._selected if isinstance(self._selected, AssistantMessage) else None
        if target is not None and target.message_id is None:
            self.notify("this reply is not in the chat store: only the last reply can be "
                        "regenerated", severity="warning", markup=False)
            return False
        if not self.streaming and self.session.last_user_text is None:
            self.notify("nothing to regenerate yet", severity="warning", markup=False)
            return False
        return self._start_turn(None, branch_at=target)

    # ---- branches ---------------------------------------------------------------------

    def _message_views(self) -> list[UserMessage | AssistantMessage]:
        return [view for view in self.messages.query(".message")
                if isinstance(view, (UserMessage, AssistantMessage))]

    async def select_message(self, step: int) -> None:
        """Select the message `step` places from the selected one (-1: the one before; from
        none, -1 selects the last); past the last message, none is selected. Before the
        first one mounted, the earlier ones are mounted."""
        views = self._message_views()
        at = views.index(self._selected) if self._selected in views else len(views)
        if at + step < 0 and self._earlier:
            await self.show_earlier()
            views = self._message_views()
            at = views.index(self._selected) if self._selected in views else len(views)
        target = max(0, at + step)
        self._select(views[target] if target < len(views) else None)

    def _select(self, view: UserMessage | AssistantMessage | None) -> None:
        if self._selected is not None:
            self._selected.remove_class("selected")
        self._selected = view
        if view is not None:
            view.add_class("selected")
            self.messages.scroll_to_widget(view, animate=False)

    def edit_selected(self) -> bool:
        """Put the selected user message's text in the prompt: Enter sends it in the
        message's place, as a new branch (Esc, `stop`, gives up and gives the prompt's
        text before back)."""
        view = self._selected
        if not isinstance(view, UserMessage):
            self.notify("select one of your messages first (Alt+Up)", severity="warning", markup=False)
            return False
        if view.message_id is None:
            self.notify("this message is not in the chat store: it cannot be edited",
                        severity="warning", markup=False)
            return False
        if self._editing is None:
            self._draft = self.prompt.text
        self._editing = view
        self.prompt.text = view.text
        self.prompt.move_cursor(self.prompt.document.end)
        self.prompt.border_title = "editing: Enter sends it as a new branch, Esc gives up"
        self.prompt.focus()
        return True

    def _stop_editing(self) -> None:
        self._editing = None
        self.prompt.border_title = None

    async def switch_branch(self, step: int, message_id: int | None = None) -> bool:
        """Show the version `step` places from message `message_id`'s (None: the selected
        message, else the last one with versions) and the branch below it."""
        if self.streaming:
            self.notify("wait for the reply to finish (or stop it) before switching branches",
                        severity="warning", markup=False)
            return False
        if message_id is None:
            views = [self._selected] if self._selected is not None else self._message_views()[::-1]
            message_id = next((view.message_id for view in views if view.message_id is not None
                               and self.session.branch_of(view.message_id)), None)
        switched = None if message_id is None else self.session.switch_branch(message_id, step)
        if switched is None:
            self.notify("no other branch that way", severity="warning", markup=False)
            return False
        await self._show_branch(select=switched)
        self.post_message(self.Changed(self))
        return True

    def branch_choices(self) -> list[tuple[str, int, int]]:
        """The branches the palette offers: for each message of the branch shown that has
        other versions, (label, message id, step to that version) per other version."""
        choices = []
        messages = self.session.chat.messages if self.session.chat is not None else []
        for number, message in enumerate(messages, 1):
            branch = self.session.branch_of(message.id)
            if branch is None:
                continue
            at, count = branch
            choices += [(f"Branch {version}/{count} at message {number} ({message.role})",
                         message.id, version - at)
                        for version in range(1, count + 1) if version != at]
        return choices

    async def _show_branch(self, select: int | None = None) -> None:
        """Mount the session's branch afresh, message `select` selected (an edit under way
        ends: its message may be gone)."""
        self._select(None)
        self._stop_editing()
        self._unshown.clear()
        await self.messages.query(".message").remove()
        self._loaded = False
        await self.ensure_loaded()
        self._select(next((view for view in self._message_views() if view.message_id == select), None))

    def _view_of(self, message) -> Static | AssistantMessage:
        return _view_of(message, self.session.branch_of(message.id))

    def _start_turn(self, text: str | None, branch_at: UserMessage | AssistantMessage | None = None
                    ) -> bool:
        if self.streaming:
            self.notify("a reply is still streaming: Esc stops it", severity="warning", markup=False)
            return False
        trouble = self.engine_trouble()
        if trouble is not None:
            kept = " (your message stays in the prompt)" if text is not None else ""
            self.notify(f"not sent: {trouble}{kept}", severity="error", timeout=8, markup=False)
            return False
        self.streaming = True
        self._select(None)
        self._run_turn(text, branch_at)
        return True

    def stop(self) -> bool:
        """Stop the streaming reply (its blocks go back to the pool); True if one was. Not
        streaming, it gives up an edit (the prompt gets back what it held before)."""
        if not self.streaming:
            if self._editing is not None:
                self._stop_editing()
                self.prompt.text = self._draft
            return False
        if not self.session.stop():  # still waiting for the model: drop the turn
            self.workers.cancel_group(self, "turn")
        return True

    def toggle_last_thinking(self) -> bool:
        """Expand or collapse the last reply's thinking; False when it has none."""
        replies = list(self.query(AssistantMessage))
        return bool(replies) and replies[-1].toggle_thinking()

    async def switch_thinking(self) -> bool | None:
        """Turn the model's thinking on or off for this chat's next turns (from the
        template's default, off); the new state, None where the template has no switch."""
        client = await self.wait_for_engine()
        if not self.session.can_switch_thinking(client):
            return None
        self.session.load()
        self.session.set_thinking(self.session.thinking is False)
        self.refresh_info()
        return self.session.thinking

    def replies(self) -> list[AssistantMessage]:
        """The tab's replies in order, those a hidden tab keeps back included."""
        return [*self.query(AssistantMessage),
                *(view for view in self._unshown if isinstance(view, AssistantMessage))]

    def last_reply(self) -> str | None:
        replies = self.replies()
        return replies[-1].text if replies else None

    def code_blocks(self) -> list[str]:
        return [block for reply in self.replies() for block in code_blocks(reply.text)]

    def apply_settings(self, system_prompt: str | None, sampling: dict[str, Any]) -> None:
        """New system prompt and sampling; a new system prompt starts a new context."""
        if self.session.update_settings(system_prompt, sampling):
            self.notify("the new system prompt applies from a fresh context "
                        "(the next prompt is encoded in full)", markup=False)
        self.refresh_info()

    async def start_over(self) -> None:
        """Go on in a new chat with the same settings (the demo's tabs do, every few turns)."""
        self._unshown.clear()
        self._select(None)
        self._stop_editing()
        await self.messages.query(".message").remove()
        client = await self.wait_for_engine()
        self.session.start_over(client.info.name)
        self.post_message(self.Rekeyed(self))

    # ---- the turn -------------------------------------------------------------------

    @work(group="turn", exclusive=True)
    async def _run_turn(self, text: str | None, branch_at: UserMessage | AssistantMessage | None
                        ) -> None:
        """Stream one reply (a regenerate when `text` is None) into the tab; `branch_at` is
        the message the turn branches at (an edited message, a regenerated reply), whose
        view and those after it give way to the turn's.

        The turn's views mount while its request goes out, not before: the request leaves
        in this worker's first run on the event loop, so tabs that send at once (a
        broadcast, the demo) reach the engine together; waiting for the mounts first would
        hold each request back behind every other tab's. The views are awaited before anything is drawn
        into them; a hidden tab's wait until it is shown (a reply keeps its text until then)."""
        messages = self.messages
        views: list[Widget] = []   # the turn's new views
        replaced: AssistantMessage | None = None  # a regenerate's old reply, to show again
        if branch_at is not None:   # the branch from that message on goes
            await self._mount_unshown()
            shown = list(messages.query(".message"))
            if branch_at in shown:
                await messages.remove_children(shown[shown.index(branch_at):])
        elif text is None:  # the last reply (and any error after the last prompt) goes
            await self._mount_unshown()
            shown = list(messages.query(".message"))
            while shown and not isinstance(shown[-1], UserMessage):
                view = shown.pop()
                if isinstance(view, AssistantMessage) and replaced is None:
                    replaced = AssistantMessage(view.text, view.footer, view.reasoning,
                                                view.reasoning_tokens)
                await view.remove()
        if text is not None:
            sent = UserMessage(text)
            views.append(sent)
            if self.title.startswith("Chat ") and self.session.turn is None and not self.session.load():
                self.set_title(chat_title(text))
        reply = AssistantMessage(footer="waiting for the model…")
        views.append(reply)
        mount = self._add_views(*views)
        self.error = None
        try:
            client = await self.wait_for_engine()
            await self.ensure_loaded()
            params = self.sampling_params(self.session.sampling)
            if isinstance(branch_at, UserMessage):
                deltas = self.session.edit(client, branch_at.message_id, text, params,
                                           self.priority)
            elif text is not None:
                deltas = self.session.send(client, text, params, self.priority)
            else:
                deltas = self.session.regenerate(
                    client, params, branch_at.message_id if branch_at is not None else None,
                    self.priority)
            reply.footer = "prefilling…"
            async with aclosing(deltas):
                async for output in deltas:
                    if self._streaming_reply is not reply:
                        await self._shown(mount, reply)
                    # Kept until the app's next frame (`render_frame`); a hidden tab's until it is shown.
                    turn = self.session.turn
                    if turn.reasoning is not None:
                        reply.write_thinking(turn.last.reasoning, turn.reasoning_tokens)
                    reply.write(turn.last.answer)
        except asyncio.CancelledError:  # the tab closed, or Esc before the model was ready
            reply.footer = "stopped"
            self._streaming_reply = None
            self.streaming = False
            raise
        except Exception as error:  # engine errors (step failure, load failure) stay in the tab
            self.error = describe_error(error)
        if self._streaming_reply is not reply:
            await self._shown(mount, reply)
        self._streaming_reply = None
        await reply.finish_stream(render=self.display and not self._unshown)
        turn = self.session.turn
        self.error = self.error or (turn.error if turn is not None else None)
        withdrawn = turn is not None and turn.withdrawn
        if self.error or withdrawn:   # views to add or take back: the kept ones first
            await self._mount_unshown()
        if self.error:
            await messages.mount(ErrorMessage(self.error))
            self.notify(f"{self.title}: {self.error}", severity="error", timeout=8, markup=False)
            if not reply.text:
                await reply.remove()
        if withdrawn:
            # The engine stopped before a word: the turn is not in the chat, so the user's
            # text goes back into the prompt to send again (after F5), or a regenerate's
            # old reply, still the chat's, back on screen; a branch's whole branch.
            if branch_at is not None:
                await self._show_branch()
                if self.error:
                    await messages.mount(ErrorMessage(self.error))
                if text is not None and not self.prompt.text:
                    self.prompt.text = text
            elif text is not None:
                await sent.remove()
                if not self.prompt.text:
                    self.prompt.text = text
            elif replaced is not None:
                if reply.is_attached:
                    await reply.remove()
                await messages.mount(replaced, before=messages.query(ErrorMessage).last()
                                     if self.error else None)
        elif turn is not None and turn.reply_message_id is not None:
            self._show_ids(reply, turn.reply_message_id)
            if text is not None:
                self._show_ids(sent, turn.user_message_id)
        reply.footer = self._footer()
        self.streaming = False
        self.post_message(self.TurnEnded(self))

    def _show_ids(self, view: UserMessage | AssistantMessage, message_id: int) -> None:
        """A turn's view takes its row's id in the store, and shows its version."""
        view.message_id = message_id
        view.show_branch(self.session.branch_of(message_id))

    async def _shown(self, mount: AwaitMount | None, reply: AssistantMessage) -> None:
        """Wait for the turn's views to mount (None: a hidden tab's wait until it is shown);
        the reply then takes the frames."""
        if mount is not None:
            await mount
            self.messages.scroll_end(animate=False)
        self._streaming_reply = reply

    def _footer(self) -> str:
        turn = self.session.turn
        if turn is None:
            return ""
        parts = []
        if turn.ttft_s is not None:
            parts.append(f"ttft {turn.ttft_s:.2f}s")
            parts.append(f"{len(turn.token_ids)} tok · {turn.tokens_per_s:.1f} tok/s")
            cached = "?" if turn.num_cached_tokens is None else turn.num_cached_tokens
            parts.append(f"prompt {len(turn.prompt_ids)} ({cached} cached)")
        if turn.finished:
            parts.append(finish_label(turn.finish_reason) or "done")
            if self.session.unsaved is not None:  # the store refused it: only the screen has it
                parts.append("unsaved")
        return " · ".join(parts)


def _view_of(message, branch: tuple[int, int] | None = None) -> Static | AssistantMessage:
    if message.role == "user":
        return UserMessage(message.content, message.id, branch)
    if message.role == "assistant":
        footer = finish_label(message.finish_reason)
        timings = message.timings or {}
        if timings.get("ttft_s") is not None:
            footer = " · ".join(p for p in (f"ttft {timings['ttft_s']:.2f}s",
                                            f"{timings.get('tokens_per_s', 0):.1f} tok/s",
                                            footer) if p)
        return AssistantMessage(message.content, footer, message.reasoning,
                                timings.get("reasoning_tokens", 0), message_id=message.id,
                                branch=branch)
    return Static(Text(clean(message.content)), classes="message system")
