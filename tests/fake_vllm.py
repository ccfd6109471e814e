"""A fake vLLM server: the routes a RemoteClient reads, as vLLM names and shapes them, for a
model served under a name no local tokenizer resolves (vLLM's `--served-model-name
smollm2`). It answers every prompt with the same reply, so no test depends on what a
model says: /v1/models (with max_model_len), /v1/completions streaming (token-id prompts,
`return_token_ids`, usage in a last chunk, with `prompt_tokens_details` only when told, as
`--enable-prompt-tokens-details` does; a `priority` other than 0 refused with vLLM's 400
unless told, as `--scheduling-policy priority` does), /tokenize and /detokenize (chat messages templated
by the server), /metrics with vLLM's names. Its prefix cache is a count: the longest
prefix, in whole 16-token blocks, that an earlier prompt shares (the last token always
computed)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from helpers import wait_for
from server_fixtures import free_port

BLOCK = 16
REPLY = "Ahoy from the fake server, a reply no model wrote."


@dataclass
class FakeVllm:
    tokenizer: Any
    chat_template: str
    name: str = "smollm2"
    prompt_tokens_details: bool = False   # vLLM's --enable-prompt-tokens-details
    metrics: bool = True
    priority_scheduling: bool = False   # vLLM's --scheduling-policy priority
    max_model_len: int = 2048
    prompts: list[list[int]] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)   # per prompt, its prefix-cache hit
    # per prompt, its `priority` field (None when absent) and whether it came as token ids
    priorities: list[tuple[int | None, bool]] = field(default_factory=list)
    refused_priorities: int = 0
    running: int = 0
    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens"), 0.0))
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.server.config.port}"

    @property
    def url(self) -> str:
        return self.root + "/v1"

    def start(self) -> FakeVllm:
        self.server = uvicorn.Server(uvicorn.Config(self.app(), host="127.0.0.1", port=free_port(),
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, what="the fake vLLM to start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def cached_tokens(self, prompt: list[int]) -> int:
        shared = max((_common(prompt, earlier) for earlier in self.prompts), default=0)
        return min(shared, len(prompt) - 1) // BLOCK * BLOCK

    def reply_ids(self, max_tokens: int) -> tuple[list[int], str]:
        ids = self.tokenizer.encode(REPLY, add_special_tokens=False)
        return (ids[:max_tokens], "length") if len(ids) > max_tokens else (ids, "stop")

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        def models() -> dict:
            return {"object": "list", "data": [{
                "id": self.name, "object": "model", "owned_by": "vllm",
                "root": "/models/SmolLM2-135M-Instruct", "max_model_len": self.max_model_len}]}

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict:
            body = await request.json()
            if "messages" in body:
                text = self.tokenizer.apply_chat_template(
                    body["messages"], chat_template=self.chat_template, tokenize=False,
                    add_generation_prompt=body.get("add_generation_prompt", True))
                tokens = self.tokenizer.encode(text, add_special_tokens=body.get("add_special_tokens", False))
            else:
                tokens = self.tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
            return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}

        @app.post("/detokenize")
        async def detokenize(request: Request) -> dict:
            return {"prompt": self.tokenizer.decode((await request.json())["tokens"])}

        @app.get("/metrics")
        def metrics():
            if not self.metrics:
                return PlainTextResponse("not found", status_code=404)
            lines = [f'vllm:num_requests_running{{model_name="{self.name}"}} {self.running}',
                     f'vllm:num_requests_waiting{{model_name="{self.name}"}} 0',
                     f'vllm:kv_cache_usage_perc{{model_name="{self.name}"}} 0.25']
            for name, value in self.counters.items():
                lines += [f"# TYPE vllm:{name}_total counter", f'vllm:{name}_total{{model_name="{self.name}"}} {value}']
            return PlainTextResponse("\n".join(lines) + "\n")

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            if body.get("priority", 0) != 0 and not self.priority_scheduling:
                self.refused_priorities += 1
                return JSONResponse({"error": {
                    "message": f"Got priority {body['priority']} but Priority scheduling is "
                               "not enabled.", "type": "BadRequestError", "param": None,
                    "code": 400}}, status_code=400)
            self.priorities.append((body.get("priority"), isinstance(body["prompt"], list)))
            prompt = body["prompt"]
            prompt = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            cached = self.cached_tokens(prompt)
            self.prompts.append(prompt)
            self.cached.append(cached)
            ids, finish = self.reply_ids(body.get("max_tokens") or 16)
            self.counters["prefix_cache_queries"] += len(prompt)
            self.counters["prefix_cache_hits"] += cached
            self.counters["prompt_tokens"] += len(prompt)
            self.counters["generation_tokens"] += len(ids)
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                     "total_tokens": len(prompt) + len(ids),
                     "prompt_tokens_details": {"cached_tokens": cached} if self.prompt_tokens_details else None}
            with_usage = (body.get("stream_options") or {}).get("include_usage", False)
            return StreamingResponse(self._chunks(ids, finish, body.get("return_token_ids", False),
                                                  usage if with_usage else None),
                                     media_type="text/event-stream")

        return app

    def _chunks(self, ids: list[int], finish: str, token_ids: bool, usage: dict | None) -> Iterator[str]:
        self.running += 1
        try:
            for index, token in enumerate(ids):
                text = self.tokenizer.decode(ids[:index + 1])[len(self.tokenizer.decode(ids[:index])):]
                choice = {"index": 0, "text": text, "logprobs": None,
                          "finish_reason": finish if index == len(ids) - 1 else None}
                if token_ids:
                    choice["token_ids"] = [token]
                yield _event({"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
                              "model": self.name, "choices": [choice]})
            if usage is not None:
                yield _event({"id": "cmpl-fake", "object": "text_completion", "created": int(time.time()),
                              "model": self.name, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            self.running -= 1


def _event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _common(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length
