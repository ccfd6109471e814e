"""Engine: the synchronous core. add_request / step / abort / generate / stats.

One `step()` schedules work under the token budget, runs one forward over every scheduled
token, samples, detokenizes, and returns the per-request deltas of that step. Finished
requests leave at once (their blocks go back to the pool) and waiting ones join on the
next step: continuous batching.

With a KV tier (EngineConfig.kv_tier_*), finished and evicted blocks outlive the pool
and the process: `close()` (or interpreter exit) finishes the tier's queued disk writes.
"""

from __future__ import annotations

import itertools
import math
import operator
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from paged_chat.engine.attention.backend import AttentionBackend
from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.torch_backend import TorchAttention
from paged_chat.engine.client import ModelInfo
from paged_chat.engine.config import EngineConfig
from paged_chat.engine.detokenizer import IncrementalDetokenizer
from paged_chat.engine.dtypes import dtype_name, resolve_dtype
from paged_chat.engine.errors import PagedChatError
from paged_chat.engine.kv_cache_manager import KVCacheManager, longest_sequence
from paged_chat.engine.kv_tier import TIER_DIR, KVTier, TierLayout, model_fingerprint
from paged_chat.engine.models.llama import LlamaForCausalLM
from paged_chat.engine.models.loader import (
    ModelSource,
    ProgressHook,
    load_model,
    load_model_source,
)
from paged_chat.engine.models.model_config import ModelConfig
from paged_chat.engine.request import FinishReason, Request, RequestOutput, SamplingParams
from paged_chat.engine.runner import ModelRunner
from paged_chat.engine.sampler import SamplingBatch, sample
from paged_chat.engine.scheduler import Scheduler
from paged_chat.engine.stats import BlockMap, EngineStats, KVTierStats, RateMeter
from paged_chat.engine.threads import StepThreads

_DEFAULT_CPU_KV_FRACTION = 0.2
_DEFAULT_CPU_KV_CAP = 2 * 2**30
_CPU_ALLOCATION_FAILURE = "can't allocate memory"
_DEFAULT_CUDA_TIER_HOST_BYTES = 2 * 2**30


