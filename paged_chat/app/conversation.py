"""Conversation: chat messages and the exact token ids behind them, kept across turns.

The engine's prefix cache hashes token ids, so a chat's next prompt must start with the
very ids the engine already holds: the previous prompt and the generated reply, end of
turn included. The next prompt is those ids plus the tokens of what the template renders
after them (its tail after the reply, the new user turn and the generation prompt), never
a re-tokenization of the whole text. Only the new tokens get prefilled. That holds for a
reasoning model too, whose template drops the thinking of earlier replies (Qwen3, the
DeepSeek-R1 distills): the next prompt still holds the thinking as it was generated.

How a turn goes (the TUI and `paged-chat ask` both do this):

    conversation = Conversation.from_chat(chat, engine.tokenizer, engine.chat_template)
    prompt_ids = conversation.next_prompt_ids(user_text)
    store.add_message(chat.id, "user", user_text, conversation.added_ids(prompt_ids))
    ... stream the reply for prompt_ids ...
    conversation.add_reply(prompt_ids, reply_ids, reply_text)
    store.add_message(chat.id, "assistant", reply_text, reply_ids, finish_reason)
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jinja2

from paged_chat.engine.core.errors import PagedChatError

if TYPE_CHECKING:
    from paged_chat.app.chat_store import StoredChat


class ChatTemplateError(PagedChatError):
    """The model's chat template refused the conversation (many refuse a system turn)."""


# A thinking section (one a reply cut short never closed included), and the whitespace
# templates put or drop around it.
_THINKING = re.compile(r"<think>.*?(?:</think>|\Z)|\s", re.DOTALL)


def switches_thinking(chat_template: str) -> bool:
    """Whether a chat template turns the model's thinking on and off (Qwen3's
    `enable_thinking`)."""
    return "enable_thinking" in chat_template


def assistant_message(answer: str, reasoning: str | None) -> dict[str, str]:
    """A reply as a chat template takes it: its thinking as `reasoning_content`."""
    message = {"role": "assistant", "content": answer}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


@dataclass(slots=True)
class Conversation:
    """One chat's messages (`{"role", "content"}` dicts, a reply's thinking as its
    `reasoning_content`, system prompt excluded) and its history ids (`token_ids`: every
    prompt and reply token so far, in order). `enable_thinking` goes to the template when
    not None (see `switches_thinking`)."""

    tokenizer: Any
    chat_template: str
    system_prompt: str | None = None
    enable_thinking: bool | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    _pending: list[dict[str, str]] = field(default_factory=list)

    @classmethod
    def from_chat(cls, chat: StoredChat, tokenizer: Any, chat_template: str) -> Conversation:
        """Rebuild a stored chat: its messages, and its history ids as the concatenation of
        every row's ids (see paged_chat.app.chat_store). A user message with no reply after it (the
        reply never started) gets an empty one, so the turns keep alternating; the next
        prompt then closes that empty reply, exactly as the stored ids already imply. A turn
        the engine refused outright (an error before any token, e.g. a prompt past
        max_model_len) stays in the store but out of the context, or every later turn would
        fail the same way."""
        conversation = cls(tokenizer, chat_template, chat.system_prompt)
        messages = chat.messages
        refused = {i for pair in range(len(messages) - 1) for i in (pair, pair + 1)
                   if messages[pair].role == "user" and messages[pair + 1].role == "assistant"
                   and messages[pair + 1].finish_reason == "error" and not messages[pair + 1].token_ids}
        for index, message in enumerate(messages):
            if index in refused:
                continue
            conversation.messages.append(
                assistant_message(message.content, message.reasoning) if message.role == "assistant"
                else {"role": message.role, "content": message.content})
            conversation.token_ids.extend(message.token_ids)
            following = messages[index + 1] if index + 1 < len(messages) else None
            if message.role == "user" and (following is None or following.role != "assistant"):
                conversation.messages.append({"role": "assistant", "content": ""})
        return conversation

    def next_prompt_ids(self, user_text: str) -> list[int]:
        """The prompt for a new user message: the history ids + the ids of what is new.

        A template that drops earlier thinking renders the history without it: the new
        ids are then what it renders after the last reply, found by matching the history
        without its thinking sections and whitespace. When the rendered chat no longer
        matches the history's text even so (the system prompt or the template changed,
        or a reply does not survive a decode round trip), the whole chat is encoded
        afresh, with a warning: still the right prompt, but the prefix cache misses.
        """
        turn = {"role": "user", "content": user_text}
        self._pending = [turn]
        full = self._render(self.messages + [turn])
        if not self.token_ids:
            return self._encode(full)
        history = self.tokenizer.decode(self.token_ids, skip_special_tokens=False)
        if full.startswith(history):
            return self.token_ids + self._encode(full[len(history):])
        tail = _after_history_without_thinking(full, history)
        if tail is None:
            warnings.warn("the chat no longer matches its stored token ids (a changed system "
                          "prompt or template?): re-encoding it, so the prefix cache misses")
            return self._encode(full)
        return self.token_ids + self._encode(tail)

    def added_ids(self, prompt_ids: Sequence[int]) -> list[int]:
        """What `prompt_ids` (from next_prompt_ids) adds to the history: the ids a user row
        of the store holds. Call it before add_reply. When the chat had to be re-encoded
        this is the whole prompt (the stored rows then re-encode once more when loaded)."""
        known = len(self.token_ids)
        if list(prompt_ids[:known]) == self.token_ids:
            return list(prompt_ids[known:])
        return list(prompt_ids)

    def add_reply(self, prompt_ids: Sequence[int], reply_ids: Sequence[int], reply_text: str,
                  reasoning: str | None = None) -> None:
        """Record the turn the engine just answered: its exact prompt and reply ids (end of
        turn included), its answer and its thinking (None: it had none). A cut reply is
        recorded the same way, with what it had."""
        self.messages.extend(self._pending)
        self.messages.append(assistant_message(reply_text, reasoning))
        self._pending = []
        self.token_ids = list(prompt_ids) + list(reply_ids)

    def _render(self, messages: list[dict[str, str]]) -> str:
        if self.system_prompt:
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        switch = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=True, **switch)
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the model's chat template failed: {error}") from error

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def _after_history_without_thinking(full: str, history: str) -> str | None:
    """What `full` renders after `history` when the two differ only in thinking sections
    and whitespace (a template that drops earlier thinking); None when they differ in more."""
    kept = [match.end() for match in re.finditer(r"\S", _THINKING.sub(_blank, full))]
    bare_history = _THINKING.sub("", history)
    bare_full = _THINKING.sub("", full)
    if not bare_history or not bare_full.startswith(bare_history):
        return None
    return full[kept[len(bare_history) - 1]:]


def _blank(match: re.Match[str]) -> str:
    """A thinking section as spaces: the text around it keeps its offsets."""
    return " " * len(match.group())
