"""RemoteClient: the EngineClient over an OpenAI-compatible server (vLLM, SGLang,
llama.cpp's server, Ollama's /v1, another `paged-chat serve`), through the `openai` client.

Prompts. A ChatSession keeps the exact token ids of its chat and submits prompt ids, so
the server's prefix cache sees the same ids turn after turn. They go to /v1/completions
as a token-id prompt, which vLLM, SGLang and paged-chat take. A server that refuses
token-id prompts (a 400 or 422 on the first one) is sent the ids decoded back to text by
the local tokenizer from then on (it re-tokenizes them; the prefix cache still matches
where the tokenizations agree). A server that refuses vLLM's sampling extras (`top_k`,
`min_p`, ..., as `transformers serve` does) gets OpenAI's fields only from then on. A
priority other than 0 goes as vLLM's `priority`; a server that refuses it by name (vLLM
without `--scheduling-policy priority`) gets none from then on. Reply
ids come from the server when it returns them (vLLM's `return_token_ids`), and the output
processor turns them into text as it does for a local engine; else they come from encoding
the reply's text locally, and the text is the server's. Streams are streams.py's, as for a
local engine: leaving one early (or `abort`) closes its HTTP stream, which makes the server
abort the request.

The tokenizer and chat template are the served model's: a local copy where one matches,
from `model` (a spec: alias, .gguf, HF folder, cached hub id; the app passes --model or
[engine] model) or else the first model id the server lists that resolves locally. Where
the server has vLLM's /tokenize, a local candidate matches only if it encodes a probe text
as the server does. With no local match, the server's own (ServerTokenizer: /tokenize and
/detokenize, the server templating the messages) and the reply's text is the server's;
`info.tokenizer_from` and `capabilities.where` say which. Neither is a RemoteEngineError
saying to pass --model: without a tokenizer a chat cannot keep its token ids.

Cached prompt tokens. The stream asks for usage (`stream_options.include_usage`): its
`prompt_tokens_details.cached_tokens`, where the server sends it (vLLM only with
`--enable-prompt-tokens-details`), is the request's `num_cached_tokens`. Else, while this
client has that one request open, the rise of /metrics' prefix-cache hits over the request;
else None (not known, never a made-up 0).

Stats. `stats()` never waits on the network: it returns the last scrape of the server's
/metrics and schedules the next one on the running event loop (at most every
`stats_interval_s`). Where the server speaks vLLM's metric names, running/waiting,
preemptions, prefix-cache queries/hits and prompt/generation tokens (totals, and per second
from counter deltas) fill the EngineStats, and `reported_kv_cache_usage` the KV usage. The
capabilities say there is no block map (num_blocks 0, an empty BlockMap), and `metrics`
whether the last scrape found vLLM's names. `running` is False after shutdown and while the
server cannot be reached (the last scrape of /metrics could not connect; a stream the server
drops fails that stream alone).

Errors (connection refused, a 401, a server that drops mid-stream) are RemoteEngineError
with one line; a turn that fails mid-reply keeps what came (ChatSession marks it "error").
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

from paged_chat.engine.clients.client_protocol import ClientCapabilities
from paged_chat.engine.clients.engine_loop import Abort, Add, Command
from paged_chat.engine.clients.server_tokenizer import PROBE_TEXT, ServerTokenizer
from paged_chat.engine.clients.streams import Streams
from paged_chat.engine.core.errors import ModelLoadError, PagedChatError
from paged_chat.engine.core.output_processor import OutputProcessor
from paged_chat.engine.core.outputs import EngineCoreOutput, ModelInfo, RequestOutput
from paged_chat.engine.core.sampling_params import SamplingParams
from paged_chat.engine.core.stats import BlockMap, EngineStats

# What each EngineStats field reads from /metrics: vLLM's names, then older vLLM's.
_GAUGES = {"num_running": ("vllm:num_requests_running",),
           "num_waiting": ("vllm:num_requests_waiting",),
           "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")}
_COUNTERS = {"num_preemptions": ("vllm:num_preemptions",),
             "prefix_cache_queried_tokens": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
             "prefix_cache_hit_tokens": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
             "prompt_tokens": ("vllm:prompt_tokens",),
             "generation_tokens": ("vllm:generation_tokens",)}


class RemoteEngineError(PagedChatError):
    """The server could not be reached, refused the request, or dropped the stream."""


@dataclass(slots=True)
class _Scrape:
    """One reading of /metrics: vLLM's values by EngineStats field, and when it was taken."""

    values: dict[str, float]
    taken_at: float


