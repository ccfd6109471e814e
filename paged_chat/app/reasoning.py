"""A reply's thinking apart from its answer, split as the reply streams.

Reasoning models write their thinking between `<think>` and `</think>` before the answer
(Qwen3, QwQ). Some templates open the thinking in the prompt (DeepSeek-R1 distills end
their generation prompt with `<think>`), so the reply starts inside it and only closes it.
A marker may arrive split across deltas; a reply cut short (max_tokens) may never close
its thinking, which then holds the whole reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def opens_thinking(prompt_text: str) -> bool:
    """Whether a prompt leaves its reply inside an open thinking section (its generation
    prompt ends with `<think>`, as DeepSeek-R1 distills' templates write it)."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


@dataclass(slots=True, frozen=True)
class SplitText:
    """What one delta adds to the reasoning and to the answer."""

    reasoning: str = ""
    answer: str = ""


class _Part(Enum):
    START = "start"          # nothing but whitespace yet: a `<think>` may still open
    THINKING = "thinking"    # inside the thinking section
    ANSWER = "answer"        # past it (or there was none)


class ReasoningSplitter:
    """Splits a reply's text deltas into reasoning and answer.

    Contract: `feed` every delta in order, then `finish` once; the reasoning and answer
    deltas returned add up to the reply with its markers taken out. A thinking section is
    recognised only at the reply's start (after whitespace), or from the start when
    `in_thinking` (the prompt opened it); the whitespace around the reasoning and before the
    answer that follows it is dropped. A reply with no thinking is all answer, unchanged.
    Text that may be the start of a marker is held back until the next delta decides it.
    """

    def __init__(self, in_thinking: bool = False) -> None:
        self._part = _Part.THINKING if in_thinking else _Part.START
        self.opened = in_thinking   # whether the reply has a thinking section (so far)
        self._pending = ""
        self._reasoning_started = False
        self._answer_started = False
        self.reasoning = ""
        self.answer = ""

    @property
    def thinking(self) -> bool:
        """Whether the reply is inside its thinking section (or may be about to open it)."""
        return self._part is not _Part.ANSWER

    def feed(self, text: str) -> SplitText:
        self._pending += text
        reasoning, answer = [], []
        while True:
            if self._part is _Part.START:
                head = self._pending.lstrip()
                if head.startswith(THINK_OPEN):
                    self._part, self._pending = _Part.THINKING, head[len(THINK_OPEN):]
                    self.opened = True
                    continue
                if THINK_OPEN.startswith(head):  # whitespace, or a marker's start
                    break
                self._part = _Part.ANSWER
                self._answer_started = True  # no thinking: the text is all answer, as it came
            if self._part is _Part.THINKING:
                if not self._reasoning_started:
                    self._pending = self._pending.lstrip()
                end = self._pending.find(THINK_CLOSE)
                if end >= 0:
                    reasoning.append(self._pending[:end].rstrip())
                    self._pending = self._pending[end + len(THINK_CLOSE):]
                    self._reasoning_started = True
                    self._part = _Part.ANSWER
                    continue
                cut = _held_back(self._pending, THINK_CLOSE)
                reasoning.append(self._pending[:cut])
                self._pending = self._pending[cut:]
                self._reasoning_started = self._reasoning_started or cut > 0
                break
            if not self._answer_started:
                self._pending = self._pending.lstrip()
                self._answer_started = bool(self._pending)
            answer.append(self._pending)
            self._pending = ""
            break
        return self._add(SplitText("".join(reasoning), "".join(answer)))

    def finish(self) -> SplitText:
        """The text still held back, at the reply's end: an unclosed thinking section's
        rest is reasoning; a reply that only ever looked like it might open one is answer."""
        pending, self._pending = self._pending, ""
        if self._part is _Part.THINKING:
            return self._add(SplitText(reasoning=pending.rstrip()))
        return self._add(SplitText(answer=pending))

    def _add(self, split: SplitText) -> SplitText:
        self.reasoning += split.reasoning
        self.answer += split.answer
        return split


def split_reply(text: str, in_thinking: bool = False) -> SplitText:
    """A whole reply's reasoning and answer."""
    splitter = ReasoningSplitter(in_thinking)
    splitter.feed(text)
    splitter.finish()
    return SplitText(splitter.reasoning, splitter.answer)


def _held_back(text: str, marker: str) -> int:
    """Where the text that is surely not `marker` ends: before a tail that could start
    it, and before the whitespace ahead of that tail (dropped if the marker follows)."""
    cut = len(text)
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            cut = len(text) - size
            break
    while cut > 0 and text[cut - 1].isspace():
        cut -= 1
    return cut
