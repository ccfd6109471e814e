"""ChatSession: one chat's turns through an engine, the same for `paged-chat ask` and for
every TUI tab.

A session owns a chat's Conversation (the exact token ids of its history), its rows in
the chat store and the metrics of its replies. A turn:

    user row and an empty assistant row written   (a kill from here on keeps the turn)
    prompt ids streamed through an EngineClient    (deltas yielded to the caller as they come)
    assistant row updated every SAVE_INTERVAL_S    (a kill keeps what was said so far; written
                                                   on a worker thread, off the caller's loop)
    assistant row finished with its reason         (also when the turn is cancelled: "abort")
    the turn joins the Conversation                (cut or empty, as stored)

A turn the engine refused outright (an error before any token, e.g. a prompt past
max_model_len) stays in the store but out of the context, or every later turn would fail
the same way. A new turn whose engine stopped before its first token (EngineDeadError: the
engine process died, a step failed) is withdrawn instead: its rows leave the store and
`turn.withdrawn` tells the front end to give the user's text back, so no empty reply is
ever kept for a turn that never ran; a regenerate withdrawn so leaves the reply it was to
replace as it was. A store that fails mid-reply (disk full, the chat deleted elsewhere) costs
one warning: the reply goes on, and is saved when the store takes it again. A chat that
another writer added to since the session last saw it refuses the new turn
(ChatMovedOn) rather than interleave two conversations.

The session knows nothing of widgets or terminals: callers render the deltas it yields
and read `turn` for the numbers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paged_chat.app.chat_store import StoreError, StoreWriteError, new_chat
from paged_chat.app.conversation import Conversation
from paged_chat.app.text import sanitize_for_terminal
from paged_chat.engine.core.errors import EngineDeadError, PagedChatError, describe_error

if TYPE_CHECKING:
    from paged_chat.app.chat_store import ChatStore, Message, StoredChat
    from paged_chat.engine import EngineClient, RequestOutput, SamplingParams

SAVE_INTERVAL_S = 0.5   # how often a streaming reply is written to the store
TITLE_LENGTH = 60


def chat_title(text: str) -> str:
    """A chat's title from what was asked: its first non-blank line, spaces collapsed,
    shortened to TITLE_LENGTH characters. Sanitized before it is cut, so a title holds no
    escape sequence, whole or cut open, wherever it is printed."""
    first = next((line for line in sanitize_for_terminal(text).splitlines() if line.strip()), "")
    words = " ".join(first.split())
    return words if len(words) <= TITLE_LENGTH else words[:TITLE_LENGTH - 1].rstrip() + "…"


@dataclass(slots=True, eq=False)
class Turn:
    """One reply as it streams: what it answers, what came back so far, and when."""

    user_text: str
    prompt_ids: list[int]
    request_id: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int | None = 0  # prompt tokens whose KV was cached; None: the server did not say
    num_tier_cached_tokens: int = 0    # of those, read back from the KV tier (RAM or disk)
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    withdrawn: bool = False            # taken back whole: its engine stopped before a word

    def add(self, output: RequestOutput, now: float) -> None:
        if output.new_token_ids and self.first_token_at is None:
            self.first_token_at = now
        # An engine knows these from the prefill on; a remote server may tell them at the end.
        if output.num_cached_tokens is not None or output.finished:
            self.num_cached_tokens = (None if output.num_cached_tokens is None
                                      else max(self.num_cached_tokens or 0, output.num_cached_tokens))
        self.num_tier_cached_tokens = max(self.num_tier_cached_tokens, output.num_tier_cached_tokens)
        self.text = output.text
        if output.finished:
            self.token_ids = list(output.token_ids)
            self.finish(output.finish_reason, output.error, now)
        else:  # an engine's list grows on after this delta: keep only what goes with its text
            self.token_ids += output.new_token_ids

    def finish(self, reason: str | None, error: str | None, now: float) -> None:
        self.finished_at = now
        self.finish_reason, self.error = reason, error

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    @property
    def live_ids(self) -> list[int]:
        """Prompt and reply ids so far: the tokens the turn's blocks hold."""
        return self.prompt_ids + self.token_ids

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def tokens_per_s(self) -> float:
        """Generation speed after the first token."""
        end = self.finished_at or time.perf_counter()
        if self.first_token_at is None or len(self.token_ids) < 2 or end <= self.first_token_at:
            return 0.0
        return (len(self.token_ids) - 1) / (end - self.first_token_at)

    def timings(self) -> dict[str, Any]:
        """What the store keeps with the reply, and `ask --json` prints."""
        end = self.finished_at or time.perf_counter()
        ttft = self.ttft_s
        return {"ttft_s": None if ttft is None else round(ttft, 3),
                "total_s": round(end - self.submitted_at, 3),
                "tokens_per_s": round(self.tokens_per_s, 1),
                "prompt_tokens": len(self.prompt_ids), "cached_tokens": self.num_cached_tokens,
                "tier_cached_tokens": self.num_tier_cached_tokens}


