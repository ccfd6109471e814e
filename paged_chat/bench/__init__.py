"""`paged-chat bench`: one seeded chat workload through paged-chat and the Hugging Face
baselines, side by side in one process, with ratios (these machines are noisy: the
ratios from one run are what counts).

Systems:
- paged-chat: this engine, as configured.
- hf-seq: transformers `generate`, one request at a time (the notebook baseline); with
  `hf_seq_requests` (`--quick`: 2) only the first ones, the rest extrapolated.
- hf-static: transformers `generate` on left-padded static batches.
- hf-cb: transformers' own continuous batching (`paged|eager` attention), with an explicit
  ContinuousBatchingConfig so it never sizes its cache from system RAM.
- openai:URL: any OpenAI-compatible server (llama-server, vLLM, Ollama, paged-chat serve)
  over HTTP, on its own weights (`openai_server`).

All of them run the same weights (the HF models are built from the tensors paged-chat
loaded), the same dtype and threads, greedy with EOS ignored, so they produce the same
number of tokens. Every request arrives at time 0: time to first token counts the wait.

The package: `workload` (the seeded chats), `systems` (paged-chat and the baselines, each
timed the same way), `scenarios` (memory scenarios, roofline), `report` (table, plot,
JSON). Here: `prepare_bench` (the workload and a warmed-up engine) and `run_systems`, which
the harnesses under benchmarks/ reuse, and `run_bench`, which puts everything together.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from paged_chat.bench.openai_server import is_openai_system, run_openai_server
from paged_chat.bench.own_thread import on_own_thread
from paged_chat.bench.scenarios import decode_step_time, memory_scenarios, roofline
from paged_chat.bench.systems import SYSTEMS, SystemResult, run_system
from paged_chat.bench.tier_resume import tier_resume
from paged_chat.bench.workload import SYSTEM_PROMPT, Workload, chat_workload
from paged_chat.engine import Engine, EngineConfig, SamplingParams
from paged_chat.engine.core.dtypes import dtype_name, resolve_dtype
from paged_chat.engine.models.loader import ModelSource, load_model_source


@dataclass(slots=True)
class BenchOptions:
    model: str = "smollm2-135m"
    num_chats: int = 32
    min_output: int = 32
    max_output: int = 256
    dtype: str = "auto"                 # paged-chat's, as it ships unless set
    baseline_dtype: str | None = None   # the HF baselines' (None: as `dtype`; "auto": their best)
    threads: int = 2
    systems: tuple[str, ...] = SYSTEMS
    seed: int = 0
    block_size: int = 16
    max_num_batched_tokens: int = 512
    scenarios: bool = True
    roofline: bool = False
    engine_threads: int | None = None  # paged-chat's EngineConfig.threads (None: adapt)
    weights: str = "quantized"  # paged-chat's EngineConfig.weights
    kv_cache_dtype: str | None = None  # paged-chat's EngineConfig.kv_cache_dtype (None: as it ships)
    hf_seq_requests: int | None = None  # hf-seq runs this many, the rest extrapolated (None: all)


@dataclass(slots=True)
class BenchSetup:
    """What every system of one bench runs on: the model's weights and tokenizer, the
    seeded workload, paged-chat's warmed-up engine and the baselines' dtype."""

    source: ModelSource
    workload: Workload
    engine: Engine
    baseline_dtype: torch.dtype


def prepare_bench(options: BenchOptions, log: Callable[[str], None] = print) -> BenchSetup:
    """Check the systems' names, load the model once and build the workload and paged-chat's
    engine (on a thread of its own, as each system runs: `on_own_thread`)."""
    unknown = {name for name in options.systems if name not in SYSTEMS and not is_openai_system(name)}
    if unknown:
        raise ValueError(f"unknown system(s) {sorted(unknown)}: choose from {', '.join(SYSTEMS)} "
                         "or openai:URL")
    torch.set_num_threads(options.threads)
    source = load_model_source(options.model)
    workload = chat_workload(source, options.num_chats, options.min_output, options.max_output,
                             options.seed)
    log(f"workload: {len(workload.prompts)} chats, {workload.num_prompt_tokens} prompt tokens "
        f"({workload.system_prompt_tokens} shared), {workload.num_output_tokens} output tokens")
    config = EngineConfig(model=options.model, device="cpu", dtype=options.dtype,
                          block_size=options.block_size, max_num_seqs=options.num_chats,
                          max_num_batched_tokens=options.max_num_batched_tokens,
                          threads=options.engine_threads, weights=options.weights,
                          kv_cache_dtype=options.kv_cache_dtype)

    def warmed_up_engine() -> Engine:
        engine = Engine(config, source=source)
        engine.generate([workload.prompts[0]], SamplingParams(temperature=0, max_tokens=2))
        return engine

    engine = on_own_thread(warmed_up_engine)
    baseline_dtype = resolve_dtype(options.baseline_dtype or options.dtype, torch.device("cpu"))
    return BenchSetup(source, workload, engine, baseline_dtype)


def run_systems(setup: BenchSetup, options: BenchOptions, log: Callable[[str], None] = print,
                suffix: str = "") -> list[SystemResult]:
    """Each of `options.systems` on the workload, in order, each on a thread that ends with
    it; `suffix` is appended to every result's name (a harness's second run)."""
    results: list[SystemResult] = []
    for name in options.systems:
        log(f"running {name}{suffix} ...")
        result = (run_openai_server(name, setup.workload, setup.source.tokenizer)
                  if is_openai_system(name)
                  else on_own_thread(lambda: run_system(
                      name, setup.engine, setup.source, setup.workload, setup.baseline_dtype,
                      options.block_size, options.max_num_batched_tokens, options.threads,
                      options.hf_seq_requests)))
        result.name += suffix
        results.append(result)
        gc.collect()
        log(f"  {result.output_tokens / result.wall_s:.1f} output tokens/s")
    return results


def systems_report(setup: BenchSetup, results: list[SystemResult]) -> dict:
    """The workload, each system's summary (with its ratio to hf-seq and the share of its
    replies token for token hf-seq's, where hf-seq ran) and the dtypes, as a report."""
    workload = setup.workload
    report = {"workload": {
        "chats": len(workload.prompts), "prompt_tokens": workload.num_prompt_tokens,
        "shared_system_prompt_tokens": workload.system_prompt_tokens,
        "output_tokens": workload.num_output_tokens},
        "systems": [r.summary() for r in results],
        "dtypes": {"paged-chat": setup.engine.info.dtype, "baselines": dtype_name(setup.baseline_dtype)}}
    reference = next((r for r in results if r.name == "hf-seq"), None)
    for result, summary in zip(results, report["systems"]):
        if reference is not None:
            summary["vs_hf_seq"] = summary["output_tokens_per_s"] / reference.summary()["output_tokens_per_s"]
        if reference is not None and result.outputs:  # a server may not return its token ids
            summary["same_tokens_as_hf_seq"] = sum(
                a == b for a, b in zip(result.outputs, reference.outputs)) / len(reference.outputs)
    return report


def run_bench(options: BenchOptions, log: Callable[[str], None] = print) -> dict:
    """The whole bench: the systems, then the scenarios `options` asks for, as one report
    (`report.format_report` prints it)."""
    setup = prepare_bench(options, log)
    report = {"options": asdict(options), **systems_report(setup, run_systems(setup, options, log))}
    engine, source, workload = setup.engine, setup.source, setup.workload
    if options.scenarios:
        log("running memory scenarios ...")
        report["scenarios"] = memory_scenarios(engine, source, workload)
        log("running the KV tier scenario ...")
        report["scenarios"]["tier_resume"] = tier_resume(
            options.model, source, options.dtype, options.block_size,
            options.max_num_batched_tokens, SYSTEM_PROMPT)
    if options.roofline:
        log("measuring the machine ...")
        step, step_threads = decode_step_time(engine, options.num_chats)
        report["roofline"] = roofline(engine, step, options.num_chats, step_threads)
    return report
