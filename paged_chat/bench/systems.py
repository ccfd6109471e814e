"""The systems the benchmark runs the workload through, each timed the same way: paged-chat
(this engine) and three Hugging Face baselines on the weights paged-chat loaded."""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from paged_chat.bench.own_thread import on_own_thread
from paged_chat.bench.workload import Workload
from paged_chat.engine import Engine, OutputProcessor, SamplingParams
from paged_chat.engine.models.loader import ModelSource

SYSTEMS = ("paged-chat", "hf-seq", "hf-static", "hf-cb")

# What each system is, in the report's words (the table is read without the README).
DESCRIPTIONS = {
    "paged-chat": "this engine: continuous batching on a paged KV cache, prefix caching",
    "hf-seq": "transformers generate, one request at a time (the notebook way)",
    "hf-static": "transformers generate on left-padded static batches of every request",
    "hf-cb": "transformers' own continuous batching (paged|eager attention)",
}


@dataclass(slots=True)
class SystemResult:
    name: str
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: list[float]
    tpot_s: list[float]
    peak_rss_mb: float
    outputs: list[list[int]] = field(repr=False)
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        ttft = sorted(self.ttft_s)
        return {
            "system": self.name,
            "output_tokens_per_s": self.output_tokens / self.wall_s,
            "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / self.wall_s,
            "mean_ttft_s": statistics.fmean(ttft),
            "p90_ttft_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "mean_tpot_ms": 1e3 * statistics.fmean(self.tpot_s) if self.tpot_s else 0.0,
            "peak_rss_mb": self.peak_rss_mb,
            "wall_s": self.wall_s,
            "output_tokens": self.output_tokens,
            **self.extra,
        }


class RssMonitor:
    """Samples this process's resident memory every 20 ms while a system runs."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> "RssMonitor":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            with open("/proc/self/statm") as statm:
                self.peak = max(self.peak, int(statm.read().split()[1]) * self._page)
            self._stop.wait(0.02)

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


def per_request_timing(start: float, token_times: list[list[float]]) -> tuple[list[float], list[float]]:
    ttft = [times[0] - start for times in token_times if times]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for times in token_times if len(times) > 1]
    return ttft, tpot


def run_paged_chat(engine: Engine, workload: Workload) -> SystemResult:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    engine.reset_prefix_cache()
    peak = {"blocks": 0, "waste": 0.0, "batch": 0}
    forward_s = step_s = 0.0
    timeline: list[tuple[float, int, int, int]] = []
    with RssMonitor() as rss:
        start = time.perf_counter()
        processor = OutputProcessor(engine.tokenizer)  # the text, as a client makes it
        ids = [engine.add_request(p, sp) for p, sp in zip(workload.prompts, params)]
        for request_id, sp in zip(ids, params):
            processor.add_request(request_id, sp)
        times: dict[str, list[float]] = {rid: [] for rid in ids}
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            outputs = processor.process(engine.step()).outputs
            now = time.perf_counter()
            for out in outputs:
                times[out.request_id].extend([now] * len(out.new_token_ids))
                if out.finished:
                    tokens[out.request_id] = out.token_ids
            stats = engine.stats()
            timeline.append((now - start, stats.blocks_in_use, stats.blocks_cached, stats.num_running))
            forward_s += stats.forward_time_s
            step_s += stats.step_time_s
            peak["batch"] = max(peak["batch"], stats.batch_size)
            if stats.blocks_in_use > peak["blocks"]:
                peak["blocks"], peak["waste"] = stats.blocks_in_use, stats.kv_waste
        wall = time.perf_counter() - start
    stats = engine.stats()
    ttft, tpot = per_request_timing(start, [times[rid] for rid in ids])
    return SystemResult("paged-chat", wall, workload.num_prompt_tokens, workload.num_output_tokens,
                        ttft, tpot, rss.peak_mb, [tokens[rid] for rid in ids], {
                            "peak_batch_size": peak["batch"],
                            "preemptions": stats.num_preemptions,
                            "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
                            "kv_waste_at_peak": peak["waste"],
                            "peak_blocks_in_use": peak["blocks"],
                            "host_overhead": 1 - forward_s / step_s if step_s else 0.0,
                            "num_blocks": engine.info.num_blocks,
                            "timeline": timeline,
                        })


class _TokenClock:
    """A transformers streamer that only records when each generated step arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def _no_eos_config(max_new_tokens: int):
    from transformers import GenerationConfig
    return GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=None, do_sample=False,
                            eos_token_id=None, pad_token_id=0)


def run_hf_seq(model, workload: Workload, requests: int | None = None) -> SystemResult:
    """The first `requests` of the workload (None: all) one after another. With fewer run,
    the rest are extrapolated: one at a time, a request takes the measured time per output
    token for each of its tokens, and waits for all before it, so its time to first token
    is the measured replies' own TTFT after that wait. `outputs` holds the run ones only."""
    count = len(workload.prompts) if requests is None else min(requests, len(workload.prompts))
    assert count >= 1
    outputs, token_times, starts = [], [], []
    with RssMonitor() as rss, torch.inference_mode():
        start = time.perf_counter()
        for prompt, length in zip(workload.prompts[:count], workload.output_lens[:count]):
            clock = _TokenClock()
            starts.append(time.perf_counter())
            out = model.generate(torch.tensor([prompt]), generation_config=_no_eos_config(length),
                                 streamer=clock)
            outputs.append(out[0, len(prompt):].tolist())
            token_times.append(clock.times)
        wall = time.perf_counter() - start
    ttft, tpot = per_request_timing(start, token_times)
    extra = {"attention": model.config._attn_implementation}
    if count < len(workload.prompts):
        per_token = wall / sum(workload.output_lens[:count])
        own_ttft = statistics.fmean(times[0] - at for times, at in zip(token_times, starts) if times)
        waited = np.cumsum([0, *workload.output_lens])[count:-1] * per_token
        ttft += [float(wait) + own_ttft for wait in waited]
        tpot += [statistics.fmean(tpot)] * len(waited) if tpot else []
        extra.update(measured_requests=count, measured_wall_s=wall)
        wall = per_token * workload.num_output_tokens
    return SystemResult("hf-seq", wall, workload.num_prompt_tokens, workload.num_output_tokens,
                        ttft, tpot, rss.peak_mb, outputs, extra)


