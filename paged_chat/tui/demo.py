"""`paged-chat --demo N`: N tabs that chat by themselves, so the engine can be watched under
load without typing. Half of the tabs share one system prompt (its blocks are shared in
the block map), the others have their own; prompts vary from one line to a long passage,
and each tab carries on its conversation for a few turns (prefix reuse across turns)
before starting over."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

SHARED_SYSTEM = ("You are a helpful, knowledgeable assistant. Answer clearly and concisely, "
                 "use Markdown where it helps (lists, short code blocks), and say so when you "
                 "are not sure of something.")

OWN_SYSTEMS = [
    "You are a pirate who explains science. Stay in character.",
    "You are a senior Python engineer doing code review. Be direct.",
    "You are a poet. Answer every question with a short poem.",
    None,
]

_LONG = (
    "The history of computing is a history of memory. Early machines stored a few hundred "
    "words in mercury delay lines or on rotating drums, and programmers spent much of their "
    "time arranging data so that the next word arrived under the read head just as it was "
    "needed. Virtual memory, first built for the Atlas computer in Manchester, let programs "
    "pretend that they had a large, flat address space while the operating system moved "
    "fixed-size pages between a small fast store and a large slow one. Page tables map each "
    "virtual page to a physical frame; pages can be shared between processes, copied on write, "
    "and evicted when memory runs short. Decades later the same idea came back in a new place: "
    "the key-value cache of a language model server. Each sequence needs a growing cache of "
    "attention keys and values, and allocating one contiguous slab per sequence wastes memory "
    "to fragmentation and over-reservation. Splitting the cache into fixed-size blocks, with a "
    "block table per sequence, lets a server pack many more sequences into the same memory, "
    "share the blocks of a common prefix between them, and free them the moment a sequence ends."
)

PROMPTS = [
    "Hi! What can you do?",
    "Explain what a KV cache is in a transformer, in three sentences.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the capital of France, and what is it famous for?",
    "Give me five ideas for a weekend project with a Raspberry Pi.",
    "Summarise the following text in a short bulleted list:\n\n" + _LONG,
    "Why is the sky blue? Keep it short.",
    "Write a haiku about garbage collection.",
    "Compare lists and tuples in Python in a small Markdown table.",
    "Read this and tell me what problem paged attention solves:\n\n" + _LONG,
    "How do I reverse a linked list? Show code.",
    "Tell me a short story about a robot learning to paint.",
    "What are the pros and cons of SQLite for a desktop app?",
    "Explain continuous batching to a five-year-old.",
]

FOLLOW_UPS = [
    "Can you say that more simply?",
    "Thanks! Can you give an example?",
    "Now make it shorter.",
    "Interesting. What else should I know?",
    "Can you turn that into a numbered list?",
]


@dataclass
class Autopilot:
    """Drives one demo tab: a first prompt, a few follow-ups, then a fresh chat."""

    rng: random.Random
    turns_per_chat: int = 3
    paused: bool = False
    turns: int = field(default=0)

    def first_prompt(self) -> str:
        return self.rng.choice(PROMPTS)

    def next_prompt(self) -> str:
        return self.rng.choice(FOLLOW_UPS) if self.turns else self.first_prompt()

    def pause_s(self) -> float:
        return self.rng.uniform(0.3, 2.0)

    def turn_done(self, tab) -> None:
        if self.paused:
            return
        self.turns += 1
        tab.set_timer(self.pause_s(), lambda: tab.run_worker(self._next(tab), group="demo"))

    async def _next(self, tab) -> None:
        if self.paused or tab.streaming:
            return
        if self.turns >= self.turns_per_chat:
            self.turns = 0
            await tab.start_over()
        tab.send(self.next_prompt())


def demo_tabs(count: int, seed: int = 0) -> list[tuple[str, str | None, Autopilot]]:
    """(title, system prompt, autopilot) for each demo tab; even tabs share a system prompt."""
    rng = random.Random(seed)
    tabs = []
    for index in range(count):
        system = SHARED_SYSTEM if index % 2 == 0 else OWN_SYSTEMS[(index // 2) % len(OWN_SYSTEMS)]
        tabs.append((f"Demo {index + 1}", system, Autopilot(random.Random(rng.random()))))
    return tabs
