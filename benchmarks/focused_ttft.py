"""The focused tab's time to first token beside busy tabs: with `--tabs` tabs streaming (each
asking turn after turn, as the demo's tabs do), the TTFT of a prompt sent at the top
priority, against the same prompt on the idle engine; with priorities on (the busy tabs at
the TUI's hidden-tab priority) and off (every request at 0, first come first served).

    python -m benchmarks.focused_ttft [--model smollm2-135m] [--device cpu] [--tabs 8]
        [--prompt-tokens 512] [--tab-prompt-tokens 512] [--tab-reply-tokens 128]
        [--repeats 5] [--transport process]

The engine runs as the TUI's does (a child process by default). Each measured prompt is
new to the prefix cache (its cached prefixes are dropped before it goes), so every TTFT is
a whole prefill. Needs a quiet machine: it reports medians, not a pass or a fail.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from contextlib import aclosing
from dataclasses import dataclass

from paged_chat.engine import ClientSpec, EngineClient, EngineConfig, SamplingParams, make_client
from paged_chat.tui.chat_tab import HIDDEN_TAB_PRIORITY, SHOWN_TAB_PRIORITY

FIRST_ID = 200   # prompt ids are drawn above the special tokens of common vocabularies


@dataclass(frozen=True)
class Workload:
    tabs: int
    prompt_tokens: int
    tab_prompt_tokens: int
    tab_reply_tokens: int
    repeats: int
    vocab_size: int
    seed: int = 0

    def prompt(self, rng: random.Random, length: int) -> list[int]:
        return [rng.randrange(FIRST_ID, self.vocab_size) for _ in range(length)]


async def time_to_first_token(client: EngineClient, prompt: list[int]) -> float:
    """Seconds from sending `prompt` at the top priority to its first token."""
    client.reset_prefix_cache()   # a command before the prompt's: done before it is added
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    started = time.perf_counter()
    async with aclosing(client.stream(prompt, params, priority=SHOWN_TAB_PRIORITY)) as stream:
        async for output in stream:
            if output.new_token_ids:
                return time.perf_counter() - started
    raise RuntimeError("the measured prompt ended without a token")


async def busy_tab(client: EngineClient, workload: Workload, index: int, priority: int,
                   streaming: set[int], stop: asyncio.Event) -> None:
    """One tab asking turn after turn until `stop`; in `streaming` once its first reply is."""
    rng = random.Random(workload.seed * 1000 + index)
    params = SamplingParams(temperature=0.8, max_tokens=workload.tab_reply_tokens,
                            ignore_eos=True, seed=index)
    while not stop.is_set():
        prompt = workload.prompt(rng, workload.tab_prompt_tokens)
        async with aclosing(client.stream(prompt, params, priority=priority)) as stream:
            async for output in stream:
                if output.new_token_ids:
                    streaming.add(index)
                if stop.is_set():
                    break


async def measure(client: EngineClient, workload: Workload, busy_priority: int | None
                  ) -> list[float]:
    """The TTFTs of `repeats` prompts: on the idle engine (`busy_priority` None), else beside
    the busy tabs at `busy_priority`."""
    rng = random.Random(workload.seed)
    prompts = [workload.prompt(rng, workload.prompt_tokens) for _ in range(workload.repeats)]
    if busy_priority is None:
        return [await time_to_first_token(client, prompt) for prompt in prompts]
    streaming: set[int] = set()
    stop = asyncio.Event()
    tabs = [asyncio.create_task(busy_tab(client, workload, index, busy_priority, streaming, stop))
            for index in range(workload.tabs)]
    try:
        while len(streaming) < workload.tabs:
            await asyncio.sleep(0.05)
        times = []
        for prompt in prompts:
            times.append(await time_to_first_token(client, prompt))
            await asyncio.sleep(rng.uniform(0.1, 0.3))   # not in step with the tabs' turns
        return times
    finally:
        stop.set()
        await asyncio.gather(*tabs)


def report_line(label: str, times: list[float], idle_s: float) -> str:
    median = statistics.median(times)
    runs = " ".join(f"{t:.3f}" for t in times)
    return f"{label:<26} median {median:7.3f} s  ({median / idle_s:5.2f}x idle)   runs: {runs}"


async def run(client: EngineClient, workload: Workload) -> list[str]:
    idle = await measure(client, workload, None)
    idle_s = statistics.median(idle)
    lines = [report_line("idle engine", idle, idle_s)]
    for label, priority in ((f"{workload.tabs} tabs, priorities off", SHOWN_TAB_PRIORITY),
                            (f"{workload.tabs} tabs, priorities on", HIDDEN_TAB_PRIORITY)):
        lines.append(report_line(label, await measure(client, workload, priority), idle_s))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--transport", default="process", choices=("process", "thread"))
    parser.add_argument("--tabs", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--tab-prompt-tokens", type=int, default=512)
    parser.add_argument("--tab-reply-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    client = make_client(ClientSpec(args.transport, EngineConfig(model=args.model,
                                                                 device=args.device)))
    try:
        tokenizer = client.info.tokenizer
        vocab_size = len(tokenizer) if tokenizer is not None else 30000
        workload = Workload(args.tabs, args.prompt_tokens, args.tab_prompt_tokens,
                            args.tab_reply_tokens, args.repeats, vocab_size)
        print(f"{client.info.name}, engine {client.capabilities.where}: TTFT of a "
              f"{args.prompt_tokens}-token prompt at the top priority; busy tabs ask "
              f"{args.tab_prompt_tokens}-token prompts for {args.tab_reply_tokens}-token replies")
        for line in asyncio.run(run(client, workload)):
            print(line)
    finally:
        client.shutdown()


if __name__ == "__main__":
    main()
