"""What the engine hands out: the core's per-step outputs (ids only), the RequestOutput the
output processor builds from them, token logprobs, and what a served model is (ModelInfo)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(slots=True)
class EngineCoreOutput:
    """What one request's step changed in the core (`Engine.step`): ids and counts, no text.
    The core stops a request on its stop token ids, EOS and the length limit; text and stop
    strings are the output processor's (output_processor.py). Read-only by convention;
    not frozen and built positionally, because a step builds one per running request and a
    frozen dataclass's __init__, or keyword arguments, cost more on that path.

    `num_cached_tokens` prompt tokens were not prefilled (prefix cache hits; None where
    it is not known: a remote server that did not say); `num_tier_cached_tokens` of them
    were read back from a KV tier (host RAM or disk).
    `new_logprobs`, for a request that asks for them, has one entry per new token.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int | None
    num_tier_cached_tokens: int
    error: str | None = None
    new_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True, frozen=True)
class ModelRunnerOutput:
    """What one forward produced for the scheduler (`ModelRunner.execute`): per scheduled
    item that samples, in order, its token (for an item with drafts, the list of the drafts
    accepted and the model's next token) or the exception sampling it raised; and, when
    any of them asked, their TokenLogprobs in the same order (None for one that did not)."""

    sampled: list[int | list[int] | Exception]
    logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class TokenLogprob:
    """One sampled token's log-probability under the model's own distribution (the
    log-softmax of its logits, before penalties, the grammar mask, temperature and
    top-k/top-p/min-p), and the `top_logprobs` likeliest tokens there, best first."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class RequestOutput:
    """What one request produced in one step (a delta), or in total from `Engine.generate`,
    as a client hands it out; built by the OutputProcessor alone. Read-only by convention
    (see EngineCoreOutput for why it is not frozen).

    For a delta, `new_token_ids` and `new_text` are this step's; `token_ids` and `text` are
    everything so far. `token_ids` is the request's own list, which later steps extend in
    place (copying it per delta would cost O(output) per request per step): copy it to keep
    a snapshot. `num_cached_tokens` prompt tokens were not prefilled (prefix cache
    hits; None: not known, a remote server that did not say); `num_tier_cached_tokens` of
    them were read back from a KV tier (host RAM or disk).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int | None
    error: str | None = None
    num_tier_cached_tokens: int = 0
    new_logprobs: list[TokenLogprob] | None = None  # per new token, when the request asks
    logprobs: list[TokenLogprob] | None = None      # per token so far (extended like token_ids)


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What the app needs to know of the model an engine serves. `tokenizer` and
    `chat_template` build prompts; the pool's size (`num_blocks`, `block_size`) means
    something only where the client's capabilities say `block_map`. `weights` says what
    the weights are held as ("Q4_1+Q8_0, 0.12 GB of weights"; "" where unknown),
    `weight_bytes` the bytes they take (0 where unknown). `generation_defaults`: the
    sampling values the model's generation_config.json recommends (SamplingParams names).
    `tokenizer_from` says, for an engine elsewhere, whose tokenizer `tokenizer` is: "local"
    (a local copy of the served model's) or "the server's" (ServerTokenizer: the server
    tokenizes and templates); "" for a local engine (its own)."""

    name: str
    tokenizer: Any
    chat_template: str
    device: str
    dtype: str
    num_blocks: int
    block_size: int
    max_model_len: int
    num_parameters: int
    weights: str = ""
    weight_bytes: int = 0
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    tokenizer_from: str = ""