class RemoteClient:
    """An EngineClient whose engine is an OpenAI-compatible server at `url` (…/v1 or the
    server's root). A local GGUF's tokenizer is read from its converted copy under
    `cache_dir` where one is saved (and saved there otherwise)."""

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = 600.0, stats_interval_s: float = 1.0,
                 cache_dir: Path | None = None) -> None:
        self.base_url = url.rstrip("/").removesuffix("/v1") + "/v1"
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.stats_interval_s = stats_interval_s
        self.last_error: str | None = None
        self._has_metrics = False
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: openai.AsyncOpenAI | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._streams = Streams()
        self._pumps: dict[str, asyncio.Task] = {}  # per open request: the task reading its stream
        self._ids = 0
        self._token_prompts = True    # False once the server refused a token-id prompt
        self._vllm_extras = True      # False once it refused vLLM's sampling fields
        self._priorities = True       # False once it refused a `priority`
        self._scrapes: list[_Scrape] = []
        self._scraping: asyncio.Task | None = None
        self._reachable = True        # False while the server cannot be reached
        self._sends_cached = False    # True once the server's usage said its cached tokens
        self._cache_dir = cache_dir
        served = self._served_models()
        self.model = model if model in served else served[0]
        self.info = self._model_info(served, model)
        self._text_only = isinstance(self.info.tokenizer, ServerTokenizer)  # text from the server
        self._processor = OutputProcessor(None if self._text_only else self.info.tokenizer)
        self._stats = self._empty_stats()
        self._record_scrape(self._get("/metrics", required=False))

    # ---- set-up -----------------------------------------------------------------------

    def _get(self, path: str, required: bool = True) -> str | None:
        url = self.base_url.removesuffix("/v1") + path if path == "/metrics" else self.base_url + path
        try:
            response = httpx.get(url, headers=self._headers, timeout=30.0)
        except httpx.HTTPError as error:
            raise RemoteEngineError(f"cannot reach the server at {self.base_url} ({error})") from error
        if response.status_code == 401:
            raise RemoteEngineError(f"the server at {self.base_url} refused the API key (401): "
                                    "set --api-key or [server] api_key")
        if response.status_code != 200:
            if required:
                raise RemoteEngineError(f"{url} answered {response.status_code}: {response.text[:200]}")
            return None
        return response.text

    def _served_models(self) -> list[str]:
        """The server's model ids; also notes its max_model_len where it says (vLLM does)."""
        try:
            entries = json.loads(self._get("/models"))["data"]
            models = [entry["id"] for entry in entries]
        except (ValueError, KeyError, TypeError) as error:
            raise RemoteEngineError(f"{self.base_url}/models is not an OpenAI model list ({error})") from error
        if not models:
            raise RemoteEngineError(f"the server at {self.base_url} serves no model")
        self._max_model_len = entries[0].get("max_model_len")
        return models

    def _model_info(self, served: list[str], model: str | None) -> ModelInfo:
        """A local tokenizer that matches the served model, else the server's own."""
        from paged_chat.engine.models.loader import load_model_source

        root = self.base_url.removesuffix("/v1")
        server_tokenizer = ServerTokenizer.probe(root, self.model, self._headers)
        expected = server_tokenizer.encode(PROBE_TEXT, add_special_tokens=False) if server_tokenizer else None
        tried: list[str] = []
        for spec in dict.fromkeys(([model] if model else []) + served):
            try:
                source = load_model_source(spec, self._cache_dir)
            except ModelLoadError:
                tried.append(f"{spec} (not found here)")
                continue
            if expected is not None and source.tokenizer.encode(PROBE_TEXT, add_special_tokens=False) != expected:
                tried.append(f"{spec} (tokenizes otherwise)")
                continue
            if server_tokenizer is not None:
                server_tokenizer.close()
            return self._info(source.tokenizer, source.chat_template, "local",
                              self._max_model_len or source.config.max_position_embeddings)
        if server_tokenizer is not None:
            max_len = self._max_model_len or server_tokenizer.max_model_len
            if max_len is None:
                raise RemoteEngineError(f"the server at {self.base_url} says no max_model_len")
            return self._info(server_tokenizer, "", "the server's", int(max_len))
        raise RemoteEngineError(
            f"no local tokenizer for the server's model (tried {', '.join(tried)}) and the "
            "server has no vLLM /tokenize: pass --model with a local copy of it (alias, .gguf, "
            "HF folder or cached hub id)")

    def _info(self, tokenizer: Any, chat_template: str, tokenizer_from: str, max_len: int) -> ModelInfo:
        return ModelInfo(name=self.model, tokenizer=tokenizer, chat_template=chat_template,
                         device="remote", dtype="remote", num_blocks=0, block_size=0,
                         max_model_len=max_len, num_parameters=0, tokenizer_from=tokenizer_from)

    # ---- EngineClient -----------------------------------------------------------------

    @property
    def running(self) -> bool:
        """False after shutdown, and while the server cannot be reached."""
        return self._streams.stopped is None and self._reachable

    @property
    def capabilities(self) -> ClientCapabilities:
        """No block map (the server's pool is its own); metrics while /metrics speaks vLLM's."""
        return ClientCapabilities(block_map=False, metrics=self._has_metrics,
                                  where=f"remote at {httpx.URL(self.base_url).netloc.decode()} "
                                        f"({self.info.tokenizer_from} tokenizer)")

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
               request_id: str | None = None, owner: str | None = None, priority: int = 0
               ) -> AsyncIterator[RequestOutput]:
        """The reply's deltas as the server streams them; stop early (or `abort`) and the
        HTTP stream is closed, which makes the server abort the request."""
        self._ids += 1
        request_id = request_id or f"remote-{self._ids}"
        return self._streams.stream(Add(request_id, prompt, params, owner, priority), self._send)

    def abort(self, request_id: str) -> None:
        """Close the request's HTTP stream; its stream ends with finish_reason "abort"."""
        pump = self._pumps.get(request_id)
        if pump is not None:
            pump.cancel()

    def stats(self) -> EngineStats:
        self._schedule_scrape()
        return self._stats

    def reset_prefix_cache(self) -> None:
        """A remote server's cache is its own: nothing to do from here."""

    def shutdown(self) -> None:
        for pump in list(self._pumps.values()):
            pump.cancel()
        if self._text_only:
            self.info.tokenizer.close()
        self._processor.clear()
        self._streams.end("the remote engine client has shut down")

    # ---- streaming --------------------------------------------------------------------

    def _send(self, command: Command) -> None:
        """A stream's commands, on its event loop: its Add starts the task that reads the
        HTTP stream; its Abort (left early) closes that."""
        if isinstance(command, Add):
            self._processor.add_request(command.request_id, command.params)
            self._pumps[command.request_id] = asyncio.get_running_loop().create_task(
                self._pump(command))
        elif isinstance(command, Abort):
            self._processor.abort_request(command.request_id)
            self.abort(command.request_id)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.info.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def _openai(self) -> openai.AsyncOpenAI:
        """One client per event loop (its connections belong to the loop that opened them)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "none",
                                              timeout=self.timeout_s, max_retries=0)
            self._client_loop = loop
        return self._client

    async def _pump(self, add: Add) -> None:
        """Read the HTTP stream into the request's stream; it ends with a final output (an
        aborted one when cancelled) or an exception."""
        request_id, params = add.request_id, add.params or SamplingParams()
        streaming = as_text = False
        prompt_ids: list[int] | None = None
        last: tuple[EngineCoreOutput, str | None] | None = None  # held for the usage after it
        cached: int | None = None
        try:
            prompt_ids = self._prompt_ids(add.prompt)  # a bad prompt raises as it is
            hits_before = await self._prefix_hits() if self._counts_by_metrics() else None
            started = self._ids
            async for chunk in self._chunks(add.prompt, prompt_ids, params, add.owner, add.priority):
                cached = _cached_tokens(chunk, cached)
                for choice in chunk.choices:
                    streaming = True
                    as_text = self._text_only or getattr(choice, "token_ids", None) is None
                    core = self._core_output(request_id, prompt_ids, choice)
                    text = choice.text or "" if as_text else None
                    if core.finished:
                        last = core, text
                    elif self._deliver(core, text):
                        return
            if last is None:
                raise RemoteEngineError(f"the server at {self.base_url} ended the stream before "
                                        "the reply finished")
            self._sends_cached = self._sends_cached or cached is not None
            if cached is None and hits_before is not None and self._ids == started and len(self._pumps) == 1:
                hits_after = await self._prefix_hits()
                cached = None if hits_after is None else max(int(hits_after - hits_before), 0)
            core, text = last
            self._deliver(EngineCoreOutput(request_id, core.new_token_ids, True, core.finish_reason,
                                           core.num_prompt_tokens, cached, 0), text)
        except asyncio.CancelledError:
            self._deliver(EngineCoreOutput(request_id, [], True, "abort", len(prompt_ids or ()),
                                           None, 0), "" if as_text else None)
            raise
        except Exception as error:
            self._processor.drop(request_id)
            self._streams.fail([request_id], error if prompt_ids is None else
                               _remote_error(error, self.base_url, streaming))
        finally:
            self._pumps.pop(request_id, None)
            if not self._pumps and self._client is not None:
                # Its keep-alive connections belong to this loop, which may end next (each
                # `ask` runs one): closed here, they do not leak past it.
                client, self._client = self._client, None
                await client.close()

    def _core_output(self, request_id: str, prompt_ids: list[int], choice: Any) -> EngineCoreOutput:
        new_ids = getattr(choice, "token_ids", None)
        if new_ids is None:  # a server that does not return ids: the tokenizer's
            text = choice.text or ""
            new_ids = self.info.tokenizer.encode(text, add_special_tokens=False) if text else []
        reason = _finish_reason(choice.finish_reason)
        return EngineCoreOutput(request_id, list(new_ids), reason is not None, reason,
                                len(prompt_ids), None, 0)

    def _deliver(self, core: EngineCoreOutput, text: str | None) -> bool:
        """Hand one output to its stream: with `text` None, text from the ids (the output
        processor's), else the server's `text`. True once the request is over here: finished,
        or ended by a stop string the server did not apply (its HTTP stream is then closed)."""
        if text is not None:
            output = self._processor.process_text(core, text)
            self._streams.deliver([output] if output is not None else [])
            return core.finished
        processed = self._processor.process([core])
        for request_id in processed.to_abort:  # no core to abort it in: its end is here
            self._processor.process([EngineCoreOutput(request_id, [], True, "abort",
                                                      core.num_prompt_tokens, 0, 0)])
        self._streams.deliver(processed.outputs)
        return core.finished or bool(processed.to_abort)

    async def _chunks(self, prompt: str | Sequence[int], prompt_ids: list[int],
                      params: SamplingParams, owner: str | None, priority: int
                      ) -> AsyncIterator[Any]:
        while True:
            as_text = isinstance(prompt, str) or not self._token_prompts
            sends_priority = priority != 0 and self._priorities and self._vllm_extras
            try:
                stream = await self._create(self.info.tokenizer.decode(prompt_ids) if as_text
                                            else prompt_ids, params, owner,
                                            priority if sends_priority else None)
                break
            except openai.APIStatusError as error:
                if error.status_code not in (400, 422) or (as_text and not self._vllm_extras):
                    raise
                if sends_priority and "priority" in _error_message(error).lower():
                    self._priorities = False    # no priority scheduling there
                elif as_text:
                    self._vllm_extras = False   # a strict server: OpenAI's fields only
                else:
                    self._token_prompts = False  # this server takes text prompts only
        async with stream:
            async for chunk in stream:
                yield chunk

    async def _create(self, prompt: str | list[int], params: SamplingParams, owner: str | None,
                      priority: int | None) -> Any:
        extra = {"top_k": params.top_k, "min_p": params.min_p,
                 "repetition_penalty": params.repetition_penalty, "ignore_eos": params.ignore_eos,
                 "stop_token_ids": params.stop_token_ids, "return_token_ids": True,
                 "stream_options": {"include_usage": True}} if self._vllm_extras else {}
        if priority is not None:
            extra["priority"] = priority
        if (spec := params.structured_spec) is not None:  # vLLM's name, which serve takes too
            kind, value = spec
            extra["structured_outputs"] = {"json": json.loads(value or '{"type": "object"}')
                                           if kind.startswith("json") else None,
                                           "regex": value if kind == "regex" else None,
                                           "choice": json.loads(value) if kind == "choice" else None}
        return await self._openai().completions.create(
            model=self.model, prompt=prompt, stream=True, max_tokens=params.max_tokens,
            temperature=params.temperature, top_p=params.top_p, seed=params.seed,
            frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
            stop=params.stop or None, user=owner or openai.NOT_GIVEN, extra_body=extra)

    # ---- /metrics ---------------------------------------------------------------------

    def _schedule_scrape(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside an event loop: keep the last scrape
            return
        due = not self._scrapes or time.monotonic() - self._scrapes[-1].taken_at >= self.stats_interval_s
        if due and (self._scraping is None or self._scraping.done()):
            self._scraping = loop.create_task(self._scrape())

    async def _scrape(self) -> None:
        self._record_scrape(await self._metrics_text())

    async def _metrics_text(self) -> str | None:
        """/metrics' text; None where it answers no 200 or cannot be reached (which
        `running` and `last_error` then say)."""
        url = self.base_url.removesuffix("/v1") + "/metrics"
        try:
            async with httpx.AsyncClient(timeout=10.0) as client:
                response = await client.get(url, headers=self._headers)
            self.last_error, self._reachable = None, True
        except httpx.HTTPError as error:
            self.last_error = f"cannot reach the server at {self.base_url} ({error})"
            self._reachable = False
            return None
        return response.text if response.status_code == 200 else None

    def _counts_by_metrics(self) -> bool:
        """Whether a request's cached tokens are read off /metrics: the server has not said
        them in its usage so far, it has vLLM's counters, and this is the one request open."""
        return not self._sends_cached and self._has_metrics and len(self._pumps) == 1

    async def _prefix_hits(self) -> float | None:
        text = await self._metrics_text()
        return _vllm_values(text).get("prefix_cache_hit_tokens") if text else None

    def _record_scrape(self, text: str | None) -> None:
        values = _vllm_values(text) if text else {}
        self._has_metrics = bool(values)
        if not values:
            return
        scrape = _Scrape(values, time.monotonic())
        self._scrapes = [*self._scrapes[-1:], scrape]
        previous = self._scrapes[0]
        elapsed = scrape.taken_at - previous.taken_at

        def rate(name: str) -> float:
            gained = values.get(name, 0.0) - previous.values.get(name, 0.0)
            return max(gained, 0.0) / elapsed if elapsed > 0 else 0.0

        counts = {name: int(values.get(name, 0)) for name in
                  ("num_running", "num_waiting", "num_preemptions",
                   "prefix_cache_queried_tokens", "prefix_cache_hit_tokens")}
        self._stats = self._empty_stats(**counts, prompt_tokens_per_s=rate("prompt_tokens"),
                                        generation_tokens_per_s=rate("generation_tokens"),
                                        prompt_tokens_total=int(values.get("prompt_tokens", 0)),
                                        generation_tokens_total=int(values.get("generation_tokens", 0)),
                                        reported_kv_cache_usage=values.get("kv_cache_usage"))

    @staticmethod
    def _empty_stats(**values: Any) -> EngineStats:
        fields = dict(num_blocks=0, block_size=0, blocks_in_use=0, blocks_cached=0,
                      blocks_free=0, num_running=0, num_waiting=0, num_preemptions=0,
                      num_evictions=0, batch_size=0, batch_tokens=0, prompt_tokens_per_s=0.0,
                      generation_tokens_per_s=0.0, prefix_cache_queried_tokens=0,
                      prefix_cache_hit_tokens=0, kv_slots_wasted=0, step_time_s=0.0,
                      forward_time_s=0.0)
        empty = np.zeros(0, dtype=np.int32)
        blocks = BlockMap.build(empty, np.zeros(0, dtype=bool), {}, {})
        return EngineStats(**{**fields, **values}, blocks=blocks)


