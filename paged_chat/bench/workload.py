"""The benchmark's workload: N chats sharing one system prompt, one question each,
through the model's chat template, with seeded reply lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

from paged_chat.app.conversation import Conversation
from paged_chat.engine.models.loader import ModelSource

SYSTEM_PROMPT = (
    "You are Atlas, a patient and precise assistant for a small engineering team. Answer in "
    "plain English, in short paragraphs, and prefer concrete examples over abstractions. When "
    "a question is ambiguous, state the assumption you make before answering. When you give "
    "code, keep it short, runnable and commented only where the reason is not obvious. When "
    "you do not know something, say so and suggest how the user could find out. Never invent "
    "references, numbers or quotes. Keep a friendly, calm tone, avoid jargon unless the user "
    "uses it first, and finish with one practical next step the user can take today. If the "
    "question touches safety, health or money, add a one-line note that the user should check "
    "with a qualified person. Use lists only when the order of steps matters, and never write "
    "more than five items in a list. Quote units with every number, prefer metric units, and "
    "round sensibly. If the user writes in another language, answer in that language. When "
    "the user shares an error message, first explain what it means in one sentence, then give "
    "the most likely cause and the fix, and only then mention rarer causes. When comparing "
    "tools, name the trade-off that matters most for a small team."
)
TOPICS = ("caching", "compilers", "databases", "operating systems", "networking", "GPUs",
          "compression", "cryptography", "version control", "testing", "type systems",
          "garbage collection", "file systems", "scheduling", "memory allocators", "hashing")
FORMS = ("Explain {} to a new engineer.", "What are common mistakes people make with {}?",
         "Give me a short history of {}.", "How would you teach {} in one afternoon?")


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    system_prompt_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def chat_workload(source: ModelSource, num_chats: int, min_output: int, max_output: int,
                  seed: int) -> Workload:
    """N chats sharing one system prompt, one distinct question each, chat-templated."""
    rng = random.Random(seed)
    questions = [form.format(topic) for form in FORMS for topic in TOPICS]
    rng.shuffle(questions)
    prompts = []
    for index in range(num_chats):
        question = questions[index % len(questions)]
        if index >= len(questions):
            question += f" (variant {index // len(questions)})"
        conversation = Conversation(source.tokenizer, source.chat_template, SYSTEM_PROMPT)
        prompts.append(conversation.next_prompt_ids(question))
    system_ids = Conversation(source.tokenizer, source.chat_template, SYSTEM_PROMPT).next_prompt_ids("")
    shared = next((i for i, pair in enumerate(zip(*prompts, system_ids)) if len(set(pair)) > 1),
                  len(system_ids))
    return Workload(prompts, [rng.randint(min_output, max_output) for _ in range(num_chats)], shared)
