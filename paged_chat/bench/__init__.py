"""`paged-chat bench`: one seeded chat workload through paged-chat and the Hugging Face
baselines, side by side in one process, with ratios (these machines are noisy: the
ratios from one run are what counts).

Systems:
- paged-chat: this engine, as configured.
- hf-seq: transformers `generate`, one request at a time (the notebook baseline).
- hf-static: transformers `generate` on left-padded static batches.
- hf-cb: transformers' own continuous batching (`paged|eager` attention), with an explicit
  ContinuousBatchingConfig so it never sizes its cache from system RAM.

All of them run the same weights (the HF models are built from the tensors paged-chat
loaded), the same dtype and threads, greedy with EOS ignored, so they produce the same
number of tokens. Every request arrives at time 0: time to first token counts the wait.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from paged_chat.bench.contention import busy_processes, contention_table, format_contention
from paged_chat.bench.host_overhead import format_host_overhead, host_overhead
from paged_chat.chat import Conversation
from paged_chat.engine import Engine, EngineConfig, SamplingParams
from paged_chat.engine.models.loader import ModelSource, load_model_source

SYSTEMS = ("paged-chat", "hf-seq", "hf-static", "hf-cb")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

SYSTEM_PROMPT = (
    "You are Atlas, a patient and precise assistant for a small engineering team. Answer in "
    "plain English, in short paragraphs, and prefer concrete examples over abstractions. When "
    "a question is ambiguous, state the assumption you make before answering. When you give "
    "code, keep it short, runnable and commented only where the reason is not obvious. When "
    "you do not know something, say so and suggest how the user could find out. Never invent "
    "references, numbers or quotes. Keep a friendly, calm tone, avoid jargon unless the user "
    "uses it first, and finish with one practical next step the user can take today. If the "
    "question touches safety, health or money, add a one-line note that the user should check "
    "with a qualified person. Use lists only when the order of steps matters, and never write "
    "more than five items in a list. Quote units with every number, prefer metric units, and "
    "round sensibly. If the user writes in another language, answer in that language. When "
    "the user shares an error message, first explain what it means in one sentence, then give "
    "the most likely cause and the fix, and only then mention rarer causes. When comparing "
    "tools, name the trade-off that matters most for a small team."
)
TOPICS = ("caching", "compilers", "databases", "operating systems", "networking", "GPUs",
          "compression", "cryptography", "version control", "testing", "type systems",
          "garbage collection", "file systems", "scheduling", "memory allocators", "hashing")
FORMS = ("Explain {} to a new engineer.", "What are common mistakes people make with {}?",
         "Give me a short history of {}.", "How would you teach {} in one afternoon?")


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    system_prompt_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def chat_workload(source: ModelSource, num_chats: int, min_output: int, max_output: int,
                  seed: int) -> Workload:
    """N chats sharing one system prompt, one distinct question each, chat-templated."""
    rng = random.Random(seed)
    questions = [form.format(topic) for form in FORMS for topic in TOPICS]
    rng.shuffle(questions)
    prompts = []
    for index in range(num_chats):
        question = questions[index % len(questions)]
        if index >= len(questions):
            question += f" (variant {index // len(questions)})"
        conversation = Conversation(source.tokenizer, source.chat_template, SYSTEM_PROMPT)
        prompts.append(conversation.next_prompt_ids(question))
    system_ids = Conversation(source.tokenizer, source.chat_template, SYSTEM_PROMPT).next_prompt_ids("")
    shared = next((i for i, pair in enumerate(zip(*prompts, system_ids)) if len(set(pair)) > 1),
                  len(system_ids))
    return Workload(prompts, [rng.randint(min_output, max_output) for _ in range(num_chats)], shared)


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


def _per_request_timing(start: float, token_times: list[list[float]]) -> tuple[list[float], list[float]]:
    ttft = [times[0] - start for times in token_times if times]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for times in token_times if len(times) > 1]
    return ttft, tpot


def run_paged_chat(engine: Engine, workload: Workload) -> SystemResult:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    engine.kv_cache.pool.reset_prefix_cache()
    peak = {"blocks": 0, "waste": 0.0, "batch": 0}
    forward_s = step_s = 0.0
    timeline: list[tuple[float, int, int, int]] = []
    with RssMonitor() as rss:
        start = time.perf_counter()
        ids = [engine.add_request(p, sp) for p, sp in zip(workload.prompts, params)]
        times: dict[str, list[float]] = {rid: [] for rid in ids}
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                times[out.request_id].extend([now] * len(out.new_token_ids))
                if out.finished:
                    tokens[out.request_id] = out.token_ids
            stats = engine.stats()
            timeline.append((now - start, stats.blocks_in_use, stats.blocks_cached, stats.num_running))
            forward_s += engine.runner.last_forward_s
            step_s += stats.step_time_s
            peak["batch"] = max(peak["batch"], stats.batch_size)
            if stats.blocks_in_use > peak["blocks"]:
                peak["blocks"], peak["waste"] = stats.blocks_in_use, stats.kv_waste
        wall = time.perf_counter() - start
    stats = engine.stats()
    ttft, tpot = _per_request_timing(start, [times[rid] for rid in ids])
    return SystemResult("paged-chat", wall, workload.num_prompt_tokens, workload.num_output_tokens,
                        ttft, tpot, rss.peak_mb, [tokens[rid] for rid in ids], {
                            "peak_batch_size": peak["batch"],
                            "preemptions": stats.num_preemptions,
                            "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
                            "kv_waste_at_peak": peak["waste"],
                            "peak_blocks_in_use": peak["blocks"],
                            "host_overhead": 1 - forward_s / step_s if step_s else 0.0,
                            "num_blocks": engine.num_blocks,
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


def run_hf_seq(model, workload: Workload) -> SystemResult:
    outputs, token_times = [], []
    with RssMonitor() as rss, torch.inference_mode():
        start = time.perf_counter()
        for prompt, length in zip(workload.prompts, workload.output_lens):
            clock = _TokenClock()
            out = model.generate(torch.tensor([prompt]), generation_config=_no_eos_config(length),
                                 streamer=clock)
            outputs.append(out[0, len(prompt):].tolist())
            token_times.append(clock.times)
        wall = time.perf_counter() - start
    ttft, tpot = _per_request_timing(start, token_times)
    return SystemResult("hf-seq", wall, workload.num_prompt_tokens, workload.num_output_tokens,
                        ttft, tpot, rss.peak_mb, outputs, {"attention": model.config._attn_implementation})


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
    ttft, tpot = _per_request_timing(start, token_times)
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
    with RssMonitor() as rss, torch.inference_mode():
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
    ttft, tpot = _per_request_timing(start, [results[rid].timestamps for rid in ids])
    return SystemResult("hf-cb", wall, workload.num_prompt_tokens, workload.num_output_tokens,
                        ttft, tpot, rss.peak_mb, [results[rid].generated_tokens for rid in ids],
                        {"attention": "paged|eager", "page_size": block_size, "num_blocks": num_blocks})


def build_hf_model(source: ModelSource, dtype: torch.dtype, attention: str):
    """A transformers model with exactly the weights paged-chat runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**source.hf_config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
    missing, unexpected = model.load_state_dict(source.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def memory_scenarios(engine: Engine, source: ModelSource, workload: Workload) -> dict:
    """(a) chats that fit a KV budget, paged vs contiguous; (b) cached vs cold system
    prompt time to first token; (c) prefill per turn of a 5-turn chat."""
    block_size = engine.block_size
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

    def ttft(prompt: list[int]) -> float:
        start = time.perf_counter()
        request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished():
            engine.step()
        del request
        return time.perf_counter() - start

    engine.kv_cache.pool.reset_prefix_cache()
    cold = ttft(workload.prompts[0])
    warm = ttft(workload.prompts[1])

    conversation = Conversation(source.tokenizer, source.chat_template, SYSTEM_PROMPT)
    turns = []
    for question in ("What is a KV cache?", "Why page it?", "What is a block table?",
                     "And prefix caching?", "Summarise in one line."):
        prompt = conversation.next_prompt_ids(question)
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=48))[0]
        conversation.add_reply(prompt, out.token_ids, out.text)
        turns.append({"prompt_tokens": len(prompt), "prefilled": len(prompt) - out.num_cached_tokens})
    return {"fit": fit, "system_prompt_ttft": {"cold_s": cold, "cached_s": warm,
                                               "speedup": cold / warm},
            "five_turn_chat": turns}


