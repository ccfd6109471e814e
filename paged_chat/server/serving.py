"""Completions on an EngineClient: from a parsed request to response bodies or SSE chunks.

A request with `n` choices runs as n engine requests on the same prompt ids, so the
later ones hit the prefix cache on the prompt's full blocks (shared, not copied). Every
engine request is tagged with the API caller's owner (`user`, else "api"), so the block
map shows API traffic as its own owner next to the TUI's tabs.

API requests run under a cache salt (SamplingParams.cache_salt): the server's partition
(`cache_partition`), refined by the request's own `cache_salt` (vLLM's field). So their
prefixes never hit the blocks of requests that did not come through the API (a TUI's
tabs under `--serve`), and `cached_tokens` tells a caller nothing of another key's
prompts; callers of one key still share their prefixes (a system prompt, n choices).

Errors before the first token (a bad prompt, a dead engine) are raised before any byte
is sent, so a streaming request gets a proper HTTP status too. A stream the caller stops
reading (the client went away) closes its engine streams, which aborts their requests and
frees their blocks at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import jinja2

from paged_chat.engine.clients.protocol import EngineClient
from paged_chat.engine.request import RequestOutput, SamplingParams
from paged_chat.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                        PromptTokensDetails, SamplingRequest, Usage,
                                        completion_id, envelope)

DEFAULT_OWNER = "api"


class ApiError(Exception):
    """A request the API refuses: its HTTP status, message and the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(slots=True)
class Job:
    """One API request, ready to run: its prompt ids and one SamplingParams per choice."""

    kind: str                      # "chat.completion" or "text_completion"
    request_id: str
    owner: str
    prompt_ids: list[int]
    params: list[SamplingParams]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    finals: dict[int, RequestOutput] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def usage(self) -> Usage:
        completion = sum(len(output.token_ids) for output in self.finals.values())
        cached = min((output.num_cached_tokens for output in self.finals.values()), default=0)
        return Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=completion,
                     total_tokens=len(self.prompt_ids) + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def cache_partition(api_key: str | None, share_cache_with_tui: bool) -> str | None:
    """The cache salt of a server's API requests: one per API key (its hash: the engine
    never sees the key), one for a keyless server, or none when the user shares the cache
    of the requests that do not come through the API with the API's callers."""
    if share_cache_with_tui:
        return None
    return "api" if api_key is None else "api-key:" + hashlib.sha256(api_key.encode()).hexdigest()


