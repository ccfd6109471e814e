"""`paged-chat serve` on the default model (SmolLM2-135M) under many concurrent streaming
clients of the official `openai` client: the engine batches them, none is starved, and the
clients that leave mid-stream give their blocks back.

Short prompts and few tokens keep it to seconds of compute on a CPU; the batch still has
to hold more than 32 streams at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from helpers import wait_for
from server_fixtures import Served, start_server

from paged_chat.engine import ClientSpec, Engine, EngineConfig, make_client

CLIENTS = 64
LEAVERS = 8
MAX_TOKENS = 8
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_served(smollm2_source) -> Iterator[Served]:
    config = EngineConfig(device="cpu", dtype="float32", num_blocks=256, block_size=16,
                          max_model_len=64, max_num_seqs=CLIENTS + LEAVERS,
                          max_num_batched_tokens=512)
    client = make_client(ClientSpec(engine=Engine(config, source=smollm2_source)))
    running = start_server(client)
    yield running
    running.stop()
    client.shutdown()


@pytest.mark.timeout(300)
async def test_64_concurrent_streams_on_the_default_model(default_served):
    api = default_served
    client = openai.AsyncOpenAI(base_url=api.url, api_key="unused", max_retries=0,
                                http_client=openai.DefaultAsyncHttpxClient(
                                    limits=httpx.Limits(max_connections=2 * (CLIENTS + LEAVERS))))
    extra = {"ignore_eos": True, "return_token_ids": True}
    peak = 0
    done = asyncio.Event()
    first_token_at: list[float] = []
    finished_at: list[float] = []

    async def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, api.client.stats().batch_size)
            await asyncio.sleep(0.01)

    async def stay(index: int) -> int:
        stream = await client.completions.create(
            model=api.model, prompt=f"Client {index}:", max_tokens=MAX_TOKENS, stream=True,
            temperature=0.0, user=f"client-{index}", extra_body=extra)
        received = 0
        async for chunk in stream:
            if received == 0:
                first_token_at.append(time.monotonic())
            received += sum(len(choice.model_extra["token_ids"]) for choice in chunk.choices)
        finished_at.append(time.monotonic())
        return received

    async def leave(index: int) -> int:
        """Read two tokens of a reply that would fill max_model_len, then hang up."""
        stream = await client.completions.create(
            model=api.model, prompt=f"Leaver {index}:", stream=True, temperature=0.0,
            user="leaver", extra_body=extra)
        received = 0
        async for chunk in stream:
            received += sum(len(choice.model_extra["token_ids"]) for choice in chunk.choices)
            if received >= 2:
                break
        await stream.close()
        return received

    before = api.client.stats().generation_tokens_total
    watcher = asyncio.create_task(watch())
    counts = await asyncio.wait_for(asyncio.gather(
        *(stay(i) for i in range(CLIENTS)), *(leave(i) for i in range(LEAVERS))), timeout=240)
    done.set()
    await watcher
    await client.close()

    assert counts[:CLIENTS] == [MAX_TOKENS] * CLIENTS, "a client was starved or cut short"
    assert max(first_token_at) < min(finished_at), "a stream began only after another had ended"
    assert peak > 32, f"the engine never batched more than {peak} of {CLIENTS} streams"
    wait_for(lambda: not api.client.transport.engine.requests, timeout=60, what="the leavers to be aborted")
    wait_for(lambda: api.client.stats().blocks_in_use == 0, timeout=60, what="every block back")
    leaver_tokens = api.client.stats().generation_tokens_total - before - CLIENTS * MAX_TOKENS
    assert leaver_tokens < LEAVERS * 16, (
        f"the leavers generated {leaver_tokens} tokens: their requests ran on after they hung up")