def roofline(engine: Engine, decode_step_s: float, batch_size: int) -> dict:
    """How far a decode step is from max(weight bytes / bandwidth, FLOPs / peak)."""
    big = torch.empty(64 * 2**20, dtype=torch.uint8)
    target = torch.empty_like(big)
    copy_s = min(_timed(lambda: target.copy_(big)) for _ in range(5))
    bandwidth = 2 * big.numel() / copy_s
    size = 2048
    a = torch.randn(size, size, dtype=engine.dtype)
    matmul_s = min(_timed(lambda: a @ a) for _ in range(5))
    peak_flops = 2 * size ** 3 / matmul_s
    params = sum(p.numel() for p in engine.runner.model.parameters())
    weight_bytes = params * a.element_size()
    flops = 2 * params * batch_size
    floor = max(weight_bytes / bandwidth, flops / peak_flops)
    return {"bandwidth_gb_s": bandwidth / 1e9, "matmul_gflop_s": peak_flops / 1e9,
            "decode_batch": batch_size, "decode_step_ms": 1e3 * decode_step_s,
            "floor_ms": 1e3 * floor, "of_floor": floor / decode_step_s if decode_step_s else 0.0}


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


@dataclass(slots=True)
class BenchOptions:
    model: str = "smollm2-135m"
    num_chats: int = 32
    min_output: int = 32
    max_output: int = 256
    dtype: str = "bfloat16"
    baseline_dtype: str | None = None
    threads: int = 2
    systems: tuple[str, ...] = SYSTEMS
    seed: int = 0
    block_size: int = 16
    max_num_batched_tokens: int = 512
    scenarios: bool = True
    roofline: bool = False
    contention: int = 0             # busy processes beside a second run of every system
    contention_bound_s: float = 600.0  # the busy processes stop by themselves after this
    engine_threads: int | None = None  # paged-chat's EngineConfig.threads (None: adapt)
    host_overhead: bool = False

    @classmethod
    def quick(cls, **overrides) -> "BenchOptions":
        return cls(**{"num_chats": 8, "min_output": 16, "max_output": 48, **overrides})


