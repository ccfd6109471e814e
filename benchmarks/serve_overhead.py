"""The HTTP API's cost: the same chats in-process and through `paged-chat serve`.

    python -m benchmarks.serve_overhead [--model smollm2-135m] [--chats 32] [--max-tokens 64]

The same engine settings (config.toml's, with --model) in both runs, each in a fresh
engine: in-process, every chat is a stream on an engine on a thread of this process; over HTTP,
`paged-chat serve` runs in a process of its own (as deployed) and every chat is a
streaming /v1/chat/completions of the official `openai` client from this one. Greedy, EOS ignored: both runs generate the same number of tokens. Prints
output tokens/s of each, their ratio, and the mean TTFT of each (the server's added TTFT
is the difference).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import httpx
import openai

from paged_chat.app.settings import load_settings
from paged_chat.engine import ClientSpec, EngineClient, SamplingParams, make_client

SYSTEM = "You are a helpful assistant. Answer briefly."


@dataclass(slots=True)
class RunResult:
    tokens: int
    seconds: float
    ttfts: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def mean_ttft_s(self) -> float:
        return statistics.fmean(self.ttfts)


async def _timed(chats: int, one: Callable[[int], AsyncIterator[int]]) -> RunResult:
    """Run `chats` streams at once; each yields its token count per delta."""
    ttfts: list[float] = []

    async def run(index: int) -> int:
        started, count = time.perf_counter(), 0
        async for tokens in one(index):
            if count == 0 and tokens:
                ttfts.append(time.perf_counter() - started)
            count += tokens
        return count

    started = time.perf_counter()
    counts = await asyncio.gather(*(run(index) for index in range(chats)))
    return RunResult(sum(counts), time.perf_counter() - started, ttfts)


def _messages(index: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Chat {index}: tell me something about the number {index}."}]


def in_process(client: EngineClient, chats: int, max_tokens: int) -> Awaitable[RunResult]:
    tokenizer, template = client.info.tokenizer, client.info.chat_template
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(index: int) -> AsyncIterator[int]:
        text = tokenizer.apply_chat_template(_messages(index), chat_template=template,
                                             tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        async for output in client.stream(ids, params, owner="bench"):
            yield len(output.new_token_ids)

    return _timed(chats, one)


async def over_http(url: str, model: str, chats: int, max_tokens: int) -> RunResult:
    api = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0,
                             http_client=openai.DefaultAsyncHttpxClient(
                                 limits=httpx.Limits(max_connections=chats + 8)))

    async def one(index: int) -> AsyncIterator[int]:
        stream = await api.chat.completions.create(
            model=model, messages=_messages(index), max_tokens=max_tokens, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        async with stream:
            async for chunk in stream:
                for choice in chunk.choices:
                    yield len((choice.model_extra or {}).get("token_ids") or [])

    try:
        return await _timed(chats, one)
    finally:
        await api.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    config = load_settings().engine_config(model=args.model)
    client = make_client(ClientSpec("thread", config))
    try:
        asyncio.run(in_process(client, 2, 4))   # warm-up: first-call costs out of the run
        local = asyncio.run(in_process(client, args.chats, args.max_tokens))
    finally:
        client.shutdown()
    with _served(args.model) as url:
        asyncio.run(over_http(url, client.info.name, 2, 4))
        remote = asyncio.run(over_http(url, client.info.name, args.chats, args.max_tokens))
    max_num_seqs = config.for_device(client.info.device).max_num_seqs
    print(f"{args.chats} chats x {args.max_tokens} tokens on {client.info.name} ({client.info.device}, "
          f"{client.info.dtype}, max_num_seqs {max_num_seqs})")
    for name, result in (("in-process", local), ("HTTP API", remote)):
        print(f"  {name:<10}  {result.tokens_per_s:8.1f} output tok/s  "
              f"mean TTFT {result.mean_ttft_s * 1000:7.1f} ms  ({result.tokens} tokens, {result.seconds:.2f} s)")
    print(f"  HTTP / in-process throughput: {remote.tokens_per_s / local.tokens_per_s:.1%}; "
          f"TTFT added by the server: {(remote.mean_ttft_s - local.mean_ttft_s) * 1000:+.1f} ms")


@contextlib.contextmanager
def _served(model: str, timeout_s: float = 300.0) -> Iterator[str]:
    """`paged-chat serve` in a process of its own, as deployed (its clients are not in its
    process); yields its /v1 URL once /health answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "paged_chat", "serve", "--model", model,
                                "--port", str(port)])
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"paged-chat serve did not come up (exit code {process.poll()})")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(30)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False

if __name__ == "__main__":
    main()