class ChatSession:
    """One chat: its Conversation, its rows in the store (when it has one) and its turns.

    `store` and `chat` are None for a chat that is not kept (`ask --no-save`, `--file`).
    A chat listed without its messages (a TUI tab restored lazily) passes loaded=False and
    reads them on `load()` or its first turn; a chat not yet in the store (`new_chat`)
    passes in_store=False and is written with its first turn; the Conversation is built from them on the
    first turn, when the engine's tokenizer is at hand.
    """

    def __init__(self, store: ChatStore | None = None, chat: StoredChat | None = None, *,
                 loaded: bool = True, in_store: bool = True, system_prompt: str | None = None,
                 conversation: Conversation | None = None,
                 on_warning: Callable[[str], None] | None = None) -> None:
        assert (store is None) == (chat is None), "a kept chat needs both a store and a chat"
        self.store = store
        self.chat = chat
        self.system_prompt = chat.system_prompt if chat is not None else system_prompt
        self.sampling: dict[str, Any] = dict(chat.sampling or {}) if chat is not None else {}
        self.conversation = conversation
        self.turn: Turn | None = None
        self.on_warning = on_warning or (lambda message: None)
        self._client: EngineClient | None = None
        self._reply_id: int | None = None
        self._turn_base: Conversation | None = None   # the conversation before the last turn
        self._turns = 0
        self._save_failed = False   # this turn's store trouble was reported (once a turn)
        # Why the reply is not in the store as it stands (its last save failed: a full disk,
        # a read-only store); None when its last save succeeded. After a turn, non-None
        # means the front end holds the only copy of the reply.
        self.unsaved: Exception | None = None
        self._loaded = loaded
        self._chat_in_store = in_store   # False: a `new_chat`, written with its first turn
        self._turn_created_chat = False  # the last turn's rows wrote the chat itself
        self._last_message_id = chat.messages[-1].id if chat is not None and chat.messages else 0
        # (last message id, reply id) before this turn's rows and the id of its first row:
        # what a withdrawn turn goes back to; None while the turn wrote no rows.
        self._rows_before: tuple[int, int | None, int] | None = None

    def load(self) -> list[Message]:
        """The chat's stored messages, read once from the store."""
        if self.chat is None:
            return []
        if not self._loaded:
            self._loaded = True
            self.chat = self.store.get_chat(self.chat.id)
            self.system_prompt, self.sampling = self.chat.system_prompt, dict(self.chat.sampling or {})
            self._last_message_id = self.chat.messages[-1].id if self.chat.messages else 0
        return self.chat.messages

    # ---- the chat ---------------------------------------------------------------------

    @property
    def chat_id(self) -> str | None:
        return self.chat.id if self.chat is not None else None

    @property
    def in_store(self) -> bool:
        """Whether the chat is in the store (a `new_chat` is once its first turn is saved)."""
        return self.chat is not None and self._chat_in_store

    @property
    def title(self) -> str:
        return self.chat.title if self.chat is not None else ""

    @property
    def streaming(self) -> bool:
        return self.turn is not None and not self.turn.finished

    @property
    def last_user_text(self) -> str | None:
        """What the last turn asked (a regenerate asks it again)."""
        if self.turn is not None:
            return self.turn.user_text
        users = [m for m in self.load() if m.role == "user"]
        return users[-1].content if users else None

    def rename(self, title: str) -> None:
        if self.in_store:
            self.store.rename_chat(self.chat.id, title)
        if self.chat is not None:
            self.chat.title = title

    def update_settings(self, system_prompt: str | None, sampling: dict[str, Any]) -> bool:
        """A new system prompt and sampling. A changed system prompt starts a fresh context
        (the next prompt is encoded in full); True when that happened to a chat with history."""
        restarted = False
        if system_prompt != self.system_prompt and self.conversation is not None:
            restarted = bool(self.conversation.token_ids)
            self.conversation = Conversation(self.conversation.tokenizer,
                                             self.conversation.chat_template, system_prompt,
                                             messages=list(self.conversation.messages))
        self.system_prompt, self.sampling = system_prompt, dict(sampling)
        if self.in_store:
            self.store.update_chat_settings(self.chat.id, system_prompt, self.sampling)
        if self.chat is not None:
            self.chat.system_prompt, self.chat.sampling = system_prompt, dict(sampling)
        return restarted

    def fork(self, title: str) -> ChatSession:
        """A copy of this chat (in the store too, once this one is) whose next prompt
        shares every full KV block of this one's history."""
        assert self.chat is not None and not self.streaming
        if not self.in_store:
            return ChatSession(self.store, new_chat(title, self.chat.model, self.system_prompt,
                                                    self.sampling),
                               in_store=False, on_warning=self.on_warning)
        chat = self.store.fork_chat(self.chat.id, title)
        conversation = _copy(self.conversation) if self.conversation is not None else None
        return ChatSession(self.store, chat, conversation=conversation, on_warning=self.on_warning)

    def start_over(self, model: str) -> None:
        """Forget the conversation and go on in a new chat with the same settings (the
        old one stays in the store; the new one is written with its first turn)."""
        assert not self.streaming
        self.conversation = self._turn_base = self.turn = None
        if self.chat is not None:
            self.chat = new_chat(self.chat.title, model, self.system_prompt, self.sampling)
            self._chat_in_store = False
            self._last_message_id = 0

    # ---- turns ------------------------------------------------------------------------

    def send(self, client: EngineClient, text: str, params: SamplingParams
             ) -> AsyncIterator[RequestOutput]:
        """Ask `text`; yield the reply's deltas as the engine produces them. Close the
        iterator (contextlib.aclosing) if you stop early: that aborts and saves the turn."""
        self.load()
        base = _copy(self._conversation(client))
        return self._run(client, base, text, params, regenerate=False)

    def regenerate(self, client: EngineClient, params: SamplingParams
                   ) -> AsyncIterator[RequestOutput]:
        """Ask the last question again; the new reply replaces the last one."""
        self.load()
        text = self.last_user_text
        base = self._regenerate_base(client)
        if text is None or base is None:
            raise PagedChatError("nothing to regenerate yet")
        return self._run(client, base, text, params, regenerate=True)

    def stop(self) -> bool:
        """Stop the streaming reply (its blocks go back to the pool); True if one was."""
        if not self.streaming or self._client is None:
            return False
        self._client.abort(self.turn.request_id)
        return True

    async def _run(self, client: EngineClient, base: Conversation, text: str,
                   params: SamplingParams, regenerate: bool) -> AsyncIterator[RequestOutput]:
        working = _copy(base)
        prompt_ids = working.next_prompt_ids(text)
        self._turns += 1
        request_id = f"{self.chat.id}/{self._turns}" if self.chat is not None else None
        self.turn = turn = Turn(text, prompt_ids, request_id)
        self._save_failed = False
        self.unsaved = None
        try:
            self._start_rows(base, prompt_ids, regenerate)
        except BaseException:
            turn.finish("error", None, time.perf_counter())
            raise
        self._turn_base = base
        self._client = client
        saved_at = time.monotonic()
        try:
            async with aclosing(client.stream(prompt_ids, params, request_id=request_id,
                                              owner=self.chat_id)) as stream:
                async for output in stream:
                    turn.add(output, time.perf_counter())
                    # Not before the first token: a regenerate's reply row still holds the
                    # reply it replaces, which a withdrawn turn leaves as it was.
                    if (turn.token_ids and not turn.finished
                            and time.monotonic() - saved_at >= SAVE_INTERVAL_S):
                        saved_at = time.monotonic()
                        # Off the loop, which a UI's keys and frames share; awaited, so the
                        # turn is not changed under the write.
                        await asyncio.to_thread(self._save_reply, turn, False)
                    yield output
        except BaseException as error:  # cancelled (a closed tab, Ctrl+C) or the engine failed
            reason = "error" if isinstance(error, Exception) else "abort"
            turn.finish(reason, describe_error(error) if reason == "error" else None,
                        time.perf_counter())
            turn.withdrawn = isinstance(error, EngineDeadError) and not turn.token_ids
            raise
        finally:
            if not turn.finished:  # the caller stopped reading: the stream aborted the request
                turn.finish("abort", None, time.perf_counter())
            self._client = None
            if turn.withdrawn:
                self._withdraw_rows()
            else:
                self._end_turn(working, turn)

    def _start_rows(self, base: Conversation, prompt_ids: list[int], regenerate: bool) -> None:
        """The turn's rows before the first token, all or none: a kill from here on keeps
        the turn. A regenerate writes its reply over the last one, from its first save on.
        A store that cannot take them (a full disk) costs a warning: the turn runs
        unsaved (`unsaved` says why) and the store keeps no part of it."""
        self._rows_before = None
        if self.chat is None:
            return
        if regenerate and self._reply_id is not None:
            return
        before = (self._last_message_id, self._reply_id)
        self._turn_created_chat = not self._chat_in_store
        try:
            user = None if regenerate else (self.turn.user_text, base.added_ids(prompt_ids))
            first_id, reply_id = self.store.start_turn(self.chat, user, after=self._last_message_id,
                                                       create=self._turn_created_chat)
        except StoreWriteError as error:
            self._reply_id = None   # its saves would land on the last turn's reply
            self.unsaved = error
            self._save_failed = True
            self.on_warning(f"the turn could not be saved ({error}); it goes on unsaved")
            return
        self._chat_in_store = True
        self._reply_id = reply_id
        self._rows_before = (*before, first_id if first_id is not None else reply_id)
        self._last_message_id = reply_id

    def _withdraw_rows(self) -> None:
        """Take the turn's rows back out of the store, as if it was never sent."""
        if self._rows_before is None:  # no rows were written (no store)
            return
        last_message_id, reply_id, first_id = self._rows_before
        try:
            if self._turn_created_chat:  # the chat goes too: no empty chat is kept
                self.store.delete_chat(self.chat.id)
            else:
                self.store.delete_messages_from(self.chat.id, first_id)
        except (StoreError, sqlite3.Error) as error:
            self.on_warning(f"the failed turn could not be taken out of the chat ({error})")
            return
        self._chat_in_store = not self._turn_created_chat
        self._last_message_id, self._reply_id = last_message_id, reply_id

    def _end_turn(self, working: Conversation, turn: Turn) -> None:
        refused = turn.finish_reason == "error" and not turn.token_ids
        if not refused:
            working.add_reply(turn.prompt_ids, turn.token_ids, turn.text)
            self.conversation = working
        self._save_reply(turn, final=True)

    def _save_reply(self, turn: Turn, final: bool) -> None:
        """Write the reply so far; a store that fails is one warning, never the reply's end
        (the next save tries again)."""
        if self._reply_id is None:
            return
        timings = {**turn.timings(), **({"error": turn.error} if turn.error else {})}
        try:
            self.store.update_message(self._reply_id, turn.text, turn.token_ids,
                                      turn.finish_reason if final else None,
                                      timings if final else None)
            self.unsaved = None
        except (StoreError, sqlite3.Error) as error:
            self.unsaved = error
            if not self._save_failed:
                self._save_failed = True
                self.on_warning(f"the reply could not be saved ({error})"
                                + ("" if final else "; it goes on and is saved when it can be"))

    def _conversation(self, client: EngineClient) -> Conversation:
        if self.conversation is None:
            info = client.info
            if self.chat is not None and self.chat.messages:
                self.conversation = Conversation.from_chat(self.chat, info.tokenizer,
                                                           info.chat_template)
            else:
                self.conversation = Conversation(info.tokenizer, info.chat_template,
                                                 self.system_prompt)
        return self.conversation

    def _regenerate_base(self, client: EngineClient) -> Conversation | None:
        """The conversation as it was before the last user turn."""
        if self._turn_base is not None:
            return _copy(self._turn_base)
        if self.chat is None:
            return None
        messages = list(self.chat.messages)
        while messages and messages[-1].role != "user":
            dropped = messages.pop()
            if dropped.role == "assistant" and self._reply_id is None:
                self._reply_id = dropped.id
        if not messages:
            return None
        info = client.info
        earlier = dataclasses.replace(self.chat, messages=messages[:-1])
        if not earlier.messages:
            return Conversation(info.tokenizer, info.chat_template, self.system_prompt)
        return Conversation.from_chat(earlier, info.tokenizer, info.chat_template)


def _copy(conversation: Conversation) -> Conversation:
    return dataclasses.replace(conversation, messages=list(conversation.messages),
                               token_ids=list(conversation.token_ids))