def run_bench(options: BenchOptions, log: Callable[[str], None] = print) -> dict:
    unknown = set(options.systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown system(s) {sorted(unknown)}: choose from {', '.join(SYSTEMS)}")
    torch.set_num_threads(options.threads)
    source = load_model_source(options.model)
    workload = chat_workload(source, options.num_chats, options.min_output, options.max_output,
                             options.seed)
    log(f"workload: {len(workload.prompts)} chats, {workload.num_prompt_tokens} prompt tokens "
        f"({workload.system_prompt_tokens} shared), {workload.num_output_tokens} output tokens")
    engine = Engine(EngineConfig(model=options.model, device="cpu", dtype=options.dtype,
                                 block_size=options.block_size, max_num_seqs=options.num_chats,
                                 max_num_batched_tokens=options.max_num_batched_tokens,
                                 threads=options.engine_threads),
                    source=source)
    engine.generate([workload.prompts[0]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    baseline_dtype = _DTYPES[options.baseline_dtype or options.dtype]
    results: list[SystemResult] = []
    for name, busy in [(name, busy) for name in options.systems
                       for busy in sorted({0, options.contention})]:
        log(f"running {name}" + (f" beside {busy} busy processes" if busy else "") + " ...")
        with busy_processes(busy, options.contention_bound_s):
            results.append(_run_system(name, engine, source, workload, options, baseline_dtype))
        if busy:
            results[-1].name = f"{name} +{busy} busy"
        gc.collect()
        log(f"  {results[-1].output_tokens / results[-1].wall_s:.1f} output tokens/s")
    report = {"options": asdict(options), "workload": {
        "chats": len(workload.prompts), "prompt_tokens": workload.num_prompt_tokens,
        "shared_system_prompt_tokens": workload.system_prompt_tokens,
        "output_tokens": workload.num_output_tokens},
        "systems": [r.summary() for r in results]}
    reference = next((r for r in results if r.name == "hf-seq"), None)
    for result, summary in zip(results, report["systems"]):
        if reference is not None:
            summary["vs_hf_seq"] = summary["output_tokens_per_s"] / reference.summary()["output_tokens_per_s"]
            summary["same_tokens_as_hf_seq"] = sum(
                a == b for a, b in zip(result.outputs, reference.outputs)) / len(reference.outputs)
    if options.contention:
        report["contention"] = contention_table(report["systems"], options.contention)
    if options.scenarios:
        log("running memory scenarios ...")
        report["scenarios"] = memory_scenarios(engine, source, workload)
    if options.roofline:
        log("measuring the machine ...")
        step = _decode_step_time(engine, options.num_chats)
        report["roofline"] = roofline(engine, step, options.num_chats)
    if options.host_overhead:
        log("measuring the engine's host time over a stub forward ...")
        report["host_overhead"] = host_overhead(source)
    return report


def _run_system(name: str, engine: Engine, source: ModelSource, workload: Workload,
                options: BenchOptions, baseline_dtype: torch.dtype) -> SystemResult:
    if name == "paged-chat":
        return run_paged_chat(engine, workload)
    torch.set_num_threads(options.threads)  # the engine's thread policy may have changed it
    if name == "hf-cb":
        model = build_hf_model(source, baseline_dtype, "paged|eager")
        # Room for the whole workload twice over: it never preempts, and its own memory
        # check (which assumes a GPU-sized budget) stays satisfied.
        workload_blocks = (workload.num_prompt_tokens + workload.num_output_tokens) // options.block_size
        return run_hf_cb(model, workload, options.block_size, 2 * workload_blocks + 64,
                         options.max_num_batched_tokens, options.num_chats)
    # transformers' SDPA decode in bf16 is pathologically slow on CPU (~30x eager here).
    attention = "eager" if baseline_dtype is torch.bfloat16 else "sdpa"
    model = build_hf_model(source, baseline_dtype, attention)
    return (run_hf_seq(model, workload) if name == "hf-seq"
            else run_hf_static(model, workload, options.num_chats))


def _decode_step_time(engine: Engine, batch_size: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for index in range(batch_size):
        engine.add_request([1 + index] * 200, params)
    times = []
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats()
        if stats.batch_size == batch_size and stats.batch_tokens == batch_size:
            times.append(stats.step_time_s)
    return statistics.median(times)


def format_report(report: dict) -> str:
    columns = [("system", "{}"), ("output_tokens_per_s", "{:.1f}"), ("total_tokens_per_s", "{:.1f}"),
               ("mean_ttft_s", "{:.2f}"), ("p90_ttft_s", "{:.2f}"), ("mean_tpot_ms", "{:.1f}"),
               ("peak_rss_mb", "{:.0f}"), ("vs_hf_seq", "{:.2f}x")]
    rows = [[name for name, _ in columns]]
    for summary in report["systems"]:
        rows.append([fmt.format(summary[name]) if name in summary else "-" for name, fmt in columns])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    paged = next((s for s in report["systems"] if s["system"] == "paged-chat"), None)
    if paged:
        lines.append(f"paged-chat: peak batch {paged['peak_batch_size']}, preemptions "
                     f"{paged['preemptions']}, prefix-cache hit tokens {paged['prefix_cache_hit_tokens']}, "
                     f"KV waste at peak {100 * paged['kv_waste_at_peak']:.2f}%, host overhead "
                     f"{100 * paged['host_overhead']:.1f}% of step time")
    static = next((s for s in report["systems"] if s["system"] == "hf-static"), None)
    if static:
        lines.append(f"hf-static: {100 * static['decode_padding_waste']:.0f}% of decode slots are padding")
    if "contention" in report:
        lines.append(format_contention(report["contention"]))
    if "host_overhead" in report:
        lines.append(format_host_overhead(report["host_overhead"]))
    if "scenarios" in report:
        fit = report["scenarios"]["fit"]
        ttft = report["scenarios"]["system_prompt_ttft"]
        lines.append(f"KV budget of {fit['kv_budget_tokens']} tokens: contiguous at max_model_len "
                     f"{fit['max_model_len']} holds {fit['contiguous_chats']} chats, paged held "
                     f"{fit['paged_chats_resident_at_once']} at once ({fit['ratio']:.1f}x)")
        lines.append(f"new chat, system prompt cold {1e3 * ttft['cold_s']:.0f} ms vs cached "
                     f"{1e3 * ttft['cached_s']:.0f} ms to first token ({ttft['speedup']:.1f}x)")
        turns = ", ".join(f"{t['prefilled']}/{t['prompt_tokens']}"
                          for t in report["scenarios"]["five_turn_chat"])
        lines.append(f"5-turn chat, tokens prefilled / in prompt per turn: {turns}")
    if "roofline" in report:
        roof = report["roofline"]
        lines.append(f"machine: {roof['bandwidth_gb_s']:.0f} GB/s, {roof['matmul_gflop_s']:.0f} "
                     f"GFLOP/s; decode step at batch {roof['decode_batch']}: "
                     f"{roof['decode_step_ms']:.1f} ms vs floor {roof['floor_ms']:.1f} ms "
                     f"({100 * roof['of_floor']:.0f}% of the machine's limit)")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Output tokens/s per system, and paged-chat's KV blocks over time, as one PNG."""
    try:
        import matplotlib
    except ImportError as error:
        raise RuntimeError("--plot needs matplotlib: pip install 'paged-chat[bench]'") from error
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (bars, occupancy) = pyplot.subplots(1, 2, figsize=(12, 4.5))
    systems = report["systems"]
    bars.bar([s["system"] for s in systems], [s["output_tokens_per_s"] for s in systems],
             color=["#d9534f" if s["system"] == "paged-chat" else "#8c8c8c" for s in systems])
    bars.set_ylabel("output tokens/s")
    options = report["options"]
    bars.set_title(f"{report['workload']['chats']} concurrent chats: paged-chat {options['dtype']}, "
                   f"baselines {options['baseline_dtype'] or options['dtype']}")
    paged = next((s for s in systems if s["system"] == "paged-chat"), None)
    if paged:
        times, in_use, cached, running = zip(*paged["timeline"])
        occupancy.stackplot(times, in_use, cached, labels=["in use", "cached"],
                            colors=["#d9534f", "#f0ad4e"])
        occupancy.set_ylim(0, max(max(in_use) + max(cached), 1) * 1.1)
        occupancy.set_xlabel("seconds")
        occupancy.set_ylabel("KV blocks")
        occupancy.set_title(f"paged-chat KV pool ({paged['num_blocks']} blocks)")
        running_axis = occupancy.twinx()
        running_axis.plot(times, running, color="#337ab7", label="running")
        running_axis.set_ylabel("running requests")
        occupancy.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as out:
        json.dump(report, out, indent=2)