class Engine:
    def __init__(self, config: EngineConfig, source: ModelSource | None = None,
                 on_progress: ProgressHook | None = None) -> None:
        """`on_progress(stage, done, total)` hears how a slow start-up stage advances (a
        GGUF's first conversion; on CUDA, compiling the kernels and capturing CUDA graphs).
        Nothing of `source` but its tokenizer and config is kept."""
        self.config = config
        # First, so its first look at the machine's load spans the model's loading.
        self.threads = StepThreads.from_setting(config.threads)
        self.device = _resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        source = source or load_model_source(config.model, config.cache_dir, on_progress)
        self.model_name = source.name
        self.model_config = source.config
        self.tokenizer = source.tokenizer
        self.chat_template = source.chat_template
        model_len = min(config.max_model_len or source.config.max_position_embeddings,
                        source.config.max_position_embeddings)
        with _out_of_memory(f"loading the weights onto {self.device}", "the model does not fit; "
                            "use a smaller model or dtype, or device='cpu'"):
            model = load_model(source, self.dtype, self.device, config.cache_dir,
                                config.weight_cache_size, on_progress, config.weights)
        # Packing makes the weights opaque, and a tied output projection a second tensor.
        num_parameters = model.num_weights()
        weight_bytes = model.weight_bytes()
        weights = f"{model.held_formats()}, {weight_bytes / 1e9:.2f} GB of weights"
        fingerprint = model_fingerprint(model.weight_tensors())
        if self.device.type == "cpu":
            model.pack_for_cpu()
        self.block_size = config.block_size
        attention = self._attention(source.config)
        with _out_of_memory("profiling a step to size the KV cache",
                            "lower max_num_batched_tokens (the largest step)"):
            self.num_blocks = config.num_blocks or self._size_kv_pool(model, attention, model_len)
        # A request can never outgrow the pool: it is the one bound nothing can preempt. With
        # a sliding window on every layer the pool holds only the window of each request.
        window = source.config.window_of_every_layer
        longest = longest_sequence(self.num_blocks, self.block_size, window,
                                   config.max_num_batched_tokens)
        self.max_model_len = model_len if longest is None else min(model_len, longest)
        model.build_rope_tables(self.max_model_len)
        kv_cache = self._allocate_kv_cache(attention)
        self.runner = ModelRunner(model, kv_cache, self.block_size, attention)
        if attention.compiles_kernels and self.device.type == "cuda":
            self.warm_up(on_progress)
            if not config.enforce_eager:
                self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len,
                                                  on_progress or _no_progress)
        self.kv_cache = KVCacheManager(self.num_blocks, self.block_size,
                                       config.enable_prefix_caching,
                                       self._kv_tier(fingerprint, kv_cache), self.runner, window)
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
            num_parameters=num_parameters, weights=weights, weight_bytes=weight_bytes)

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
        self.kv_cache.pool.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def use_forward(self, forward: Callable[..., torch.Tensor]) -> None:
        """Run `forward` (the model's call signature) instead of the model: `paged-chat bench
        --host-overhead` times the engine's own work per step over a stub forward."""
        self.runner.model = forward

    def flush(self) -> None:
        """Wait until the KV tier's queued disk writes are done (a process about to end
        leaves its chats' blocks for the next one)."""
        if self.kv_cache.tier is not None:
            self.kv_cache.tier.flush()

    def close(self) -> None:
        """Finish the KV tier's queued disk writes and stop its writer (also done at exit)."""
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
        if not self.scheduler.has_unfinished():
            self._last_batch = (0, 0)
            self._last_step_time = self.runner.last_forward_s = 0.0
            return outputs
        started = time.perf_counter()
        schedule = self.scheduler.schedule()
        policy = self.threads.for_step(decode_only=schedule.num_tokens == len(schedule.scheduled))
        threads = policy.apply()
        samplers = [item for item in schedule.scheduled if item.samples]
        tables = self.kv_cache.block_id_rows.array(
            [item.request.request_id for item in schedule.scheduled])
        try:
            sampled = self.runner.execute(schedule.scheduled, tables)
        except Exception:
            # The scheduler indexed the blocks this step fills before the forward that should
            # have written them: forget the index, or a later request could hit unwritten
            # blocks. The requests keep their places, so a retried step redoes this work.
            self.kv_cache.pool.reset_prefix_cache()
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
                outputs.append(self._finish(item.request, "error", f"{type(error).__name__}: {error}"))
        self._generation_rate.add(len(sampled))
        self._generation_tokens_total += len(sampled)
        self._last_batch = (len(schedule.scheduled), schedule.num_tokens)
        self._last_step_time = time.perf_counter() - started
        policy.record(threads, schedule.num_tokens, self._last_step_time)
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
        self.scheduler.finish(request)
        request.finish_reason = reason
        request.error = error
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
        tables = {rid: self.kv_cache.block_id_rows.of(rid) for rid in self.kv_cache.tables}
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
            num_waiting=len(self.scheduler.waiting),
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

    # ---- set-up ---------------------------------------------------------------------

    def warm_up(self, on_progress: ProgressHook | None = None) -> None:
        """Compile every kernel variant this configuration can reach before serving, so none
        compiles mid-chat (a pause of a second or more each on a GPU).

        The Triton kernels take the split count and the sliding window at run time, so a
        launch's variant depends only on its kind (decode or prefill) and on whether a
        split merge runs; two steps reach them all: the largest prefill the token budget
        allows, and one decode at the longest context (split when a GPU would split it).
        """
        report = on_progress or _no_progress
        longest, budget = self.max_model_len, min(self.config.max_num_batched_tokens,
                                                  self.max_model_len)
        steps = [([budget], [budget]), ([1], [longest])]
        report("compiling kernels", 0, len(steps))
        for done, (query_lens, seq_lens) in enumerate(steps, 1):
            self.runner.run_dummy_step(query_lens, seq_lens)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            report("compiling kernels", done, len(steps))

    def _attention(self, model: ModelConfig) -> AttentionBackend:
        """Triton kernels on CUDA when triton imports ("auto"), else the torch reference.

        The Triton backend is imported here, not at module level: triton is an optional extra,
        and TRITON_INTERPRET (the CPU interpreter the tests use) is read when kernels are
        defined, so they must not be defined before a test has set it.
        """
        backend = self.config.attention_backend
        args = (model.num_heads, model.num_kv_heads, model.head_dim)
        scale = model.attention_scale
        if backend == "torch" or (backend == "auto" and self.device.type != "cuda"):
            return TorchAttention(*args, scale=scale)
        try:
            from paged_chat.engine.attention.triton_backend import TritonAttention
        except ImportError as error:
            if backend == "auto":
                return TorchAttention(*args, scale=scale)
            raise PagedChatError(f"attention_backend='triton' needs triton ({error}): install "
                                 "paged-chat[gpu], or use attention_backend='torch'") from error
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise PagedChatError("attention_backend='triton' runs on CUDA (on CPU only under "
                                 "TRITON_INTERPRET=1, for tests): use device='cuda' or "
                                 "attention_backend='torch'")
        return TritonAttention(*args, scale=scale)

    def _kv_tier(self, fingerprint: bytes, kv_cache: torch.Tensor) -> KVTier | None:
        """The host and disk KV tiers the config asks for, or None (they need the prefix cache)."""
        config = self.config
        host_bytes = config.kv_tier_host_bytes
        if host_bytes is None:
            host_bytes = _DEFAULT_CUDA_TIER_HOST_BYTES if self.device.type == "cuda" else 0
        disk_dir = Path(config.cache_dir) / TIER_DIR if config.cache_dir else None
        wanted = host_bytes or (disk_dir and config.kv_tier_disk_bytes)
        if not config.enable_prefix_caching or not wanted:
            return None
        num_layers, _, kv_heads, _, block_size, head_dim = kv_cache.shape
        layout = TierLayout(fingerprint, self.dtype,
                            (num_layers, 2, kv_heads, block_size, head_dim))
        return KVTier(layout, host_bytes, disk_dir, config.kv_tier_disk_bytes,
                      pin_memory=self.device.type == "cuda")

    def _bytes_per_block(self, attention: AttentionBackend) -> int:
        layer = math.prod(attention.kv_cache_shape(1, self.block_size))
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.model_config.num_layers * layer * element

    def _allocate_kv_cache(self, attention: AttentionBackend) -> torch.Tensor:
        """The KV pool, allocated once, here, at exactly the bytes its sizing counted: the
        engine never allocates KV memory past its budget afterwards. When it does not fit,
        the error names the setting that sized it."""
        nbytes = self.num_blocks * self._bytes_per_block(attention)
        setting = ("num_blocks" if self.config.num_blocks is not None
                   else "gpu_memory_utilization" if self.device.type == "cuda"
                   else "kv_cache_memory")
        size = f"{self.num_blocks} blocks, {nbytes / 2**30:.2f} GiB"
        ram = _available_ram()
        if self.device.type == "cpu" and nbytes > ram:  # zeroing it would wake the OOM killer
            raise PagedChatError(f"the KV cache ({size}) is larger than this machine's "
                                 f"{ram / 2**30:.1f} GiB of available RAM: lower {setting}")
        with _out_of_memory(f"allocating the KV cache ({size})", f"lower {setting}"):
            kv_cache = torch.zeros((self.model_config.num_layers, 2,
                                    *attention.kv_cache_shape(self.num_blocks, self.block_size)),
                                   dtype=self.dtype, device=self.device)
        assert kv_cache.nbytes == nbytes, "the KV layout is not linear in num_blocks"
        return kv_cache

    def _size_kv_pool(self, model: LlamaForCausalLM, attention: AttentionBackend,
                      model_len: int) -> int:
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget(model, attention, model_len)
        elif self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = min(int(available * _DEFAULT_CPU_KV_FRACTION), _DEFAULT_CPU_KV_CAP)
        num_blocks = budget // self._bytes_per_block(attention)
        if num_blocks < 1:
            raise PagedChatError(f"the KV cache budget ({budget} bytes) holds no block: "
                                 "raise kv_cache_memory or gpu_memory_utilization")
        return int(num_blocks)

    def _cuda_kv_budget(self, model: LlamaForCausalLM, attention: AttentionBackend,
                        model_len: int) -> int:
        """Profile the largest step this config allows (a full token budget of prefill, logits
        for max_num_seqs rows, then the sampler at its worst over them) against a scratch
        cache; the pool gets what `kv_budget` leaves of the card after that."""
        tokens = min(self.config.max_num_batched_tokens, model_len)
        blocks = -(-tokens // self.block_size)
        scratch = torch.zeros((self.model_config.num_layers, 2,
                               *attention.kv_cache_shape(blocks, self.block_size)),
                              dtype=self.dtype, device=self.device)
        model.build_rope_tables(tokens)
        meta = AttentionMetadata.build([tokens], [tokens], [list(range(blocks))], self.block_size,
                                       self.device)
        rows = torch.arange(min(self.config.max_num_seqs, tokens), device=self.device)
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            logits = model(torch.zeros_like(meta.positions), meta.positions, scratch, meta,
                           attention, rows)
            sample(torch.zeros_like(logits), _worst_case_sampling(len(rows), logits.shape[-1],
                                                                  self.device))
        torch.cuda.synchronize(self.device)
        step_peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch, meta, logits
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = kv_budget(total, free, step_peak, self.config.gpu_memory_utilization)
        if budget <= 0:
            raise PagedChatError(
                f"gpu_memory_utilization={self.config.gpu_memory_utilization} leaves no room for "
                f"the KV cache: {(total - free) / 2**30:.1f} GiB of the card are in use (weights, "
                f"CUDA context, other processes) and a {tokens}-token step takes "
                f"{step_peak / 2**30:.1f} GiB more; raise it, or lower max_num_batched_tokens "
                "or max_num_seqs")
        return budget


# Kept free for the allocator's fragmentation and what the profile does not see (cuBLAS
# workspaces, Triton's loaded modules, a CUDA graph pool): a share of the card.
_FRAGMENTATION_SLACK = 0.03


def kv_budget(total: int, free: int, step_peak: int, utilization: float) -> int:
    """Bytes for the KV pool on a card of `total` bytes with `free` free now (so the weights,
    the CUDA context and other processes' memory are counted, not only this process's
    tensors), when a step needs `step_peak` bytes beyond that at its worst, and the process
    may use `utilization` of the card in all."""
    assert 0 < utilization < 1
    in_use = total - free
    return int(total * utilization) - in_use - step_peak - int(total * _FRAGMENTATION_SLACK)


@dataclass(slots=True)
class _Decoding:
    """What the engine checks after each token of one request."""

    detokenizer: IncrementalDetokenizer
    stop_token_ids: frozenset[int]  # the request's own, and the model's EOS unless ignore_eos
    max_num_tokens: int             # prompt and output: max_tokens or max_model_len, the lower


def _worst_case_sampling(rows: int, vocab_size: int, device: torch.device) -> SamplingBatch:
    """Every filter and penalty on for every row, so `sample` makes all its [rows, vocab]
    buffers; with uniform logits top-p's nucleus spans the vocabulary (its largest sort)."""
    params = SamplingParams(temperature=0.7, top_p=0.95, top_k=vocab_size // 2, min_p=1e-9,
                            repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1)
    return SamplingBatch.build(params=[params] * rows, seeds=list(range(rows)),
                               output_indices=[1] * rows, token_histories=[[0, 1]] * rows,
                               prompt_lens=[1] * rows, vocab_size=vocab_size, device=device)


def _no_progress(stage: str, done: int, total: int) -> None:
    """A ProgressHook that hears nothing."""


@contextmanager
def _out_of_memory(doing: str, advice: str) -> Iterator[None]:
    """Turn an out-of-memory error at start-up into one line that says what to change."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as error:
        # On the CPU, torch's allocator reports a failure as a plain RuntimeError.
        if not isinstance(error, torch.OutOfMemoryError) and _CPU_ALLOCATION_FAILURE not in str(error):
            raise
        raise PagedChatError(f"out of memory while {doing}: {advice}") from error


def _token_id(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not a token id")
    return operator.index(value)


def _available_ram() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), which is
    what a new allocation can count on; total RAM where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as meminfo:
            line = next(line for line in meminfo if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise PagedChatError("device='cuda' but torch sees no CUDA device: use device='cpu'")
    return torch.device(device)
