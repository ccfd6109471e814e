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

The package: `workload` (the seeded chats), `systems` (paged-chat and the baselines, each
timed the same way), `scenarios` (memory scenarios, roofline), `report` (table, plot,
JSON); `run_bench` here puts them together.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from paged_chat.bench.scenarios import decode_step_time, memory_scenarios, roofline
from paged_chat.bench.systems import (SYSTEMS, SystemResult, build_hf_model, run_hf_cb, run_hf_seq,
                                      run_hf_static, run_paged_chat)
from paged_chat.bench.tier_resume import tier_resume
from paged_chat.bench.workload import SYSTEM_PROMPT, chat_workload
from paged_chat.engine import Engine, EngineConfig, SamplingParams
from paged_chat.engine.dtypes import TORCH_DTYPES
from paged_chat.engine.models.loader import load_model_source


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
                                 max_num_batched_tokens=options.max_num_batched_tokens),
                    source=source)
    engine.generate([workload.prompts[0]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    baseline_dtype = TORCH_DTYPES[options.baseline_dtype or options.dtype]
    results: list[SystemResult] = []
    for name in options.systems:
        log(f"running {name} ...")
        if name == "paged-chat":
            results.append(run_paged_chat(engine, workload))
        elif name == "hf-cb":
            model = build_hf_model(source, baseline_dtype, "paged|eager")
            # Room for the whole workload twice over: it never preempts, and its own memory
            # check (which assumes a GPU-sized budget) stays satisfied.
            workload_blocks = (workload.num_prompt_tokens + workload.num_output_tokens) // options.block_size
            results.append(run_hf_cb(model, workload, options.block_size, 2 * workload_blocks + 64,
                                     options.max_num_batched_tokens, options.num_chats))
        else:
            # transformers' SDPA decode in bf16 is pathologically slow on CPU (~30x eager here).
            attention = "eager" if baseline_dtype is torch.bfloat16 else "sdpa"
            model = build_hf_model(source, baseline_dtype, attention)
            results.append(run_hf_seq(model, workload) if name == "hf-seq"
                           else run_hf_static(model, workload, options.num_chats))
        model = None
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
    if options.scenarios:
        log("running memory scenarios ...")
        report["scenarios"] = memory_scenarios(engine, source, workload)
        log("running the KV tier scenario ...")
        report["scenarios"]["tier_resume"] = tier_resume(
            options.model, source, options.dtype, options.block_size,
            options.max_num_batched_tokens, SYSTEM_PROMPT)
    if options.roofline:
        log("measuring the machine ...")
        step = decode_step_time(engine, options.num_chats)
        report["roofline"] = roofline(engine, step, options.num_chats)
    return report