def run_hf_static(model, workload: Workload, batch_size: int) -> SystemResult:
    outputs, token_times, slots = [], [], 0
    with RssMonitor() as rss, torch.inference_mode():
        start = time.perf_counter()
        for first in range(0, len(workload.prompts), batch_size):
            prompts = workload.prompts[first:first + batch_size]
            lengths = workload.output_lens[first:first + batch_size]
            width = max(map(len, prompts))
            input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            clock = _TokenClock()
            out = model.generate(input_ids, attention_mask=mask, streamer=clock,
                                 generation_config=_no_eos_config(max(lengths)))
            for row, length in enumerate(lengths):
                outputs.append(out[row, width:width + length].tolist())
                token_times.append(clock.times[:length])
            slots += len(prompts) * max(lengths)
        wall = time.perf_counter() - start
    ttft, tpot = per_request_timing(start, token_times)
    return SystemResult("hf-static", wall, workload.num_prompt_tokens, workload.num_output_tokens,
                        ttft, tpot, rss.peak_mb, outputs, {
                            "decode_padding_waste": 1 - workload.num_output_tokens / slots,
                            "attention": model.config._attn_implementation})


def run_hf_cb(model, workload: Workload, block_size: int, num_blocks: int, max_batch_tokens: int,
              max_seqs: int) -> SystemResult:
    from transformers import ContinuousBatchingConfig

    config = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks,
                                      max_batch_tokens=max_batch_tokens,
                                      max_requests_per_batch=max_seqs, use_cuda_graph=False)
    results = {}
    with RssMonitor() as rss, torch.inference_mode(), _quiet("ContinuousBatchingLogger"):
        start = time.perf_counter()
        with model.continuous_batching_context_manager(
                generation_config=_no_eos_config(max(workload.output_lens)),
                continuous_batching_config=config, block=True, timeout=30) as manager:
            ids = [manager.add_request(prompt, max_new_tokens=length, record_timestamps=True)
                   for prompt, length in zip(workload.prompts, workload.output_lens)]
            while len(results) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
        wall = time.perf_counter() - start
    ttft, tpot = per_request_timing(start, [results[rid].timestamps for rid in ids])
    return SystemResult("hf-cb", wall, workload.num_prompt_tokens, workload.num_output_tokens,
                        ttft, tpot, rss.peak_mb, [results[rid].generated_tokens for rid in ids],
                        {"attention": "paged|eager", "page_size": block_size, "num_blocks": num_blocks})


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    """A third-party logger's warnings kept out of the report while inside (transformers'
    continuous batching warns that EOS is off, which the benchmark sets on purpose)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_system(name: str, engine: Engine, source: ModelSource, workload: Workload,
               baseline_dtype: torch.dtype, block_size: int, max_batch_tokens: int,
               baseline_threads: int, hf_seq_requests: int | None = None) -> SystemResult:
    """Run the workload through one of SYSTEMS (hf-seq on its first `hf_seq_requests`
    only, the rest extrapolated, when given)."""
    if name == "paged-chat":
        return run_paged_chat(engine, workload)
    torch.set_num_threads(baseline_threads)  # the engine's thread policy may have changed it
    if name == "hf-cb":
        # Its steps run on transformers' own thread: built on this one, the model would leave
        # an OpenMP pool here for as long as the run (see own_thread.py).
        model = on_own_thread(lambda: build_hf_model(source, baseline_dtype, "paged|eager"))
        # Room for the whole workload twice over: it never preempts, and its own memory
        # check (which assumes a GPU-sized budget) stays satisfied.
        workload_blocks = (workload.num_prompt_tokens + workload.num_output_tokens) // block_size
        return run_hf_cb(model, workload, block_size, 2 * workload_blocks + 64, max_batch_tokens,
                         len(workload.prompts))
    # transformers' SDPA decode in bf16 is pathologically slow on CPU (~30x eager here).
    attention = "eager" if baseline_dtype is torch.bfloat16 else "sdpa"
    model = build_hf_model(source, baseline_dtype, attention)
    return (run_hf_seq(model, workload, hf_seq_requests) if name == "hf-seq"
            else run_hf_static(model, workload, len(workload.prompts)))


def build_hf_model(source: ModelSource, dtype: torch.dtype, attention: str):
    """A transformers model with exactly the weights paged-chat runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**source.hf_config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
    state = model.state_dict()
    for name in source.checkpoint.tensors:
        source.checkpoint.read_into(name, state[name])
    assert set(state) - set(source.checkpoint.tensors) <= {"lm_head.weight"}
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
