"""Bench scenario: a long chat resumed in a new process, with and without the disk KV tier.

One engine runs a chat of about 1,500 history tokens and closes (its blocks are on disk
under a throwaway cache dir). Then, as `ask -c` in a new process would, a NEW Engine
continues the chat twice: without a KV tier (it prefills the whole history) and with the
disk tier over that cache dir (it reads the history's KV back and prefills only the new
message). Reported: time to first token both ways and their ratio, whether the greedy
replies are token for token the same, and the disk bytes the tier spends per token.

The tier's files were just written, so the OS page cache holds them, as it would for a
chat reopened soon after; a cold disk adds its read time (a few MB per 1,000 tokens).

Part of `paged-chat bench`; alone (model smollm2-135m and dtype auto by default):

    python -c "from paged_chat.bench.tier_resume import main; main()" [model] [dtype]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

from paged_chat.app.conversation import Conversation
from paged_chat.engine import Engine, EngineConfig, OutputProcessor, RequestOutput, SamplingParams
from paged_chat.engine.models.loader import ModelSource, load_model_source

HISTORY_TOKENS = 1500
REPLY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
_NOTE = ("Note {}: a paged KV cache splits each sequence's keys and values into fixed-size "
         "blocks, so memory is allocated on demand and shared prefixes are stored once. The "
         "scheduler admits requests while blocks last and preempts the newest when they run out; "
         "prefix caching keys every full block by a hash of all tokens before it.")
_NOTES_PER_TURN = 4
_QUESTION = "Summarise the notes above in one sentence."


def tier_resume(model: str, source: ModelSource, dtype: str, block_size: int,
                max_num_batched_tokens: int, system_prompt: str = "You are a helpful assistant."
                ) -> dict:
    """Run the scenario on the CPU and return its figures (see the module docstring)."""
    num_blocks = -(-2 * HISTORY_TOKENS // block_size)
    with tempfile.TemporaryDirectory(prefix="paged-chat-tier-bench-") as cache_dir:
        def new_engine(with_tier: bool) -> Engine:
            engine = Engine(EngineConfig(
                model=model, device="cpu", dtype=dtype, block_size=block_size,
                num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens,
                cache_dir=cache_dir, kv_tier_disk_bytes="4GiB" if with_tier else 0), source)
            engine.generate([source.tokenizer.encode("Hello")], REPLY)  # warm-up, under a block
            return engine

        conversation = Conversation(source.tokenizer, source.chat_template, system_prompt)
        writer = new_engine(with_tier=True)
        history: list[int] = []
        notes = 0
        # A model with a short context (the tests' tiny one) gets a chat of half of it.
        while len(history) < min(HISTORY_TOKENS, writer.max_model_len // 2):
            message = " ".join(_NOTE.format(notes + i) for i in range(_NOTES_PER_TURN))
            notes += _NOTES_PER_TURN
            prompt = conversation.next_prompt_ids(message)
            reply = writer.generate([prompt], REPLY)[0]
            conversation.add_reply(prompt, reply.token_ids, reply.text)
            history = prompt + reply.token_ids
        writer.close()
        follow_up = conversation.next_prompt_ids(_QUESTION)

        runs = {}
        for name, with_tier in (("without_tier", False), ("with_tier", True)):
            engine = new_engine(with_tier)
            ttft, final = _time_to_first_token(engine, follow_up)
            runs[name] = (ttft, final, engine.stats())
            engine.close()
    (cold_s, cold, _), (warm_s, warm, stats) = runs["without_tier"], runs["with_tier"]
    return {"history_tokens": len(follow_up), "ttft_without_tier_s": cold_s,
            "ttft_with_tier_s": warm_s, "speedup": cold_s / warm_s,
            "prefilled_without_tier": len(follow_up) - cold.num_cached_tokens,
            "prefilled_with_tier": len(follow_up) - warm.num_cached_tokens,
            "tier_cached_tokens": warm.num_tier_cached_tokens,
            "same_reply": warm.token_ids == cold.token_ids,
            "disk_bytes_per_token": stats.tier.disk_bytes / max(1, stats.tier.disk_blocks * block_size),
            }


def format_tier_resume(result: dict) -> str:
    return (f"chat of {result['history_tokens']} tokens resumed in a new engine: first token in "
            f"{1e3 * result['ttft_without_tier_s']:.0f} ms without the disk KV tier vs "
            f"{1e3 * result['ttft_with_tier_s']:.0f} ms with it ({result['speedup']:.1f}x; "
            f"{result['tier_cached_tokens']} tokens from disk, same reply: "
            f"{'yes' if result['same_reply'] else 'NO'}); "
            f"{result['disk_bytes_per_token'] / 1024:.1f} KiB on disk per token")


def _time_to_first_token(engine: Engine, prompt: list[int]) -> tuple[float, RequestOutput]:
    """Seconds from add_request to the step that yields its first token, and its final output."""
    started = time.perf_counter()
    processor = OutputProcessor(engine.tokenizer)  # the reply as a client sees it
    processor.add_request(engine.add_request(prompt, REPLY), REPLY)
    first = None
    while engine.has_unfinished():
        for out in processor.process(engine.step()).outputs:
            if first is None and out.new_token_ids:
                first = time.perf_counter() - started
            if out.finished:
                final = out
    if first is None:
        raise RuntimeError(f"the resumed chat yielded no token: {final.error}")
    return first, final


def main() -> None:
    """Run the scenario alone and print its figures (see the module docstring)."""
    model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
    dtype = sys.argv[2] if len(sys.argv) > 2 else "auto"  # bf16 where the CPU has bf16 dot products
    result = tier_resume(model, load_model_source(model), dtype, block_size=16,
                         max_num_batched_tokens=512)
    print(format_tier_resume(result))
    print(json.dumps(result, indent=2))
