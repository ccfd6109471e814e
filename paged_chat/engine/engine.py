"""Engine: the synchronous core. add_request / step / abort / generate / stats.

One `step()` schedules work under the token budget, runs one forward over every scheduled
token, samples, detokenizes, and returns the per-request deltas of that step. Finished
requests leave at once (their blocks go back to the pool) and waiting ones join on the
next step: continuous batching.

With a KV tier (EngineConfig.kv_tier_*), finished and evicted blocks outlive the pool
and the process: `close()` (or interpreter exit) finishes the tier's queued disk writes.
Between steps the engine has `KVTransfer` do the tier's traffic the scheduler decided:
a request whose blocks the tier holds waits while they are read, off the step.
"""

from __future__ import annotations

import itertools
import operator
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paged_chat.engine.client import ModelInfo
from paged_chat.engine.config import EngineConfig
from paged_chat.engine.detokenizer import IncrementalDetokenizer
from paged_chat.engine.dtypes import dtype_name, resolve_device, resolve_dtype
from paged_chat.engine.errors import out_of_memory
from paged_chat.engine.kv_cache_manager import KVCacheManager
from paged_chat.engine.kv_tier import build_kv_tier, model_fingerprint
from paged_chat.engine.kv_transfer import KVTransfer
from paged_chat.engine.models.loader import ModelSource, ProgressHook, load_model, load_model_source
from paged_chat.engine.request import FinishReason, Request, RequestOutput, SamplingParams
from paged_chat.engine.runner import ModelRunner
from paged_chat.engine.scheduler import Scheduler
from paged_chat.engine.stats import BlockMap, EngineStats, KVTierStats, RateMeter
from paged_chat.engine.threads import StepThreads


# How long a step with nothing to run (every request waiting for KV) waits for a tier read.
_IDLE_READ_WAIT_S = 0.01


