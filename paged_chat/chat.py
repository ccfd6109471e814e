"""Conversation: chat messages and the exact token ids behind them, kept across turns.

The engine's prefix cache hashes token ids, so a chat's next prompt must start with the
very ids the engine already holds: the previous prompt and the generated reply, end of
turn included. The next prompt is those ids plus the template's rendering of what comes
after them (the template's tail after the reply, the new user turn and the generation
prompt), never a re-tokenization of the whole text. Only the new tokens get prefilled.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Conversation:
    tokenizer: Any
    chat_template: str
    system_prompt: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    reply_start: int = 0
    _pending: list[dict[str, str]] = field(default_factory=list)

    def next_prompt_ids(self, user_text: str) -> list[int]:
        """The prompt ids for a new user message: history ids + only what is new."""
        turn = {"role": "user", "content": user_text}
        self._pending = [turn]
        full = self._render(self.messages + [turn], add_generation_prompt=True)
        if not self.token_ids:
            return self._encode(full)
        previous = self._render(self.messages, add_generation_prompt=False)
        reply = self.tokenizer.decode(self.token_ids[self.reply_start:], skip_special_tokens=False)
        reply_at = previous.rfind(reply) if reply else -1
        if reply_at < 0 or not full.startswith(previous):
            warnings.warn("the chat template does not extend the previous turn; "
                          "re-encoding the whole chat (the prefix cache will miss)")
            return self._encode(full)
        tail = previous[reply_at + len(reply):] + full[len(previous):]
        return self.token_ids + self.tokenizer.encode(tail, add_special_tokens=False)

    def add_reply(self, prompt_ids: list[int], reply_ids: list[int], reply_text: str) -> None:
        """Record the turn the engine just answered: its exact prompt and reply ids."""
        self.messages.extend(self._pending)
        self.messages.append({"role": "assistant", "content": reply_text})
        self._pending = []
        self.token_ids = list(prompt_ids) + list(reply_ids)
        self.reply_start = len(prompt_ids)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if self.system_prompt:
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
