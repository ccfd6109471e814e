"""The OpenAI API's request and response bodies, as far as paged-chat serves them.

Requests take OpenAI's sampling names plus vLLM's extras (`top_k`, `min_p`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos`, `return_token_ids`, `cache_salt`,
`priority`); fields
neither knows are ignored, as OpenAI-compatible servers do. Types are strict, as OpenAI's
are ("2" is no integer, "yes" no boolean, true no token id; an integer is a fine float).
Type errors are pydantic's; range errors are SamplingParams' (a ValueError naming the
field); both become a 400. The output-shaping fields (response_format, structured_outputs,
logprobs) are structured_request.py's, the tools tool_calls.py's. A sampling field a
request omits takes the server's default (`defaults`: the model's generation config, else
`[chat]`), as `ask` would.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from paged_chat.engine.core.sampling_params import SamplingParams
from paged_chat.server.structured_request import (
    ChatLogprobsFields,
    CompletionLogprobsFields,
    ResponseFormat,
    StructuredOutputs,
    structured_output_fields,
)
from paged_chat.server.tool_calls import Tool, ToolCall, ToolChoice, template_tool_call

# Every request model's config: unknown fields ignored, no coercion between JSON types.
STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What chat and text completions share: the model, the sampling, streaming."""

    model_config = STRICT

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False   # vLLM's: each choice carries its token ids too
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: a prefix-cache partition
    priority: int = 0   # vLLM's: the lower served first
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, room: int, defaults: dict[str, Any] | None = None,
                        output: dict[str, Any] | None = None) -> list[SamplingParams]:
        """One SamplingParams per choice; `room` is what max_model_len leaves after the
        prompt. With a seed, choice i draws from seed + i, so the n choices differ and stay
        repeatable. `defaults` fill the sampling fields the request omits, max_tokens
        included (at most `room`; without one, `room`, as in vLLM); `output` (structured
        output, logprobs) is the caller's."""
        given = {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
            "frequency_penalty", "presence_penalty", "stop", "stop_token_ids")
            if getattr(self, name) is not None}
        defaults = dict(defaults or {})
        default_limit = min(room, defaults.pop("max_tokens", None) or room)
        max_tokens = self.token_limit if self.token_limit is not None else default_limit
        return [SamplingParams(**{**defaults, **given}, **(output or {}),
                               max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                               seed=None if self.seed is None else self.seed + choice)
                for choice in range(self.n)]

    def output_fields(self) -> dict[str, Any]:
        """The SamplingParams fields of the structured output and logprobs asked for."""
        return (structured_output_fields(self.response_format, self.structured_outputs)
                | self.logprob_fields())

    def logprob_fields(self) -> dict[str, Any]:
        return {}


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None    # an assistant's calls
    tool_call_id: str | None = None             # a tool message's: the call it answers
    reasoning_content: str | None = None        # an assistant's thinking (DeepSeek's name)
    reasoning: str | None = None                # the same, by vLLM's newer name

    def template_message(self) -> dict[str, Any]:
        """The message as a chat template takes it (a developer message is a system one;
        an assistant's thinking, by either name, is its `reasoning_content`)."""
        content = self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content or [])
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": content}
        if self.tool_calls:
            message["tool_calls"] = [template_tool_call(call) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if self.role == "assistant" and reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


class ChatCompletionRequest(ChatLogprobsFields, SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    # vLLM's: values the chat template reads, such as Qwen3's enable_thinking
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(CompletionLogprobsFields, SamplingRequest):
    """`prompt` is text or token ids (a list of one of either is taken too)."""

    prompt: str | list[int] | list[str] | list[list[int]]

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("prompt: a batch of prompts is not supported; send one per request")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("prompt: must not be empty")
        return prompt


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def envelope(object_name: str, request_id: str, model: str, choices: list[dict[str, Any]],
             usage: Usage | None = None) -> dict[str, Any]:
    """A completion or chunk body: the fields every OpenAI response object carries."""
    body = {"id": request_id, "object": object_name, "created": int(time.time()),
            "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage.model_dump()
    return body


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: a 4xx is the caller's error, typed by its kind where OpenAI
    names one, else invalid_request_error; a 5xx is a server_error."""
    named = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}
    kind = named.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
