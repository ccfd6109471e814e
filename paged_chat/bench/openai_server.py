"""The `openai:URL` system: the benchmark's workload through any OpenAI-compatible server
(llama.cpp's `llama-server`, vLLM, SGLang, Ollama's /v1, another `paged-chat serve`).

Every chat is a streaming /v1/completions request of the official `openai` client, all
sent at time 0, with the workload's exact prompt token ids (chat-templated here, so the
server runs the same prompts as the in-process systems), greedy, EOS ignored, and
`max_tokens` the workload's reply length. A warm-up request first (the in-process systems
get one too), on a one-token prompt so that it caches nothing the chats could reuse, also
tells whether the server takes token-id prompts; one that refuses them (Ollama) is sent
the prompts decoded to text, special tokens kept, to re-tokenize. A server that returns token ids (vLLM's and
paged-chat's `return_token_ids`) is compared token for token with the others; one that
does not (llama-server) counts tokens from `usage`, else one per streamed chunk, and its
outputs are left out. The server runs its own weights, dtype and threads: the table
says which model it served, not that the figures are like for like.

`$PAGED_CHAT_API_KEY` is sent as the bearer key when set.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

from paged_chat.bench.systems import SystemResult, per_request_timing
from paged_chat.bench.workload import Workload

PREFIX = "openai:"


@dataclass(slots=True)
class _Reply:
    """One chat's stream as it arrived: a time per token, the ids where the server sent them."""

    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    usage_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.token_times)


def is_openai_system(name: str) -> bool:
    return name.startswith(PREFIX) and len(name) > len(PREFIX)


def run_openai_server(name: str, workload: Workload, tokenizer: Any,
                      timeout_s: float = 3600.0) -> SystemResult:
    """Run the workload against the server `name` ("openai:URL") names; `tokenizer` is the
    workload's, for a server that takes text prompts only."""
    assert is_openai_system(name), name
    base_url = name.removeprefix(PREFIX).rstrip("/").removesuffix("/v1") + "/v1"
    return asyncio.run(_run(name, base_url, workload, tokenizer, timeout_s))


async def _run(name: str, base_url: str, workload: Workload, tokenizer: Any,
               timeout_s: float) -> SystemResult:
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key=os.environ.get("PAGED_CHAT_API_KEY", "none"), max_retries=0,
        timeout=timeout_s, http_client=openai.DefaultAsyncHttpxClient(
            limits=httpx.Limits(max_connections=len(workload.prompts) + 8)))
    try:
        model = (await client.models.list()).data[0]
        prompts: list[list[int]] | list[str] = workload.prompts
        if not await _takes_token_ids(client, model.id, workload.prompts[0][:1]):
            prompts = [tokenizer.decode(prompt, skip_special_tokens=False) for prompt in prompts]
        start = time.perf_counter()
        replies = await asyncio.gather(*(
            _stream(client, model.id, prompt, length)
            for prompt, length in zip(prompts, workload.output_lens)))
        wall = time.perf_counter() - start
    except openai.APIError as error:
        raise RuntimeError(f"{name}: the server failed the benchmark ({error})") from error
    finally:
        await client.close()
    ttft, tpot = per_request_timing(start, [reply.token_times for reply in replies])
    returned_ids = all(len(reply.token_ids) == reply.num_tokens for reply in replies)
    return SystemResult(name, wall, workload.num_prompt_tokens,
                        sum(reply.num_tokens for reply in replies), ttft, tpot, 0.0,
                        [reply.token_ids for reply in replies] if returned_ids else [], {
                            "peak_rss_mb": None,   # the server's memory is not this process's
                            "server_model": model.id,
                            "served_by": getattr(model, "owned_by", None) or "?",
                            "prompts_as": "token ids" if prompts is workload.prompts else "text",
                            "replies_cut_short": sum(reply.num_tokens < length for reply, length
                                                     in zip(replies, workload.output_lens)),
                        })


async def _takes_token_ids(client: openai.AsyncOpenAI, model: str, prompt: list[int]) -> bool:
    """A one-token request with a token-id prompt: True if the server took it."""
    try:
        await client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0.0)
    except openai.APIStatusError as error:
        if error.status_code not in (400, 422):
            raise
        return False
    return True


async def _stream(client: openai.AsyncOpenAI, model: str, prompt: list[int] | str,
                  max_tokens: int) -> _Reply:
    reply = _Reply()
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True})
    async with stream:
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                reply.usage_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                ids = _token_ids(choice)
                if ids is not None:
                    reply.token_ids += ids
                if ids or (ids is None and choice.text):
                    reply.token_times += [now] * (len(ids) if ids else 1)
    return reply


def _token_ids(choice: Any) -> list[int] | None:
    """The chunk's token ids where the server sends them (vLLM's `token_ids`)."""
    ids = (choice.model_extra or {}).get("token_ids")
    return list(ids) if ids is not None else None
