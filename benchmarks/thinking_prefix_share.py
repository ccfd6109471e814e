#!/usr/bin/env python3
"""The cached share of the prompt on each turn of a thinking chat: the chat's next prompt
built from the exact ids the model generated (paged-chat's ChatSession), against the same
chat re-rendered through the template at every turn, as most chat apps and servers build
it. A template that drops earlier thinking (Qwen3's, the R1 distills') rewrites the history
the engine holds, so the re-rendered prompt misses the prefix cache from the last reply
on (and the model no longer sees its earlier thinking); the kept ids miss nothing but the
last reply's partial block.

    python -m benchmarks.thinking_prefix_share [--model HF_FOLDER] [--turns 5]

Without --model it runs a tiny random Qwen3 with <think> tokens and Qwen3's thinking
template (tests/tiny_models.py); the share depends on the prompt's ids, not on speed. Every
reply is held to the shape of a reasoning model's (thinking, then an answer) by a regex,
so a random model thinks too; --free leaves a real reasoning model's replies as it writes
them.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from paged_chat.app.chat_session import ChatSession  # noqa: E402
from paged_chat.app.conversation import assistant_message  # noqa: E402
from paged_chat.app.reasoning import split_reply  # noqa: E402
from paged_chat.engine import ClientSpec, EngineClient, EngineConfig, SamplingParams, make_client  # noqa: E402

QUESTIONS = ["What is a paged KV cache?", "Why split it into blocks?", "And prefix caching?",
             "What evicts a cached block?", "Sum it up in one line."]
REPLY_SHAPE = r"<think>\n[a-z ]{40,80}\n</think>\n\n[a-z ]{10,30}"


def share(cached: int | None, prompt: int) -> str:
    """The cached share, the cached and prompt tokens, and the tokens prefilled."""
    return f"{(cached or 0) / prompt:6.1%} ({cached}/{prompt}, {prompt - (cached or 0)} prefilled)"


async def kept_ids_chat(client: EngineClient, params: SamplingParams, turns: int) -> list[tuple[int | None, int]]:
    """(cached, prompt) tokens of each turn, the prompt from the generated ids."""
    session = ChatSession()
    figures = []
    for question in (QUESTIONS * turns)[:turns]:
        async for _ in session.send(client, question, params):
            pass
        figures.append((session.turn.num_cached_tokens, len(session.turn.prompt_ids)))
    return figures


async def re_rendered_chat(client: EngineClient, params: SamplingParams, turns: int) -> list[tuple[int | None, int]]:
    """(cached, prompt) tokens of each turn, the prompt the template's rendering of the chat."""
    info = client.info
    messages: list[dict[str, str]] = []
    figures = []
    for question in (QUESTIONS * turns)[:turns]:
        messages.append({"role": "user", "content": question})
        text = info.tokenizer.apply_chat_template(messages, chat_template=info.chat_template,
                                                  tokenize=False, add_generation_prompt=True)
        prompt_ids = info.tokenizer.encode(text, add_special_tokens=False)
        async for output in client.stream(prompt_ids, params):
            pass
        reply = split_reply(output.text)
        messages.append(assistant_message(reply.answer, reply.reasoning or None))
        figures.append((output.num_cached_tokens, len(prompt_ids)))
    return figures


def run(model: str, turns: int, free: bool) -> dict[str, list[tuple[int | None, int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=256, **({} if free else {"regex": REPLY_SHAPE}))
    results = {}
    for name, chat in (("kept ids", kept_ids_chat), ("re-rendered", re_rendered_chat)):
        # One engine each: neither chat finds the other's blocks.
        client = make_client(ClientSpec("thread", EngineConfig(
            model=model, device="cpu", dtype="float32", block_size=16, num_blocks=1024,
            max_num_seqs=4, max_num_batched_tokens=1024)))
        try:
            results[name] = asyncio.run(chat(client, params, turns))
        finally:
            client.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an HF folder whose template thinks (default: a tiny random Qwen3)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--free", action="store_true", help="no regex on the replies")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if model is None:
            sys.path.insert(0, str(REPO / "tests"))
            from tiny_models import thinking_qwen3_folder
            model = str(thinking_qwen3_folder(Path(scratch) / "tiny-thinking-qwen3"))
        results = run(model, args.turns, args.free)
    print(f"cached share of the prompt per turn ({args.turns} turns, block size 16)")
    for name, figures in results.items():
        print(f"  {name:12s}")
        for number, turn in enumerate(figures, 1):
            print(f"    turn {number}: {share(*turn)}")
    for name, figures in results.items():
        print(f"turn {args.turns}, {name}: {share(*figures[-1]).strip()}")


if __name__ == "__main__":
    main()
