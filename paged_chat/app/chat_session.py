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

Branches. An edit of an earlier user message, or a regenerate of any reply, branches the
chat there: the new turn's prompt is the stored ids of the branch up to that message plus
the new turn (so the engine's prefix cache holds all of it), its rows hang under that
message's parent in the store, and the branch it replaces stays (`switch_branch` goes
back to it). `chat.messages` is the branch the session is on, with the store's ids.

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
from paged_chat.app.conversation import Conversation, switches_thinking
from paged_chat.app.reasoning import ReasoningSplitter, SplitText, opens_thinking
from paged_chat.app.text import sanitize_for_terminal
from paged_chat.engine.core.errors import EngineDeadError, PagedChatError, describe_error

if TYPE_CHECKING:
    from paged_chat.app.chat_store import ChatStore, Message, StoredChat
    from paged_chat.engine import EngineClient, RequestOutput, SamplingParams

SAVE_INTERVAL_S = 0.5   # how often a streaming reply is written to the store
_PROMPT_END_IDS = 8     # a prompt's last ids, enough to hold a generation prompt's <think>
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
    """One reply as it streams: what it answers, what came back so far, and when.

    `text` is the answer; a reasoning model's thinking is apart in `reasoning` (None while
    the reply has none) and `reasoning_tokens` counts its tokens; `last` is what the
    latest output added to each. `in_thinking`: the prompt opened the thinking (R1)."""

    user_text: str
    prompt_ids: list[int]
    request_id: str | None = None
    in_thinking: bool = False
    text: str = ""
    reasoning_tokens: int = 0
    last: SplitText = field(default_factory=SplitText)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int | None = 0  # prompt tokens whose KV was cached; None: the server did not say
    num_tier_cached_tokens: int = 0    # of those, read back from the KV tier (RAM or disk)
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    withdrawn: bool = False            # taken back whole: its engine stopped before a word
    priority: int = 0                  # its request's in the engine (the lower served first)
    user_message_id: int | None = None   # the turn's rows in the chat store (None: not there;
    reply_message_id: int | None = None  # a regenerate has no user row of its own)
    _splitter: ReasoningSplitter = field(init=False)

    def __post_init__(self) -> None:
        self._splitter = ReasoningSplitter(self.in_thinking)

    @property
    def reasoning(self) -> str | None:
        return self._splitter.reasoning if self._splitter.opened else None

    def add(self, output: RequestOutput, now: float) -> None:
        if output.new_token_ids and self.first_token_at is None:
            self.first_token_at = now
        # An engine knows these from the prefill on; a remote server may tell them at the end.
        if output.num_cached_tokens is not None or output.finished:
            self.num_cached_tokens = (None if output.num_cached_tokens is None
                                      else max(self.num_cached_tokens or 0, output.num_cached_tokens))
        self.num_tier_cached_tokens = max(self.num_tier_cached_tokens, output.num_tier_cached_tokens)
        was_thinking = self._splitter.thinking
        split = self._splitter.feed(output.new_text)
        if self._splitter.opened and (was_thinking or self._splitter.thinking):
            self.reasoning_tokens += len(output.new_token_ids)
        if output.finished:
            rest = self._splitter.finish()
            split = SplitText(split.reasoning + rest.reasoning, split.answer + rest.answer)
        self.last = split
        self.text = self._splitter.answer
        if output.finished:
            self.token_ids = list(output.token_ids)
            self.finish(output.finish_reason, output.error, now)
        else:  # an engine's list grows on after this delta: keep only what goes with its text
            self.token_ids += output.new_token_ids

    def finish(self, reason: str | None, error: str | None, now: float) -> None:
        self._splitter.finish()   # what it held back is the reply's too
        self.text = self._splitter.answer
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
                "tier_cached_tokens": self.num_tier_cached_tokens,
                **({"reasoning_tokens": self.reasoning_tokens} if self.reasoning is not None else {})}


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
                 conversation: Conversation | None = None, thinking: bool | None = None,
                 on_warning: Callable[[str], None] | None = None) -> None:
        assert (store is None) == (chat is None), "a kept chat needs both a store and a chat"
        self.store = store
        self.chat = chat
        self.system_prompt = chat.system_prompt if chat is not None else system_prompt
        self.sampling: dict[str, Any] = dict(chat.sampling or {}) if chat is not None else {}
        # Whether the model thinks, where its template can say (None: as the template has it).
        self.thinking = chat.thinking if chat is not None else thinking
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
        # (the leaf before this turn's rows, the id of its first row): what a withdrawn turn
        # goes back to; None while the turn wrote no rows.
        self._rows_before: tuple[int, int] | None = None
        self._turn_stored = False   # the last turn's rows are in the store

    def load(self) -> list[Message]:
        """The chat's stored messages, read once from the store."""
        if self.chat is None:
            return []
        if not self._loaded:
            self._loaded = True
            self.chat = self.store.get_chat(self.chat.id)
            self.system_prompt, self.sampling = self.chat.system_prompt, dict(self.chat.sampling or {})
            self.thinking = self.chat.thinking
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

    @staticmethod
    def can_switch_thinking(client: EngineClient) -> bool:
        """Whether the model's template turns its thinking on and off."""
        return switches_thinking(client.info.chat_template or "")

    def set_thinking(self, thinking: bool | None) -> None:
        """Turn the model's thinking on or off for this chat's next turns (None: as the
        template has it). Earlier turns keep their ids, so the prefix cache still holds."""
        self.thinking = thinking
        if self.chat is not None:
            if self.in_store:
                self.store.set_thinking(self.chat.id, thinking)
            self.chat.thinking = thinking

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

    def send(self, client: EngineClient, text: str, params: SamplingParams, priority: int = 0
             ) -> AsyncIterator[RequestOutput]:
        """Ask `text`; yield the reply's deltas as the engine produces them. Close the
        iterator (contextlib.aclosing) if you stop early: that aborts and saves the turn.
        `priority`: the request's in the engine (EngineClient.stream)."""
        self.load()
        base = _copy(self._conversation(client))
        return self._run(client, base, text, params, priority, regenerate=False,
                         parent=self._last_message_id or None)

    def edit(self, client: EngineClient, message_id: int, text: str, params: SamplingParams,
             priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Branch the chat at its user message `message_id`: `text` takes its place and is
        answered (deltas as for `send`); the branch it was on stays in the store."""
        self.load()
        index = self._index_of(message_id, "user")
        return self._run(client, self._base_before(client, index), text, params, priority,
                         regenerate=False, parent=self.chat.messages[index].parent_id)

    def regenerate(self, client: EngineClient, params: SamplingParams,
                   message_id: int | None = None, priority: int = 0
                   ) -> AsyncIterator[RequestOutput]:
        """Ask again the question reply `message_id` answers (None: the last reply): the new
        reply is a branch beside it, which stays in the store. A last turn the store never
        took is asked again as a new turn."""
        self.load()
        if message_id is None and self._turn_base is not None and not self._turn_stored:
            return self._run(client, _copy(self._turn_base), self.turn.user_text, params,
                             priority, regenerate=False, parent=self._last_message_id or None)
        replies = [m.id for m in (self.chat.messages if self.chat else []) if m.role == "assistant"]
        if message_id is None and not replies:
            raise PagedChatError("nothing to regenerate yet")
        index = self._index_of(replies[-1] if message_id is None else message_id, "assistant")
        question = self.chat.messages[index - 1] if index else None
        if question is None or question.role != "user":
            raise PagedChatError("this reply answers no question of the chat: nothing to regenerate")
        return self._run(client, self._base_before(client, index - 1), question.content, params,
                         priority, regenerate=True, parent=question.id)

    def branch_of(self, message_id: int) -> tuple[int, int] | None:
        """Which version of its message `message_id` is and how many there are (1-based),
        None where it has no other (an edited message, a regenerated reply have)."""
        versions = self.chat.branches.get(message_id) if self.chat is not None else None
        return None if not versions else (versions.index(message_id) + 1, len(versions))

    def switch_branch(self, message_id: int, step: int) -> int | None:
        """Go to the version `step` places after message `message_id` (-1: the one before)
        and the branch below it; the store's branch last used becomes that one. The id of
        that version; None when there is none that far."""
        assert self.chat is not None and not self.streaming
        versions = self.chat.branches.get(message_id, [message_id])
        target = versions.index(message_id) + step
        if not 0 <= target < len(versions):
            return None
        self.chat = self.store.select_branch(self.chat.id, versions[target])
        self._last_message_id = self.chat.leaf_id or 0
        self.conversation = self._turn_base = self.turn = None
        return versions[target]

    def reprioritize(self, priority: int) -> None:
        """Serve the streaming reply at `priority` from now on, where the client can move a
        request in flight (capabilities.reprioritize) and the turn has a request id."""
        turn, client = self.turn, self._client
        if (self.streaming and client is not None and turn.request_id is not None
                and turn.priority != priority and client.capabilities.reprioritize):
            turn.priority = priority
            client.reprioritize(turn.request_id, priority)

    def stop(self) -> bool:
        """Stop the streaming reply (its blocks go back to the pool); True if one was."""
        if not self.streaming or self._client is None:
            return False
        self._client.abort(self.turn.request_id)
        return True

    async def _run(self, client: EngineClient, base: Conversation, text: str,
                   params: SamplingParams, priority: int, regenerate: bool,
                   parent: int | None
                   ) -> AsyncIterator[RequestOutput]:
        working = _copy(base)
        working.enable_thinking = self.thinking
        prompt_ids = working.next_prompt_ids(text)
        self._turns += 1
        request_id = f"{self.chat.id}/{self._turns}" if self.chat is not None else None
        prompt_end = working.tokenizer.decode(prompt_ids[-_PROMPT_END_IDS:], skip_special_tokens=False)
        self.turn = turn = Turn(text, prompt_ids, request_id, priority=priority,
                                in_thinking=opens_thinking(prompt_end))
        self._save_failed = False
        self.unsaved = None
        try:
            self._start_rows(base, prompt_ids, regenerate, parent)
        except BaseException:
            turn.finish("error", None, time.perf_counter())
            raise
        self._client = client
        saved_at = time.monotonic()
        try:
            async with aclosing(client.stream(prompt_ids, params, request_id=request_id,
                                              owner=self.chat_id, priority=turn.priority)) as stream:
                async for output in stream:
                    turn.add(output, time.perf_counter())
                    # Not before the first token: a turn withdrawn then leaves no write behind.
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
                self._end_turn(base, working, turn)

    def _start_rows(self, base: Conversation, prompt_ids: list[int], regenerate: bool,
                    parent: int | None) -> None:
        """The turn's rows before the first token, all or none, under `parent`: a kill from
        here on keeps the turn. A regenerate writes a new reply row under its question. A
        store that cannot take them (a full disk) costs a warning: the turn runs unsaved
        (`unsaved` says why) and the store keeps no part of it."""
        self._rows_before = None
        if self.chat is None:
            return
        before = self._last_message_id
        self._turn_created_chat = not self._chat_in_store
        try:
            user = None if regenerate else (self.turn.user_text, base.added_ids(prompt_ids))
            first_id, reply_id = self.store.start_turn(self.chat, user, parent,
                                                       after=self._last_message_id,
                                                       create=self._turn_created_chat)
        except StoreWriteError as error:
            self._reply_id = None   # its saves would land on the last turn's reply
            self.unsaved = error
            self._save_failed = True
            self.on_warning(f"the turn could not be saved ({error}); it goes on unsaved")
            return
        self._chat_in_store = True
        self._reply_id = self.turn.reply_message_id = reply_id
        self.turn.user_message_id = first_id
        self._rows_before = (before, first_id if first_id is not None else reply_id)
        self._last_message_id = reply_id

    def _withdraw_rows(self) -> None:
        """Take the turn's rows back out of the store, as if it was never sent."""
        if self._rows_before is None:  # no rows were written (no store)
            return
        last_message_id, first_id = self._rows_before
        try:
            if self._turn_created_chat:  # the chat goes too: no empty chat is kept
                self.store.delete_chat(self.chat.id)
            else:
                self.store.withdraw_turn(self.chat.id, first_id, last_message_id or None)
        except (StoreError, sqlite3.Error) as error:
            self.on_warning(f"the failed turn could not be taken out of the chat ({error})")
            return
        self._chat_in_store = not self._turn_created_chat
        self._last_message_id, self._reply_id = last_message_id, None
        self.turn.user_message_id = self.turn.reply_message_id = None

    def _end_turn(self, base: Conversation, working: Conversation, turn: Turn) -> None:
        refused = turn.finish_reason == "error" and not turn.token_ids
        if not refused:
            working.add_reply(turn.prompt_ids, turn.token_ids, turn.text, turn.reasoning)
            self.conversation = working
        self._save_reply(turn, final=True)
        self._turn_base = base
        self._turn_stored = self._rows_before is not None
        if self._turn_stored:
            try:   # the branch the turn is on, with its rows' ids and its siblings
                self.chat = self.store.get_chat(self.chat.id, self._reply_id)
            except (StoreError, sqlite3.Error):   # the chat deleted meanwhile: said already
                pass

    def _save_reply(self, turn: Turn, final: bool) -> None:
        """Write the reply so far; a store that fails is one warning, never the reply's end
        (the next save tries again)."""
        if self._reply_id is None:
            return
        timings = {**turn.timings(), **({"error": turn.error} if turn.error else {})}
        try:
            self.store.update_message(self._reply_id, turn.text, turn.token_ids,
                                      turn.finish_reason if final else None,
                                      timings if final else None, reasoning=turn.reasoning)
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

    def _index_of(self, message_id: int, role: str) -> int:
        """Where message `message_id` is in the branch; PagedChatError unless it is there
        and has `role`."""
        messages = self.chat.messages if self.chat is not None else []
        index = next((i for i, m in enumerate(messages) if m.id == message_id), None)
        if index is None or messages[index].role != role:
            raise PagedChatError(f"the chat's branch has no {role} message {message_id} "
                                 "(a turn the store never took cannot be branched from)")
        return index

    def _base_before(self, client: EngineClient, index: int) -> Conversation:
        """The conversation of the branch's first `index` messages, from their stored ids."""
        info = client.info
        earlier = dataclasses.replace(self.chat, messages=self.chat.messages[:index])
        if not earlier.messages:
            return Conversation(info.tokenizer, info.chat_template, self.system_prompt)
        return Conversation.from_chat(earlier, info.tokenizer, info.chat_template)


def _copy(conversation: Conversation) -> Conversation:
    return dataclasses.replace(conversation, messages=list(conversation.messages),
                               token_ids=list(conversation.token_ids))
