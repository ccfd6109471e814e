"""OutputProcessor: the client side's turn of the core's ids into text (vLLM v1's output
processor). The core (`Engine.step`) emits per request only what changed, as
EngineCoreOutput; this is the one place a RequestOutput is built.

Per request it keeps the reply's ids and an IncrementalDetokenizer, which also spots the
request's stop strings. A stop string ends the request here, with finish_reason "stop",
and `process` names it in `to_abort`: the caller aborts it in the core, which may meanwhile
have stepped it once more. Such a request is draining until the core's own final output
for it arrives: what the core sends for it until then is dropped, so no token after the
stop string reaches a stream. A detokenizer that raises fails its request alone
(finish_reason "error"), which the core is told to abort as well.

It runs on one thread at a time (the caller holds a lock where two use it): a client's
delivery thread, or `Engine.generate`'s caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paged_chat.engine.core.detokenizer import IncrementalDetokenizer
from paged_chat.engine.core.outputs import EngineCoreOutput, RequestOutput, TokenLogprob
from paged_chat.engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(slots=True)
class _RequestState:
    detokenizer: IncrementalDetokenizer | None  # None: the text comes with the ids (process_text)
    token_ids: list[int] = field(default_factory=list)  # the reply so far, every delta's list
    text: str = ""  # the reply so far where it comes as text (process_text); else the detokenizer's
    logprobs: list[TokenLogprob] | None = None  # per token of the reply, when the request asks


@dataclass(slots=True)
class ProcessedOutputs:
    """One step's RequestOutputs, and the requests the processor finished that the core must
    abort (a stop string, or a detokenizer fault)."""

    outputs: list[RequestOutput]
    to_abort: list[str]


class OutputProcessor:
    """Open requests by id: their detokenizers and replies so far."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | Any | None) -> None:
        """`tokenizer` None: text-only, every output comes with its text (`process_text`)."""
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        # ended here (a stop string, a left stream), not yet in the core: what the core still
        # sends for it is dropped; one re-added under the same id waits here for the old one's end
        self._draining: dict[str, _RequestState | None] = {}

    def __len__(self) -> int:
        """Requests open here (draining ones not counted)."""
        return len(self._states)

    def add_request(self, request_id: str, params: SamplingParams | None) -> None:
        """Track a request the caller is adding to the core under `request_id`."""
        stop = params.stop if params is not None else []
        state = _RequestState(None if self.tokenizer is None
                              else IncrementalDetokenizer(self.tokenizer, stop))
        if params is not None and params.wants_logprobs:
            state.logprobs = []
        assert request_id not in self._states, f"request {request_id!r} is already open"
        if request_id in self._draining:
            self._draining[request_id] = state
        else:
            self._states[request_id] = state

    def abort_request(self, request_id: str) -> None:
        """Nobody reads this request any more (its stream was left): the caller is aborting
        it in the core, whose last outputs for it are dropped."""
        if self._states.pop(request_id, None) is not None:
            self._draining[request_id] = None

    def drop(self, request_id: str) -> None:
        """Forget a request the core will send nothing more for (its add failed)."""
        self._states.pop(request_id, None)
        if self._draining.get(request_id) is not None:
            self._draining[request_id] = None

    def clear(self) -> None:
        """Forget every request: the core aborted them all without a word (a failed step, a
        stop)."""
        self._states.clear()
        self._draining.clear()

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        outputs: list[RequestOutput] = []
        to_abort: list[str] = []
        for core in core_outputs:
            request_id = core.request_id
            state = self._states.get(request_id)
            if state is None:
                if core.finished and request_id in self._draining:
                    waiting = self._draining.pop(request_id)
                    if waiting is not None:
                        self._states[request_id] = waiting
                continue
            finished, reason, error = core.finished, core.finish_reason, core.error
            detokenizer = state.detokenizer
            assert detokenizer is not None, "a text-only processor takes process_text alone"
            state.token_ids += core.new_token_ids
            if state.logprobs is not None and core.new_logprobs:
                state.logprobs += core.new_logprobs
            try:
                new_text, stopped = (detokenizer.add_token(core.new_token_ids[0])
                                     if len(core.new_token_ids) == 1
                                     else detokenizer.add_tokens(core.new_token_ids))
                if finished and not stopped and reason in ("stop", "length"):
                    new_text += detokenizer.flush()
                    stopped = detokenizer.stopped  # in text held back until now (a split character)
                ended_here = stopped
                if stopped:
                    reason = "stop"
            except Exception as fault:  # one request's detokenizer must not take the batch down
                new_text, ended_here = "", True
                reason, error = "error", f"{type(fault).__name__}: {fault}"
            if ended_here and not finished:  # the core goes on with it until it hears
                finished = True
                to_abort.append(request_id)
                self._draining[request_id] = None
            if finished:
                del self._states[request_id]
            # RequestOutput's fields in order: one per running request per step (see
            # EngineCoreOutput on the cost of keywords)
            outputs.append(RequestOutput(
                request_id, core.new_token_ids, new_text, state.token_ids, detokenizer.text,
                finished, reason, core.num_prompt_tokens, core.num_cached_tokens, error,
                core.num_tier_cached_tokens, core.new_logprobs, state.logprobs))
        return ProcessedOutputs(outputs, to_abort)

    def process_text(self, core: EngineCoreOutput, new_text: str) -> RequestOutput | None:
        """For an engine that sends text but no ids (a server without vLLM's
        return_token_ids): `core`'s ids are that text encoded here, and the text is taken as
        it came (its stop strings were the server's to apply). None for a request not open."""
        state = self._states.get(core.request_id)
        if state is None:
            return None
        state.token_ids += core.new_token_ids
        state.text += new_text
        if core.finished:
            del self._states[core.request_id]
        return RequestOutput(
            core.request_id, core.new_token_ids, new_text, state.token_ids, state.text,
            core.finished, core.finish_reason, core.num_prompt_tokens, core.num_cached_tokens,
            core.error, core.num_tier_cached_tokens)
