"""What the benchmark measures besides throughput: memory scenarios (chats per KV budget,
cached vs cold system prompt, prefill per turn) and the machine's roofline."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from paged_chat.app.conversation import Conversation
from paged_chat.bench.workload import SYSTEM_PROMPT, Workload
from paged_chat.engine import Engine, EngineConfig, SamplingParams
from paged_chat.engine.core.dtypes import TORCH_DTYPES
from paged_chat.engine.models.loader import ModelSource
from paged_chat.engine.worker.threads import available_cores


def memory_scenarios(engine: Engine, source: ModelSource, workload: Workload) -> dict:
    """(a) chats that fit a KV budget, paged vs contiguous; (b) cached vs cold system
    prompt time to first token; (c) prefill per turn of a 5-turn chat."""
    block_size = engine.info.block_size
    max_model_len = 2048
    contiguous_chats = 2
    budget_blocks = contiguous_chats * max_model_len // block_size
    # Never more than budget / 2 blocks' worth of chats can be resident: submit that many.
    num_requests = budget_blocks // 2
    probe = Engine(EngineConfig(model=engine.config.model, device="cpu", dtype=engine.config.dtype,
                                block_size=block_size, num_blocks=budget_blocks,
                                max_model_len=max_model_len, max_num_seqs=num_requests,
                                max_num_batched_tokens=engine.config.max_num_batched_tokens),
                   source=source)
    for index in range(num_requests):
        length = min(workload.output_lens[index % len(workload.output_lens)], 32)
        probe.add_request(workload.prompts[index % len(workload.prompts)],
                          SamplingParams(temperature=0, max_tokens=length, ignore_eos=True))
    peak_running = 0
    while probe.has_unfinished() and probe.stats().num_preemptions == 0:
        probe.step()
        peak_running = max(peak_running, probe.stats().num_running)
    for request_id in list(probe.requests):
        probe.abort(request_id)
    probe.step()
    fit = {"kv_budget_tokens": budget_blocks * block_size, "max_model_len": max_model_len,
           "contiguous_chats": contiguous_chats, "paged_chats_resident_at_once": peak_running,
           "ratio": peak_running / contiguous_chats}

    def ttft(prompt: list[int]) -> tuple[float, int]:
        """Seconds to a prompt's first token, and how many of its tokens the cache served."""
        start = time.perf_counter()
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
        return time.perf_counter() - start, out.num_cached_tokens

    engine.reset_prefix_cache()
    cold, cold_cached_tokens = ttft(workload.prompts[0])
    warm, warm_cached_tokens = ttft(workload.prompts[1])

    conversation = Conversation(source.tokenizer, source.chat_template, SYSTEM_PROMPT)
    turns = []
    for question in ("What is a KV cache?", "Why page it?", "What is a block table?",
                     "And prefix caching?", "Summarise in one line."):
        prompt = conversation.next_prompt_ids(question)
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=48))[0]
        conversation.add_reply(prompt, out.token_ids, out.text)
        turns.append({"prompt_tokens": len(prompt), "prefilled": len(prompt) - out.num_cached_tokens})
    return {"fit": fit, "system_prompt_ttft": {"cold_s": cold, "cached_s": warm,
                                               "speedup": cold / warm,
                                               "cold_cached_tokens": cold_cached_tokens,
                                               "cached_tokens": warm_cached_tokens},
            "five_turn_chat": turns}


def roofline(engine: Engine, decode_step_s: float, batch_size: int, step_threads: int) -> dict:
    """How far a decode step is from max(weight bytes / bandwidth, FLOPs / peak), the
    machine measured on every core this process may use (its limit), whatever count of
    threads the step ran on (`step_threads`, reported beside it)."""
    cores = available_cores()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(cores)
    try:
        big = torch.empty(64 * 2**20, dtype=torch.uint8)
        target = torch.empty_like(big)
        copy_s = min(_timed(lambda: target.copy_(big)) for _ in range(5))
        size = 2048
        a = torch.randn(size, size, dtype=TORCH_DTYPES[engine.info.dtype])
        matmul_s = min(_timed(lambda: a @ a) for _ in range(5))
    finally:
        torch.set_num_threads(threads_before)
    bandwidth = 2 * big.numel() / copy_s
    peak_flops = 2 * size ** 3 / matmul_s
    params = engine.info.num_parameters
    weight_bytes = engine.info.weight_bytes or params * a.element_size()
    flops = 2 * params * batch_size
    floor = max(weight_bytes / bandwidth, flops / peak_flops)
    return {"bandwidth_gb_s": bandwidth / 1e9, "matmul_gflop_s": peak_flops / 1e9,
            "machine_threads": cores, "decode_batch": batch_size,
            "decode_step_ms": 1e3 * decode_step_s, "decode_step_threads": step_threads,
            "floor_ms": 1e3 * floor, "of_floor": floor / decode_step_s if decode_step_s else 0.0}


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def decode_step_time(engine: Engine, batch_size: int) -> tuple[float, int]:
    """The median time of a decode step at `batch_size` (200-264-token contexts) on the
    number of threads most such steps ran on, and that number (the engine's thread policy
    picks it, and tries other counts now and then)."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for index in range(batch_size):
        engine.add_request([1 + index] * 200, params)
    times: dict[int, list[float]] = {}
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        if stats.batch_size == batch_size and stats.batch_tokens == batch_size:
            times.setdefault(torch.get_num_threads(), []).append(stats.step_time_s)
    threads = max(times, key=lambda count: len(times[count]))
    return statistics.median(times[threads]), threads