def _vllm_values(text: str) -> dict[str, float]:
    """The EngineStats fields that /metrics text gives, summed over label sets (one per
    model, or per engine in a data-parallel vLLM)."""
    try:
        families = {family.name: family for family in text_string_to_metric_families(text)}
    except ValueError:  # not Prometheus text
        return {}
    values: dict[str, float] = {}
    for table in (_GAUGES, _COUNTERS):
        for field_name, names in table.items():
            family = next((families[name] for name in names if name in families), None)
            if family is not None:
                values[field_name] = sum(sample.value for sample in family.samples
                                         if sample.name in (family.name, family.name + "_total"))
    return values


def _cached_tokens(chunk: Any, known: int | None) -> int | None:
    """A chunk's `usage.prompt_tokens_details.cached_tokens` (the last chunk's, where the
    stream includes usage), else what an earlier chunk said."""
    details = getattr(getattr(chunk, "usage", None), "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None)
    return known if cached is None else int(cached)


def _finish_reason(reason: str | None) -> Any:
    return None if reason is None else reason if reason in ("stop", "length", "abort", "error") else "stop"


def _remote_error(error: Exception, url: str, streaming: bool) -> RemoteEngineError:
    """One line for what went wrong talking to the server (`streaming`: after a reply began)."""
    if isinstance(error, RemoteEngineError):
        return error
    if streaming and isinstance(error, (httpx.HTTPError, openai.APIError)):
        return RemoteEngineError(f"the server at {url} dropped the stream mid-reply "
                                 f"({error.__cause__ or error})")
    if isinstance(error, openai.AuthenticationError):
        return RemoteEngineError(f"the server at {url} refused the API key (401): set --api-key "
                                 "or [server] api_key")
    if isinstance(error, openai.APIConnectionError):
        return RemoteEngineError(f"cannot reach the server at {url} ({error.__cause__ or error})")
    if isinstance(error, openai.APIStatusError):
        return RemoteEngineError(f"the server at {url} answered {error.status_code}: "
                                 f"{_error_message(error)}")
    if isinstance(error, (httpx.HTTPError, openai.APIError)):
        return RemoteEngineError(f"the server at {url} failed the request ({error})")
    return RemoteEngineError(f"talking to the server at {url} failed: {type(error).__name__}: {error}")


def _error_message(error: openai.APIStatusError) -> str:
    body = error.body if isinstance(error.body, dict) else {}
    inner = body.get("error", body) if isinstance(body.get("error", body), dict) else body
    return str(inner.get("message") or error.message)