class Engine:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None,
                 on_progress: ProgressHook | None = None) -> None:
        """`on_progress(stage, done, total)` hears how a slow start-up stage advances (a
        GGUF's first conversion; on CUDA, compiling the kernels and capturing CUDA graphs).
        Nothing of `source` but its tokenizer and config is kept."""
        self.config = config
        # First, so its first look at the machine's load spans the model's loading.
        self.threads = StepThreads.from_setting(config.threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        source = source or load_model_source(config.model, config.cache_dir, on_progress)
        self.model_name = source.name
        self.model_config = source.config
        self.tokenizer = source.tokenizer
        self.chat_template = source.chat_template
        with out_of_memory(f"loading the weights onto {self.device}", "the model does not fit; "
                           "use a smaller model or dtype, or device='cpu'"):
            model = load_model(source, self.dtype, self.device, config.cache_dir,
                               config.weight_cache_size, on_progress)
        # Before the runner packs the CPU weights: packed, they are opaque, and a tied
        # output projection is a second tensor.
        num_parameters = sum(p.numel() for p in model.parameters())
        fingerprint = model_fingerprint(dict(model.named_parameters()))
        self.runner = ModelRunner(model, source.config, config, self.device, self.dtype,
                                  on_progress)
        self.block_size = config.block_size
        self.num_blocks = self.runner.num_blocks
        self.max_model_len = self.runner.max_model_len
        self.kv_cache = KVCacheManager(self.num_blocks, self.block_size,
                                       config.enable_prefix_caching,
                                       build_kv_tier(config, fingerprint, self.runner.kv_cache),
                                       source.config.window_of_every_layer,
                                       self.runner.block_id_rows)
        self.kv_transfer = KVTransfer(self.kv_cache, self.runner)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.eos_token_ids = frozenset(source.config.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.requests: dict[str, Request] = {}
        self._decodings: dict[str, _Decoding] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self._seeds = random.Random(config.seed)
        self._prompt_rate = RateMeter()
        self._generation_rate = RateMeter()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._last_batch = (0, 0)
        self._last_step_time = 0.0
        self.info = ModelInfo(
            name=self.model_name, tokenizer=self.tokenizer, chat_template=self.chat_template,
            device=self.device.type, dtype=dtype_name(self.dtype), num_blocks=self.num_blocks,
            block_size=self.block_size, max_model_len=self.max_model_len,
            num_parameters=num_parameters)

    # ---- requests -------------------------------------------------------------------

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, owner: str | None = None) -> str:
        """Queue a prompt (text or token ids); return its request id.

        `request_id`, when given, is a non-empty string not in use; when not, the engine
        picks one (`req-N`) that no request in flight has, a caller's included.
        A prompt that can never fit (max_model_len, the pool) is accepted and finishes on
        the next step with finish_reason "error", so callers see one uniform stream.
        """
        params = params or SamplingParams()
        if request_id is not None and not (isinstance(request_id, str) and request_id):
            raise ValueError(f"request_id={request_id!r} is invalid: expected a non-empty string")
        token_ids = self._tokenize(prompt)
        if request_id is None:
            request_id = next(free for free in (f"req-{n}" for n in self._ids) if free not in self.requests)
        elif request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        request = Request(request_id, token_ids, params, seed, time.monotonic(), owner=owner)
        self.requests[request_id] = request
        self._decodings[request_id] = _Decoding(
            IncrementalDetokenizer(self.tokenizer, params.stop),
            frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids),
            min(len(token_ids) + params.max_tokens, self.max_model_len))
        if len(token_ids) >= self.max_model_len:
            self._pending.append(self._finish(request, "error", (
                f"the prompt has {len(token_ids)} tokens; this engine holds at most "
                f"{self.max_model_len} per sequence (max_model_len and the KV pool), "
                "prompt and reply together")))
        else:
            self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored."""
        request = self.requests.get(request_id)
        if request is not None:
            self._pending.append(self._finish(request, "abort"))

    def abort_all(self) -> None:
        """Abort every request, discarding their outputs: for a caller that has given up on
        everything in flight and has told the consumers itself (AsyncEngine shutting down)."""
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

    def flush(self) -> None:
        """Wait until the KV tier's queued disk writes are done (a process about to end
        leaves its chats' blocks for the next one)."""
        self.kv_transfer.offload()
        if self.kv_cache.tier is not None:
            self.kv_cache.tier.flush()

    def close(self) -> None:
        """Finish the KV tier's queued disk writes and stop its reader and writer (the
        writer also stops at exit)."""
        self.kv_transfer.close()
        if self.kv_cache.tier is not None:
            self.kv_cache.tier.close()

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion together; return one final output per prompt, in order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        ids = [self.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            final.update((out.request_id, out) for out in self.step() if out.finished)
        return [final[request_id] for request_id in ids]

    # ---- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return this step's deltas (finished ones included)."""
        outputs, self._pending = self._pending, []
        started = time.perf_counter()
        self.kv_transfer.complete_reads()
        schedule = self.scheduler.schedule() if self.scheduler.has_unfinished() else None
        self.kv_transfer.offload()  # what left the pool, before a forward can overwrite it
        self.kv_transfer.start_reads()
        if schedule is None or not schedule.scheduled:
            self.kv_transfer.wait_for_reads(_IDLE_READ_WAIT_S)  # every request waits for KV
            self._last_batch = (0, 0)
            self._last_step_time = self.runner.last_forward_s = 0.0
            return outputs
        policy = self.threads.for_step(decode_only=schedule.num_tokens == len(schedule.scheduled))
        threads = policy.apply()
        samplers = [item for item in schedule.scheduled if item.samples]
        try:
            sampled = self.runner.execute(schedule.scheduled)
        except Exception:
            # The scheduler indexed the blocks this step fills before the forward that should
            # have written them: forget the index, or a later request could hit unwritten
            # blocks. The requests keep their places, so a retried step redoes this work.
            self.kv_cache.reset_prefix_cache()
            self._pending = outputs + self._pending  # deltas collected before the step stay due
            raise
        self._prompt_rate.add(self.scheduler.update(schedule))
        now = time.monotonic()
        for item, token in zip(samplers, sampled):
            try:  # one request's fault (its sampling, its detokenizer) must not take the batch down
                if isinstance(token, Exception):
                    raise token
                outputs.append(self._append_token(item.request, token, now))
            except Exception as error:
                # Logits that are not finite may come of KV the tier restored: recompute once.
                if isinstance(token, Exception) and self.scheduler.recompute_after_fault(item.request):
                    continue
                outputs.append(self._finish(item.request, "error", f"{type(error).__name__}: {error}"))
        self._generation_rate.add(len(sampled))
        self._generation_tokens_total += len(sampled)
        self._last_batch = (len(schedule.scheduled), schedule.num_tokens)
        self._last_step_time = time.perf_counter() - started
        policy.record(threads, schedule.num_tokens, self._last_step_time)
        self.kv_transfer.offload()  # finished requests' blocks go down now, not a step later
        return outputs

    def _append_token(self, request: Request, token_id: int, now: float) -> RequestOutput:
        if request.first_token_time is None:
            request.first_token_time = now
            self._prompt_tokens_total += request.num_prompt_tokens
        request.all_token_ids.append(token_id)
        request.output_token_ids.append(token_id)
        decoding = self._decodings[request.request_id]
        detokenizer = decoding.detokenizer
        new_text, hit_stop_string = detokenizer.add_token(token_id)
        if hit_stop_string or token_id in decoding.stop_token_ids:
            reason: FinishReason = "stop"
        elif len(request.all_token_ids) >= decoding.max_num_tokens:
            reason = "length"
        else:
            # RequestOutput's fields in order: a step builds one per running request, and
            # keywords cost 2.5 times as much (0.3 ms per step at batch 256)
            return RequestOutput(
                request.request_id, [token_id], new_text, request.output_token_ids,
                detokenizer.text, False, None, len(request.prompt_token_ids),
                request.num_cached_prompt_tokens, None, request.num_tier_cached_tokens)
        if not hit_stop_string:
            new_text += detokenizer.flush()
            if detokenizer.stopped:  # in text held back until now (an unfinished character)
                reason = "stop"
        return self._finish(request, reason, new_token_ids=[token_id], new_text=new_text)

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None,
                new_token_ids: list[int] | None = None, new_text: str = "") -> RequestOutput:
        request.finish_reason = reason
        request.error = error
        self.scheduler.finish(request)
        del self.requests[request.request_id]
        text = self._decodings.pop(request.request_id).detokenizer.text
        return RequestOutput(
            request.request_id, new_token_ids or [], new_text, request.output_token_ids, text,
            True, reason, request.num_prompt_tokens, request.num_cached_prompt_tokens, error,
            request.num_tier_cached_tokens)

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt, validated: the model would index its embedding with them.

        Ids must be integers proper: `int()` would turn 3.7 into 3 and "12" into 12, bytes
        iterate as ints and True is 1, so each of those would be a different prompt than meant.
        """
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, (bytes, bytearray)):
            raise ValueError("the prompt is bytes: decode it to text, or pass token ids")
        else:
            try:
                token_ids = [_token_id(t) for t in prompt]
            except TypeError as error:
                raise ValueError("the prompt must be text or a sequence of integer token ids "
                                 f"({error})") from None
            vocab = self.model_config.vocab_size
            bad = next((t for t in token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        return token_ids

    # ---- stats ----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """A snapshot of the pool, the queues and the rates after the last step."""
        pool = self.kv_cache.pool
        ref_counts = pool.ref_counts()
        hashed = pool.hashed_mask()
        in_use = int(np.count_nonzero(ref_counts))
        cached = int(np.count_nonzero(hashed & (ref_counts == 0)))
        # The map's cells are the pool's blocks: cell i is block i + 1 (0 is the null block).
        tables = {rid: self.kv_cache.block_id_rows.of(rid) - 1 for rid in self.kv_cache.tables}
        wasted = sum(len(table) * self.block_size - self.requests[rid].num_computed_tokens
                     for rid, table in tables.items() if rid in self.requests)
        owners = {rid: self.requests[rid].owner for rid in tables if rid in self.requests}
        batch_size, batch_tokens = self._last_batch
        return EngineStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            blocks_in_use=in_use,
            blocks_cached=cached,
            blocks_free=self.num_blocks - in_use - cached,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.loading),
            num_preemptions=self.scheduler.num_preemptions,
            num_evictions=pool.num_evictions,
            batch_size=batch_size,
            batch_tokens=batch_tokens,
            prompt_tokens_per_s=self._prompt_rate.rate(),
            generation_tokens_per_s=self._generation_rate.rate(),
            prefix_cache_queried_tokens=self.scheduler.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=self.scheduler.prefix_cache_hit_tokens,
            kv_slots_wasted=wasted,
            step_time_s=self._last_step_time,
            forward_time_s=self.runner.last_forward_s,
            blocks=BlockMap.build(ref_counts, hashed, tables, owners,
                                  pool.from_tier_mask() if self.kv_cache.tier is not None else None,
                                  self.kv_cache.num_released),
            tier=self.kv_cache.tier.stats() if self.kv_cache.tier is not None else KVTierStats(),
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            blocks_freed_by_window=self.kv_cache.num_window_released,
        )


@dataclass(slots=True)
class _Decoding:
    """What the engine checks after each token of one request."""

    detokenizer: IncrementalDetokenizer
    stop_token_ids: frozenset[int]  # the request's own, and the model's EOS unless ignore_eos
    max_num_tokens: int             # prompt and output: max_tokens or max_model_len, the lower


def _token_id(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not a token id")
    return operator.index(value)