class OpenAIServing:
    """Turns API requests into engine streams for one served model; `cache_partition` is
    the salt of its requests (see the module docstring)."""

    def __init__(self, client: EngineClient, model_names: Sequence[str],
                 cache_partition: str | None = None) -> None:
        assert model_names, "a server serves at least its model's own name"
        self.client = client
        self.model_names = tuple(model_names)
        self.cache_partition = cache_partition

    @property
    def model(self) -> str:
        return self.model_names[0]

    # ---- requests to jobs -------------------------------------------------------------

    def chat_job(self, request: ChatCompletionRequest) -> Job:
        self._check_model(request)
        info = self.client.info
        messages = [message.template_message() for message in request.messages]
        try:
            text = info.tokenizer.apply_chat_template(messages, chat_template=info.chat_template,
                                                      tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError as error:
            raise ApiError(400, f"the model's chat template refused the messages: {error}",
                           "messages") from error
        prompt_ids = info.tokenizer.encode(text, add_special_tokens=False)
        return self._job("chat.completion", request, prompt_ids)

    def completion_job(self, request: CompletionRequest) -> Job:
        self._check_model(request)
        prompt = request.single_prompt()
        prompt_ids = (self.client.info.tokenizer.encode(prompt, add_special_tokens=True)
                      if isinstance(prompt, str) else list(prompt))
        return self._job("text_completion", request, prompt_ids)

    def _check_model(self, request: SamplingRequest) -> None:
        if request.model is not None and request.model not in self.model_names:
            raise ApiError(404, f"The model `{request.model}` does not exist; this server "
                                f"serves `{self.model}`.", "model")

    def _job(self, kind: str, request: SamplingRequest, prompt_ids: list[int]) -> Job:
        room = self.client.info.max_model_len - len(prompt_ids)
        if room <= 0:
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this model takes at "
                                f"most {self.client.info.max_model_len} tokens, prompt and reply "
                                "together", "messages" if kind == "chat.completion" else "prompt")
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        return Job(kind, completion_id(prefix), request.user or DEFAULT_OWNER, prompt_ids,
                   self._salted(request.sampling_params(room), request.cache_salt),
                   request.stream, request.include_usage, request.return_token_ids)

    def _salted(self, params: list[SamplingParams], requested: str | None) -> list[SamplingParams]:
        """`params` under the server's partition and the request's own `cache_salt`."""
        parts = [part for part in (self.cache_partition, requested) if part is not None]
        if not parts:
            return params
        salt = "/".join(parts)  # a partition has no "/": the pair reads back one way only
        return [dataclasses.replace(choice, cache_salt=salt) for choice in params]

    # ---- running jobs -----------------------------------------------------------------

    async def outputs(self, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every choice's deltas as they come, tagged with the choice's index; closing
        the iterator aborts the choices still running."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, params: SamplingParams) -> None:
            try:
                async with aclosing(self.client.stream(job.prompt_ids, params,
                                                       request_id=f"{job.request_id}-{index}",
                                                       owner=job.owner)) as stream:
                    async for output in stream:
                        queue.put_nowait((index, output))
            except Exception as error:  # handed to the reader, who raises it
                queue.put_nowait((index, error))

        tasks = [asyncio.create_task(pump(index, params)) for index, params in enumerate(job.params)]
        try:
            while len(job.finals) < len(tasks):
                index, output = await queue.get()
                if isinstance(output, Exception):
                    raise output
                if output.finished:
                    job.finals[index] = output
                yield index, output
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def complete(self, job: Job) -> dict[str, Any]:
        """The whole response of a request that does not stream."""
        async with aclosing(self.outputs(job)) as outputs:
            async for _ in outputs:
                pass
        failed = next((output for output in job.finals.values() if output.finish_reason == "error"), None)
        if failed is not None:
            raise ApiError(500, f"the engine failed this request: {failed.error}")
        choices = [self._choice(job, index, job.finals[index].text, job.finals[index], final=True)
                   for index in range(len(job.params))]
        return envelope(job.kind, job.request_id, self.model, choices, job.usage())

    async def chunks(self, job: Job, outputs: AsyncIterator[tuple[int, RequestOutput]]
                     ) -> AsyncIterator[dict[str, Any]]:
        """The chunks of a streaming response, from the choices' deltas."""
        kind = "chat.completion.chunk" if job.chat else "text_completion"
        async with aclosing(outputs):
            if job.chat:  # OpenAI's first chunk of each choice names the role
                yield envelope(kind, job.request_id, self.model, [
                    {"index": index, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None} for index in range(len(job.params))])
            async for index, output in outputs:
                if output.finish_reason == "error":
                    raise ApiError(500, f"the engine failed this request: {output.error}")
                yield envelope(kind, job.request_id, self.model,
                               [self._choice(job, index, output.new_text, output, final=False)])
        if job.include_usage:
            yield envelope(kind, job.request_id, self.model, [], job.usage())

    @staticmethod
    def _choice(job: Job, index: int, text: str, output: RequestOutput, final: bool
                ) -> dict[str, Any]:
        reason = output.finish_reason if output.finished else None
        if job.chat:
            content = {"role": "assistant", "content": text} if final else {"content": text}
            choice = {"index": index, ("message" if final else "delta"): content}
        else:
            choice = {"index": index, "text": text}
        choice |= {"logprobs": None, "finish_reason": reason}
        if job.return_token_ids:
            choice["token_ids"] = output.token_ids if final else output.new_token_ids
        return choice

