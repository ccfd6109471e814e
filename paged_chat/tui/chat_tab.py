"""One chat tab: its messages, its prompt input, its Conversation and its streaming worker.

The worker consumes `AsyncEngine.stream()` on the app's event loop (the engine thread hands
over one batch of deltas per step, never one call per token), writes the reply into a
MarkdownStream, and saves it to the chat store every ~0.5 s and at the end. The first
message the user sends is shown at once; if the model is still loading, the turn waits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.text import Text
from textual import events, on, work
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.markup import escape
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Button, Static, TabPane

from paged_chat.chat import Conversation
from paged_chat.engine.errors import PagedChatError
from paged_chat.text import sanitize_for_terminal as clean
from paged_chat.tui.block_map import TAB_COLOURS
from paged_chat.tui.messages import AssistantMessage, ErrorMessage, UserMessage, code_blocks
from paged_chat.tui.prompt_input import PromptInput

if TYPE_CHECKING:
    from paged_chat.tui.app import PagedChatApp

SAVE_EVERY_S = 0.5     # how often a streaming reply is written to the store
LABEL_EVERY_S = 0.5    # how often the reply's footer (TTFT, tokens/s) refreshes
MOUNT_AT_ONCE = 30     # messages mounted when a chat opens; older ones on demand


@dataclasses.dataclass(slots=True)
class TurnMetrics:
    ttft_s: float | None = None
    tokens: int = 0
    tokens_per_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def as_timings(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft_s, "tokens_per_s": round(self.tokens_per_s, 2),
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens}


def copy_conversation(conversation: Conversation) -> Conversation:
    return dataclasses.replace(conversation, messages=list(conversation.messages),
                               token_ids=list(conversation.token_ids))


class ChatTab(TabPane):
    """A tab pane holding one chat. `chat_id` doubles as the engine `owner` tag."""

    streaming: reactive[bool] = reactive(False)

    class Changed(Message):
        """The tab's header (title, streaming state, metrics) needs redrawing."""

        def __init__(self, tab: "ChatTab") -> None:
            super().__init__()
            self.tab = tab

    def __init__(self, chat_id: str, title: str, colour: int, *, system_prompt: str | None = None,
                 sampling: dict | None = None, conversation: Conversation | None = None,
                 loaded: bool = False, autopilot: Any = None) -> None:
        super().__init__(title)
        self.chat_id = chat_id
        self.title = title
        self.colour = colour
        self.system_prompt = system_prompt
        self.sampling: dict = dict(sampling or {})
        self.conversation = conversation
        self.autopilot = autopilot
        self.metrics = TurnMetrics()
        self.error: str | None = None
        self.request_id: str | None = None
        self.live_ids: list[int] = []          # prompt + reply ids of the live request
        self._loaded = loaded
        self._record = None                    # the store's Chat, until the conversation exists
        self._earlier: list = []               # stored messages not mounted yet
        self._turn_base: Conversation | None = None   # the conversation before the last turn
        self._last_user: str | None = None
        self._last_assistant_id: str | None = None
        self._turn = 0
        self._user_titled = False

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

    async def on_show(self) -> None:
        """Replies that finished while the tab was hidden get their final render now."""
        for reply in self.query(AssistantMessage):
            await reply.catch_up()

    def _on_descendant_focus(self, event: events.DescendantFocus) -> None:
        """TabPane switches the tabs to a pane whose widget gets the focus; a stale
        programmatic focus landing in a hidden tab (one the user just left) must not
        switch back to it."""
        event.prevent_default()  # instead of TabPane's handler
        if self.display:
            self.post_message(self.Focused(self))

    def _info_text(self) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append("█ ", style=TAB_COLOURS[self.colour % len(TAB_COLOURS)])
        system = clean((self.system_prompt or "").replace("\n", " "))
        text.append(f"system: {system[:60] + '…' if len(system) > 60 else system or '(none)'}")
        if self.sampling:
            text.append("  ·  " + ", ".join(f"{k} {v}" for k, v in sorted(self.sampling.items())),
                        style="dim")
        return text

    def refresh_info(self) -> None:
        self.query_one(".chat-info", Static).update(self._info_text())

    def label(self) -> str:
        """The tab header: colour swatch, title, streaming dot, TTFT and tokens/s."""
        colour = TAB_COLOURS[self.colour % len(TAB_COLOURS)]
        label = f"[{colour}]█[/] {escape(clean(self.title))}"
        if self.streaming:
            label += " [b]●[/b]"
        if self.metrics.ttft_s is not None:
            label += f" [dim]{self.metrics.ttft_s:.2f}s {self.metrics.tokens_per_s:.0f}t/s[/dim]"
        return label

    def watch_streaming(self) -> None:
        self.post_message(self.Changed(self))

    def set_title(self, title: str) -> None:
        self.title = title
        self.post_message(self.Changed(self))

    # ---- lazy loading from the store --------------------------------------------------

    async def ensure_loaded(self) -> None:
        """Mount the stored chat's latest messages (once); older ones on demand."""
        if self._loaded:
            return
        self._loaded = True
        store = self.chat_app.store
        if store is None:
            return
        chat = store.get_chat(self.chat_id)
        self._record = chat
        self.system_prompt, self.sampling = chat.system_prompt, dict(chat.sampling or {})
        self.refresh_info()
        messages = list(chat.messages)
        self.prompt.prompt_history = [m.content for m in messages if m.role == "user"]
        users = [m for m in messages if m.role == "user"]
        self._last_user = users[-1].content if users else None
        if messages and messages[-1].role == "assistant":
            self._last_assistant_id = messages[-1].id
        self._earlier, recent = messages[:-MOUNT_AT_ONCE], messages[-MOUNT_AT_ONCE:]
        await self.messages.mount_all([_view_of(m) for m in recent])
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
        await self.messages.mount_all([_view_of(m) for m in batch], after=button)
        self._show_earlier_button()

    def _ensure_conversation(self, engine) -> Conversation:
        if self.conversation is None:
            if self._record is not None and self._record.messages:
                self.conversation = Conversation.from_chat(
                    self._record, engine.tokenizer, engine.engine.chat_template)
            else:
                self.conversation = Conversation(engine.tokenizer, engine.engine.chat_template,
                                                 self.system_prompt)
        return self.conversation

    def _regenerate_base(self, engine) -> Conversation | None:
        """The conversation as it was before the last user turn."""
        if self._turn_base is not None:
            return copy_conversation(self._turn_base)
        record = self._record
        if record is None:
            return None
        messages = list(record.messages)
        while messages and messages[-1].role != "user":
            messages.pop()
        if not messages:
            return None
        earlier = dataclasses.replace(record, messages=messages[:-1])
        if not earlier.messages:
            return Conversation(engine.tokenizer, engine.engine.chat_template, self.system_prompt)
        return Conversation.from_chat(earlier, engine.tokenizer, engine.engine.chat_template)

    # ---- the public actions -----------------------------------------------------------

    @property
    def chat_app(self) -> "PagedChatApp":
        return self.app  # type: ignore[return-value]

    def tokens_of(self, request_id: str) -> Sequence[int] | None:
        """Token ids (prompt + reply so far) of this tab's live request, for the block map."""
        return self.live_ids if request_id == self.request_id else None

    @on(PromptInput.Submitted)
    def _on_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        if self.send(event.text):
            event.prompt.remember(event.text)

    def send(self, text: str) -> bool:
        """Start a turn with `text`; False (and a notice) while a reply is streaming."""
        if self.streaming:
            self.notify("a reply is still streaming: Esc stops it", severity="warning", markup=False)
            return False
        self.streaming = True
        self._run_turn(text, regenerate=False)
        return True

    def regenerate(self) -> bool:
        if self.streaming:
            self.notify("a reply is still streaming: Esc stops it", severity="warning", markup=False)
            return False
        if self._last_user is None:
            self.notify("nothing to regenerate yet", severity="warning", markup=False)
            return False
        self.streaming = True
        self._run_turn(self._last_user, regenerate=True)
        return True

    def stop(self) -> bool:
        """Stop the streaming reply (its blocks go back to the pool); True if one was."""
        if self.autopilot is not None:
            self.autopilot.paused = True
        if not self.streaming:
            return False
        engine = self.chat_app.engine
        if self.request_id is not None and engine is not None:
            engine.abort(self.request_id)
        else:  # still waiting for the model: drop the turn
            self.workers.cancel_group(self, "turn")
        return True

    def last_reply(self) -> str | None:
        replies = list(self.query(AssistantMessage))
        return replies[-1].text if replies else None

    def code_blocks(self) -> list[str]:
        return [block for reply in self.query(AssistantMessage) for block in code_blocks(reply.text)]

    def apply_settings(self, system_prompt: str | None, sampling: dict) -> None:
        """New system prompt and sampling; a new system prompt starts a new context."""
        if system_prompt != self.system_prompt and self.conversation is not None:
            self.conversation = dataclasses.replace(self.conversation, system_prompt=system_prompt)
            if self.conversation.token_ids:
                self.notify("the new system prompt applies from a fresh context "
                            "(the next prompt is encoded in full)", markup=False)
                self.conversation = Conversation(self.conversation.tokenizer,
                                                 self.conversation.chat_template, system_prompt,
                                                 messages=list(self.conversation.messages))
        self.system_prompt, self.sampling = system_prompt, dict(sampling)
        if self.chat_app.store is not None:
            self.chat_app.store.update_chat_settings(self.chat_id, system_prompt, self.sampling)
        self.refresh_info()

    async def clear_chat(self) -> None:
        """Forget the conversation (used by the demo to start over in the same tab)."""
        await self.messages.query(".message").remove()
        self.conversation = None
        self._record = None
        self._turn_base = None
        self._last_user = None
        self._last_assistant_id = None
        store = self.chat_app.store
        if store is not None:
            chat = store.create_chat(self.title, self.chat_app.model_name, self.system_prompt,
                                     self.sampling)
            self.chat_app.rekey_tab(self, chat.id)

    # ---- the turn -------------------------------------------------------------------

    @work(group="turn", exclusive=True)
    async def _run_turn(self, text: str, regenerate: bool) -> None:
        messages = self.messages
        if regenerate:  # the last reply (and any error after the last prompt) goes
            views = list(messages.query(".message"))
            while views and not isinstance(views[-1], UserMessage):
                await views.pop().remove()
        else:
            await messages.mount(UserMessage(text))
            if not self._user_titled and self.title.startswith("Chat "):
                self._user_titled = True
                self._auto_title(text)
        reply = AssistantMessage(footer="waiting for the model…")
        await messages.mount(reply)
        messages.scroll_end(animate=False)
        app = self.chat_app
        store = app.store
        self.metrics = TurnMetrics()
        self.error = None
        text_out, reply_ids, reason, error = "", [], None, None
        message_id = working = None
        first_at = 0.0
        try:
            engine = await app.wait_for_engine()
            await self.ensure_loaded()
            if regenerate:
                base = self._regenerate_base(engine)
                if base is None:
                    raise PagedChatError("nothing to regenerate")
            else:
                base = copy_conversation(self._ensure_conversation(engine))
            self._turn_base = base
            working = copy_conversation(base)
            prompt_ids = working.next_prompt_ids(text)
            if store is not None:
                if not regenerate:
                    store.add_message(self.chat_id, "user", text, base.added_ids(prompt_ids))
                    message_id = store.add_message(self.chat_id, "assistant", "", []).id
                elif self._last_assistant_id is not None:
                    message_id = self._last_assistant_id
                    store.update_message(message_id, "", [], None)
                else:
                    message_id = store.add_message(self.chat_id, "assistant", "", []).id
            self._last_assistant_id = message_id
            self._last_user = text
            self._turn += 1
            self.request_id = f"{self.chat_id}/{self._turn}"
            self.live_ids = list(prompt_ids)
            params = app.sampling_params(self.sampling)
            reply.footer = "prefilling…"
            started = time.perf_counter()
            saved = label_at = started
            async for out in engine.stream(prompt_ids, params, request_id=self.request_id,
                                           owner=self.chat_id):
                now = time.perf_counter()
                if out.new_token_ids:
                    if self.metrics.ttft_s is None:
                        self.metrics.ttft_s = now - started
                        self.metrics.prompt_tokens = out.num_prompt_tokens
                        self.metrics.cached_tokens = out.num_cached_tokens
                        first_at = now
                    reply_ids.extend(out.new_token_ids)
                    self.live_ids.extend(out.new_token_ids)
                    self.metrics.tokens = len(reply_ids)
                    if now > first_at:
                        self.metrics.tokens_per_s = (len(reply_ids) - 1) / (now - first_at)
                # A hidden tab only buffers: its Markdown catches up when it is shown.
                await reply.write(out.new_text, render=self.display)
                text_out += out.new_text
                if out.finished:
                    reason, error = out.finish_reason, out.error
                if now - label_at >= LABEL_EVERY_S:  # the tab header: the app's timer
                    label_at = now
                    reply.footer = self._footer(streaming=True)
                if message_id is not None and now - saved >= SAVE_EVERY_S:
                    saved = now
                    store.update_message(message_id, text_out, reply_ids, None)
        except asyncio.CancelledError:  # the tab closed, or Esc before the model was ready
            reply.footer = "stopped"
            if working is not None:
                working.add_reply(prompt_ids, reply_ids, text_out)
                self.conversation = working
            self._finish_turn(store, message_id, text_out, reply_ids, "abort", None)
            raise
        except Exception as exc:  # engine errors (step failure, load failure) stay in the tab
            reason = "error"
            error = str(exc) if isinstance(exc, PagedChatError) else f"{type(exc).__name__}: {exc}"
        await reply.finish_stream(render=self.display)
        # The turn joins the context, even cut or empty, as stored; a turn the engine refused
        # outright (a prompt past max_model_len) stays out, or every later turn would fail too.
        if working is not None and not (reason == "error" and not reply_ids):
            working.add_reply(prompt_ids, reply_ids, text_out)
            self.conversation = working
        if error:
            self.error = error
            await messages.mount(ErrorMessage(error))
            self.notify(f"{self.title}: {error}", severity="error", timeout=8, markup=False)
        if not reply.text and reason == "error":
            await reply.remove()
        reply.footer = self._footer(streaming=False, reason=reason)
        self._finish_turn(store, message_id, text_out, reply_ids, reason, error)
        self.post_message(self.Changed(self))
        if self.autopilot is not None:
            self.autopilot.turn_done(self)

    def _finish_turn(self, store, message_id, text_out, reply_ids, reason, error) -> None:
        self.request_id = None
        self.live_ids = []
        if store is not None and message_id is not None:
            timings = self.metrics.as_timings()
            if error:
                timings["error"] = error
            store.update_message(message_id, text_out, reply_ids, reason or "abort", timings)
        self.streaming = False

    def _footer(self, streaming: bool, reason: str | None = None) -> str:
        m = self.metrics
        parts = []
        if m.ttft_s is not None:
            parts.append(f"ttft {m.ttft_s:.2f}s")
            parts.append(f"{m.tokens} tok · {m.tokens_per_s:.1f} tok/s")
            if m.prompt_tokens:
                parts.append(f"prompt {m.prompt_tokens} ({m.cached_tokens} cached)")
        if not streaming and reason:
            parts.append({"stop": "done", "length": "max tokens", "abort": "stopped",
                          "error": "error"}.get(reason, reason))
        return " · ".join(parts)

    def _auto_title(self, text: str) -> None:
        words = " ".join(text.split())
        title = words[:24] + ("…" if len(words) > 24 else "")
        if title:
            self.set_title(title)
            if self.chat_app.store is not None:
                self.chat_app.store.rename_chat(self.chat_id, title)


def pane_id(chat_id: str) -> str:
    """A CSS-safe widget id for a chat id."""
    return "chat-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in str(chat_id))


def _view_of(message) -> Static | AssistantMessage:
    if message.role == "user":
        return UserMessage(message.content)
    if message.role == "assistant":
        footer = {None: "interrupted", "abort": "stopped", "length": "max tokens",
                  "stop": "", "error": "error"}.get(message.finish_reason, message.finish_reason)
        timings = message.timings or {}
        if timings.get("ttft_s") is not None:
            footer = " · ".join(p for p in (f"ttft {timings['ttft_s']:.2f}s",
                                            f"{timings.get('tokens_per_s', 0):.1f} tok/s",
                                            footer) if p)
        return AssistantMessage(message.content, footer=footer)
    return Static(Text(clean(message.content)), classes="message system")
