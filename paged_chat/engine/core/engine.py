"""Engine: the synchronous core. add_request / step / abort / generate / stats.

One `step()` is schedule -> KV tier transfers -> the runner's forward and sampling -> the
scheduler's update from the runner's output, and returns what that step changed per request:
new token ids and finish reasons (EngineCoreOutput), no text. Stop token ids, EOS and the
length limit end a request in the scheduler's update; text and stop strings are the client's
output processor's (output_processor.py), which `generate` runs too. Finished requests leave
at once (their blocks go back to the pool) and waiting ones join on the next step:
continuous batching.

With a KV tier (EngineConfig.kv_tier_*), finished and evicted blocks outlive the pool
and the process: `close()` (or interpreter exit) finishes the tier's queued disk writes.
Between steps the engine has `KVTransfer` do the tier's traffic the scheduler decided:
a request whose blocks the tier holds waits while they are read, off the step.

A request whose grammar is not cached waits, holding nothing, while it compiles off the
engine loop (structured_output.py): each step first admits those whose compile is done,
and fails those whose compile failed or ran past its limit.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import random
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from paged_chat.engine.core.config import EngineConfig
from paged_chat.engine.core.dtypes import dtype_name, resolve_device, resolve_dtype
from paged_chat.engine.core.ngram_proposer import NgramProposer
from paged_chat.engine.core.output_processor import OutputProcessor
from paged_chat.engine.core.outputs import EngineCoreOutput, FinishReason, ModelInfo, RequestOutput
from paged_chat.engine.core.prompt import prompt_token_ids
from paged_chat.engine.core.request import Request, RequestStatus, check_priority
from paged_chat.engine.core.sampling_params import SamplingParams
from paged_chat.engine.core.scheduler import Scheduler
from paged_chat.engine.core.stats import EngineStats, StepMetrics, snapshot
from paged_chat.engine.kv.kv_cache_manager import KVCacheManager
from paged_chat.engine.kv.tier import build_kv_tier
from paged_chat.engine.kv.transfer import KVTransfer
from paged_chat.engine.models.loader import (
    ModelSource,
    ProgressHook,
    generation_defaults,
    holds_quantized,
    load_model_source,
)
from paged_chat.engine.worker.runner import ModelRunner
from paged_chat.engine.worker.structured_output import GrammarError, StructuredOutputManager
from paged_chat.engine.worker.threads import StepThreads

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# How long a step with nothing to run (every request waiting for KV or its grammar) waits for
# a tier read, and for a grammar's compile.
_IDLE_WAIT_S = 0.01


class Engine:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None,
                 on_progress: ProgressHook | None = None, tokenizer_on_demand: bool = False
                 ) -> None:
        """`on_progress(stage, done, total)` hears how a slow start-up stage advances (a
        GGUF's first conversion; on CUDA, compiling the kernels and capturing CUDA graphs).
        Nothing of `source` but its tokenizer and config is kept.

        `tokenizer_on_demand`: the tokenizer loads only when a text prompt or a grammar
        needs it (an engine child whose app loads its own copy from
        `source.tokenizer_source.saved_folder`); `info` then has no tokenizer and no chat
        template, and EOS is the model config's, which has a GGUF's converted tokenizer's."""
        # First, so its first look at the machine's load spans the model's loading.
        self.threads = StepThreads.from_setting(config.threads)
        self.device = resolve_device(config.device)
        self.config = config = config.for_device(self.device.type)
        source = source or load_model_source(config.model, config.cache_dir, on_progress)
        self.dtype = resolve_dtype(config.dtype, self.device,
                                   holds_quantized(source, self.device, config.weights))
        self.model_name = source.name
        self.model_config = source.config
        self._tokenizer_source = source.tokenizer_source
        self.runner = ModelRunner(source, config, self.device, self.dtype, on_progress)
        loaded = self.runner.loaded
        self.block_size = config.block_size
        self.num_blocks = self.runner.num_blocks
        self.max_model_len = self.runner.max_model_len
        self.kv_cache = KVCacheManager(self.num_blocks, self.block_size,
                                       config.enable_prefix_caching,
                                       build_kv_tier(config, loaded.fingerprint,
                                                     self.runner.kv_cache),
                                       source.config.window_of_every_layer,
                                       self.runner.block_id_rows)
        self.kv_transfer = KVTransfer(self.kv_cache, self.runner)
        proposer = (NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                  config.prompt_lookup_max)
                    if config.num_speculative_tokens else None)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs,
                                   config.max_num_batched_tokens, proposer)
        self.eos_token_ids = frozenset(source.config.eos_token_ids)
        if not tokenizer_on_demand and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids |= {self.tokenizer.eos_token_id}
        self.requests = self.scheduler.requests  # every unfinished request, by id
        self._structured_output: StructuredOutputManager | None = None  # on first use
        self.metrics = StepMetrics()
        self._pending: list[EngineCoreOutput] = []
        self._ids = itertools.count()
        self._seeds = random.Random(config.seed)
        self.info = ModelInfo(
            name=self.model_name, tokenizer=None if tokenizer_on_demand else self.tokenizer,
            chat_template="" if tokenizer_on_demand else self.chat_template,
            device=self.device.type, dtype=dtype_name(self.dtype), num_blocks=self.num_blocks,
            block_size=self.block_size, max_model_len=self.max_model_len,
            num_parameters=loaded.num_parameters, weight_bytes=loaded.weight_bytes,
            weights=f"{loaded.held_formats}, {loaded.weight_bytes / 1e9:.2f} GB of weights",
            generation_defaults=generation_defaults(source))

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer_source.tokenizer

    @property
    def chat_template(self) -> str:
        return self._tokenizer_source.chat_template

    # ---- requests -------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, owner: str | None = None,
                    priority: int = 0) -> str:
        """Queue a prompt (text or token ids); return its request id.

        `request_id`, when given, is a non-empty string not in use; when not, the engine
        picks one (`req-N`) that no request in flight has, a caller's included.
        `priority`: an int, the lower served first (the scheduler's docstring says how).
        A prompt that can never fit (max_model_len, the pool) is accepted and finishes on
        the next step with finish_reason "error", so callers see one uniform stream. A
        schema, regex or choice the grammar library refuses raises GrammarError (a ValueError).
        A grammar not cached compiles off the engine loop while the request waits; a compile
        that fails or passes structured_output.COMPILE_TIMEOUT_S finishes the request with
        finish_reason "error", its error starting with structured_output.REFUSED.
        """
        params = params or SamplingParams()
        check_priority(priority)
        if request_id is not None and not (isinstance(request_id, str) and request_id):
            raise ValueError(f"request_id={request_id!r} is invalid: expected a non-empty string")
        token_ids = prompt_token_ids(prompt, self.tokenizer if isinstance(prompt, str) else None,
                                     self.model_config.vocab_size)
        if request_id is None:
            request_id = next(free for free in (f"req-{n}" for n in self._ids) if free not in self.requests)
        elif request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        grammar = pending_grammar = None
        if params.structured_spec is not None:
            grammar = self.structured_output.cached_matcher(params)
            if grammar is None:
                pending_grammar = self.structured_output.start_compile(params)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = Request(request_id, token_ids, params, seed, time.monotonic(), owner=owner,
                          priority=priority,
                          stop_token_ids=frozenset(params.stop_token_ids) | (
                              frozenset() if params.ignore_eos else self.eos_token_ids),
                          max_num_tokens=min(len(token_ids) + params.max_tokens, self.max_model_len),
                          grammar=grammar, pending_grammar=pending_grammar)
        if pending_grammar is not None:
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.scheduler.add(request)
        if len(token_ids) >= self.max_model_len:
            self._pending.append(self._finish(request, "error", (
                f"the prompt has {len(token_ids)} tokens; this engine holds at most "
                f"{self.max_model_len} per sequence (max_model_len and the KV pool), "
                "prompt and reply together")))
        return request_id

    @property
    def structured_output(self) -> StructuredOutputManager:
        """The grammar compiler for this model's tokenizer, made on first use (the first
        constrained request pays for it)."""
        if self._structured_output is None:
            self._structured_output = StructuredOutputManager(
                self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        return self._structured_output

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored."""
        request = self.requests.get(request_id)
        if request is not None:
            self._pending.append(self._finish(request, "abort"))

    def reprioritize(self, request_id: str, priority: int) -> None:
        """Serve a request at `priority` from the next step on; unknown or finished ids are
        ignored. Costs a move within one queue, nothing per token."""
        check_priority(priority)
        request = self.requests.get(request_id)
        if request is not None:
            self.scheduler.reprioritize(request, priority)

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None
                ) -> EngineCoreOutput:
        """scheduler.finish_request, the request's wait for its grammar dropped first."""
        if request.pending_grammar is not None:
            self.structured_output.drop(request.pending_grammar)
            request.pending_grammar = None
        return self.scheduler.finish_request(request, reason, error)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Queue the requests whose grammar has compiled; finish those whose compile failed
        or ran past its limit (their outputs)."""
        failed = []
        for request in list(self.scheduler.compiling):
            try:
                grammar = self.structured_output.take(request.pending_grammar)
            except GrammarError as error:
                request.pending_grammar = None  # take ended the wait
                failed.append(self.scheduler.finish_request(request, "error", str(error)))
                continue
            if grammar is not None:
                request.grammar, request.pending_grammar = grammar, None
                self.scheduler.grammar_ready(request)
        return failed

    def abort_all(self) -> None:
        """Abort every request, discarding their outputs: for a caller that has given up on
        everything in flight and has told the consumers itself (a client shutting down)."""
        for request_id in list(self.requests):
            self.abort(request_id)
        self._pending.clear()
        assert not self.scheduler.has_unfinished() and not self.kv_cache.tables

    def reset(self) -> None:
        """Abort everything (see abort_all) and forget the prefix cache: after a failed step
        or for a restart, nobody can vouch that the blocks the index names were written."""
        self.abort_all()
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; blocks in use stay as they are."""
        self.kv_cache.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def use_forward(self, forward: Callable[..., torch.Tensor]) -> None:
        """Run `forward` (the model's call signature) instead of the model: `paged-chat bench
        --host-overhead` times the engine's own work per step over a stub forward."""
        self.runner.model = forward

    def settle(self) -> None:
        """Hand the KV tier the blocks' copies still in flight (kv_transfer.settle): for a
        loop going idle, so they are kept without a step waiting for them."""
        self.kv_transfer.settle()

    def flush(self) -> None:
        """Wait until the KV tier's queued disk writes are done (kv_transfer.flush)."""
        self.kv_transfer.flush()

    def close(self) -> None:
        """Finish the KV tier's traffic and stop its threads (kv_transfer.close)."""
        self.kv_transfer.close()

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion together; return one final output per prompt, in order,
        with its text (through an OutputProcessor, as a client's: stop strings apply)."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        processor = OutputProcessor(self.tokenizer)
        ids = []
        for prompt, p in zip(prompts, params):
            ids.append(self.add_request(prompt, p))
            processor.add_request(ids[-1], p)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            processed = processor.process(self.step())
            for request_id in processed.to_abort:
                self.abort(request_id)
            final.update((out.request_id, out) for out in processed.outputs if out.finished)
        return [final[request_id] for request_id in ids]

    # ---- the step -------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduling step; return what it changed per request (finished ones
        included, and those an abort or a refused prompt finished since the last step)."""
        outputs, self._pending = self._pending, []
        started = time.perf_counter()
        if self.scheduler.compiling:
            outputs += self._admit_compiled()
        self.kv_transfer.complete_reads()
        schedule = self.scheduler.schedule() if self.scheduler.has_unfinished() else None
        self.kv_transfer.offload()  # what left the pool, before a forward can overwrite it
        self.kv_transfer.start_reads()
        if schedule is None or not schedule.scheduled:
            self.kv_transfer.wait_for_reads(_IDLE_WAIT_S)  # every request waits for KV
            if self.scheduler.compiling:  # or for its grammar
                concurrent.futures.wait([r.pending_grammar.future for r in self.scheduler.compiling],
                                        _IDLE_WAIT_S, concurrent.futures.FIRST_COMPLETED)
            self.metrics.record_step(0, 0, 0, 0, 0.0)
            self.runner.last_forward_s = 0.0
            return outputs
        policy = self.threads.for_step(decode_only=schedule.num_tokens == len(schedule.scheduled))
        threads = policy.apply()
        try:
            runner_output = self.runner.execute(schedule.scheduled)
        except Exception:
            # The scheduler indexed the blocks this step fills before the forward that should
            # have written them: forget the index, or a later request could hit unwritten
            # blocks. The requests keep their places, so a retried step redoes this work.
            self.kv_cache.reset_prefix_cache()
            self._pending = outputs + self._pending  # deltas collected before the step stay due
            raise
        update = self.scheduler.update_from_output(schedule, runner_output)
        outputs += update.outputs
        elapsed = time.perf_counter() - started
        sampled_tokens = sum(len(output.new_token_ids) for output in update.outputs)  # drafts too
        self.metrics.record_step(len(schedule.scheduled), schedule.num_tokens,
                                 update.num_prompt_tokens, sampled_tokens, elapsed)
        policy.record(threads, schedule.num_tokens, elapsed)
        self.kv_transfer.offload()  # finished requests' blocks go down now, not a step later
        return outputs

    # ---- stats ----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of the pool, the queues and the rates after the last step."""
        return snapshot(self.num_blocks, self.scheduler, self.metrics, self.runner.last_forward_s)
