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

A chat reply's thinking (a reasoning model's `<think>` section, or all it says after a
prompt that opened one) goes apart as `reasoning_content` and `reasoning` (vLLM's newer
name), in messages and in streamed deltas, and only where the reply had thinking.

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

from paged_chat.app.reasoning import ReasoningSplitter, SplitText, opens_thinking
from paged_chat.engine.clients.client_protocol import EngineClient
from paged_chat.engine.core.detokenizer import IncrementalDetokenizer
from paged_chat.engine.core.outputs import RequestOutput
from paged_chat.engine.core.sampling_params import SamplingParams
from paged_chat.engine.worker.structured_output import REFUSED
from paged_chat.server.api_types import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    SamplingRequest,
    Usage,
    completion_id,
    envelope,
)
from paged_chat.server.structured_request import chat_logprobs, completion_logprobs
from paged_chat.server.tool_calls import (
    DefaultToolChoice,
    ToolCallParser,
    default_tool_choice,
    forced_call_schema,
    with_tools_in_system,
)

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
    priority: int
    finals: dict[int, RequestOutput] = field(default_factory=dict)
    tool_names: set[str] | None = None     # the tools whose calls the reply may hold
    forced_tool_call: bool = False         # a grammar makes the reply one call
    parsers: dict[int, ToolCallParser] = field(default_factory=dict)  # per streamed choice
    # per streamed choice, its text so far: where completions' logprobs' text_offset counts from
    texts: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    in_thinking: bool = False              # the chat prompt opened the reply's thinking (R1)
    splitters: dict[int, ReasoningSplitter] = field(default_factory=dict)  # per streamed choice

    def split(self, index: int, text: str, output: RequestOutput, final: bool) -> tuple[SplitText, bool]:
        """A chat choice's text (whole, or this delta) as reasoning and answer; whether the
        reply has thinking (so far)."""
        splitter = (ReasoningSplitter(self.in_thinking) if final
                    else self.splitters.setdefault(index, ReasoningSplitter(self.in_thinking)))
        split = splitter.feed(text)
        if output.finished:
            rest = splitter.finish()
            split = SplitText(split.reasoning + rest.reasoning, split.answer + rest.answer)
        return split, splitter.opened

    def tool_parser(self, index: int) -> ToolCallParser | None:
        """The choice's stream parser, where the reply may hold tool calls."""
        if self.tool_names is None:
            return None
        return self.parsers.setdefault(index, ToolCallParser(self.tool_names, self.forced_tool_call))

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
    the salt of its requests (see the module docstring), `defaults` the sampling values a
    request that omits them gets, `tool_choice` the tool_choice of a request with tools
    that omits it (tool_calls.default_tool_choice)."""

    def __init__(self, client: EngineClient, model_names: Sequence[str],
                 cache_partition: str | None = None,
                 defaults: dict[str, Any] | None = None,
                 tool_choice: DefaultToolChoice = "auto") -> None:
        assert model_names, "a server serves at least its model's own name"
        self.client = client
        self.model_names = tuple(model_names)
        self.cache_partition = cache_partition
        self.defaults = dict(defaults or {})
        self.tool_choice = tool_choice

    @property
    def model(self) -> str:
        return self.model_names[0]

    # ---- requests to jobs -------------------------------------------------------------

    def chat_job(self, request: ChatCompletionRequest) -> Job:
        self._check_model(request)
        messages = [message.template_message() for message in request.messages]
        choice = request.tool_choice or default_tool_choice(messages, request.tools, self.tool_choice)
        tools = request.tools if request.tools and choice != "none" else None
        try:
            forced = forced_call_schema(tools, choice) if tools else None
        except ValueError as error:
            raise ApiError(400, str(error), "tool_choice") from error
        prompt = self._render_chat(messages, tools, request.chat_template_kwargs or {})
        prompt_ids = self.client.info.tokenizer.encode(prompt, add_special_tokens=False)
        output = request.output_fields()
        if forced is not None:  # the call's grammar replaces any response_format
            output = {**{k: v for k, v in output.items() if "logprobs" in k}, "json_schema": forced}
        job = self._job("chat.completion", request, prompt_ids, output)
        job.in_thinking = opens_thinking(prompt)
        if tools:
            job.tool_names = {tool.function.name for tool in tools}
            job.forced_tool_call = forced is not None
        return job

    def _render_chat(self, messages: list[dict[str, Any]], tools: list | None,
                     template_kwargs: dict[str, Any]) -> str:
        """The prompt text: the tools through the template's tool section, or in the system
        message where the template has none (tool_calls.py); `template_kwargs` are the
        request's values for the template (chat_template_kwargs)."""
        info = self.client.info

        def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
            try:
                return info.tokenizer.apply_chat_template(
                    messages, chat_template=info.chat_template, tools=tools, tokenize=False,
                    add_generation_prompt=True, **template_kwargs)
            except (jinja2.TemplateError, TypeError) as error:
                raise ApiError(400, f"the model's chat template refused the messages: {error}",
                               "messages") from error

        if not tools:
            return render(messages, None)
        with_section = render(messages, [tool.model_dump(exclude_none=True) for tool in tools])
        if with_section != render(messages, None):
            return with_section
        return render(with_tools_in_system(messages, tools), None)

    def completion_job(self, request: CompletionRequest) -> Job:
        self._check_model(request)
        prompt = request.single_prompt()
        prompt_ids = (self.client.info.tokenizer.encode(prompt, add_special_tokens=True)
                      if isinstance(prompt, str) else list(prompt))
        return self._job("text_completion", request, prompt_ids, request.output_fields())

    def _check_model(self, request: SamplingRequest) -> None:
        if request.model is not None and request.model not in self.model_names:
            raise ApiError(404, f"The model `{request.model}` does not exist; this server "
                                f"serves `{self.model}`.", "model")

    def _job(self, kind: str, request: SamplingRequest, prompt_ids: list[int],
             output: dict[str, Any]) -> Job:
        room = self.client.info.max_model_len - len(prompt_ids)
        if room <= 0:
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this model takes at "
                                f"most {self.client.info.max_model_len} tokens, prompt and reply "
                                "together", "messages" if kind == "chat.completion" else "prompt")
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        return Job(kind, completion_id(prefix), request.user or DEFAULT_OWNER, prompt_ids,
                   self._salted(request.sampling_params(room, self.defaults, output),
                                request.cache_salt),
                   request.stream, request.include_usage, request.return_token_ids,
                   request.priority)

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
                                                       owner=job.owner,
                                                       priority=job.priority)) as stream:
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
                if output.finish_reason == "error" and (output.error or "").startswith(REFUSED):
                    raise ApiError(400, output.error)
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

    def _choice(self, job: Job, index: int, text: str, output: RequestOutput, final: bool
                ) -> dict[str, Any]:
        reason = output.finish_reason if output.finished else None
        if job.chat:
            split, thinks = job.split(index, text, output, final)
            message, called = self._chat_content(job, index, split.answer, output, final)
            if split.reasoning or (final and thinks):
                message["reasoning_content"] = message["reasoning"] = split.reasoning
            reason = "tool_calls" if called and output.finished else reason
            choice = {"index": index, ("message" if final else "delta"): message}
        else:
            choice = {"index": index, "text": text}
        choice |= {"logprobs": self._logprobs(job, index, output, final),
                   "finish_reason": reason}
        if job.return_token_ids:
            choice["token_ids"] = output.token_ids if final else output.new_token_ids
        return choice

    @staticmethod
    def _chat_content(job: Job, index: int, text: str, output: RequestOutput, final: bool
                      ) -> tuple[dict[str, Any], bool]:
        """A chat message (final) or delta, its tool calls parsed out; whether it holds any."""
        parser = ToolCallParser(job.tool_names, job.forced_tool_call) if final and \
            job.tool_names is not None else job.tool_parser(index)
        if parser is None:
            return ({"role": "assistant", "content": text} if final else {"content": text}), False
        content, tool_call_deltas = parser.feed(text, final=output.finished)
        if final:
            message = {"role": "assistant", "content": content or None}
            if parser.calls:
                message["tool_calls"] = [call.model_dump() for call in parser.calls]
            return message, bool(parser.calls)
        delta: dict[str, Any] = {"content": content}
        if tool_call_deltas:
            delta["tool_calls"] = tool_call_deltas
        return delta, bool(parser.calls)

    def _logprobs(self, job: Job, index: int, output: RequestOutput, final: bool
                  ) -> dict[str, Any] | None:
        """The choice's logprobs object (of all its tokens, or of this delta's)."""
        if output.logprobs is None:
            return None
        params = job.params[index]
        token_ids = output.token_ids if final else output.new_token_ids
        logprobs = output.logprobs if final else output.new_logprobs or []
        tokenizer = self.client.info.tokenizer
        if job.chat:
            return chat_logprobs(tokenizer, token_ids, logprobs, params.top_logprobs)
        if final or index not in job.texts:
            job.texts[index] = IncrementalDetokenizer(tokenizer, [])
        return completion_logprobs(tokenizer, token_ids, logprobs, params.top_logprobs,
                                   job.texts[index])

