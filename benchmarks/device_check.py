#!/usr/bin/env python3
"""The GPU path's verdict in one run: the engine against transformers, then the kernels;
without a GPU, compile-only or a dry run.

On a lent H200, from the repo root. Its python3 has torch, triton, transformers and pytest
(no textual, no fastapi), but paged-chat also imports gguf and platformdirs: fetch their
(pure-Python) wheels here into an ignored folder, `pip download --no-deps
--only-binary=:all: --python-version 3.12 -d .whl gguf==0.19.0 platformdirs==4.14.8`, carry
`.whl`, and there run (one command, within the 10 minutes one may take)

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 &&
    python3 -m benchmarks.device_check 2>&1 | tee $OUT/device_check.log   # at most GPU_BUDGET_S
    python3 -m pytest -q -p no:cacheprovider tests/gpu                  # optional

Without a GPU (CI runs a corner of the first through tests/test_triton_kernels.py; the
whole matrix, 224 variants, takes ~4 minutes on 2 cores; the second runs every stage at toy
sizes, to find the script's own bugs before a lease is spent on them; its numbers mean
nothing, and tests/test_device_check.py runs it):

    .venv/bin/python -m benchmarks.device_check --compile-only --arch 80,86,89,90 \
        [--head-dims 64,80,96,128,256] [--dtypes bf16,fp16,fp32]
    TRITON_INTERPRET=1 .venv/bin/python -m benchmarks.device_check --cpu-dry-run

Stages, in order, each under a time cap (the GPU's add up to GPU_BUDGET_S); the table is
printed after every stage, and the exit code is 0 only when every stage ran and passed
every check (1; 3 when a stage hung past its cap in a call that never returned). The
engine's stages (benchmarks/engine_checks.py) come first, on random weights built with
transformers (the default model's 98 MB GGUF exceeds what a call may carry):

- bandwidth: a device-to-device copy, the ceiling the roofline and the kernels are
  measured against (one second).
- transformers: the engine's greedy tokens against transformers' argmax on the same
  prefix, and in fp32 the tokens' logprobs, for the default model's shape and a tiny Gemma
  3 (sliding window, head dim 256): fp32 agrees everywhere, bf16 on >= 99% of the positions
  whose reference margin is clear of rounding (engine_checks.CLEAR_MARGIN says why).
- graphs: CUDA graphs against eager, greedy fp32 tokens at batches 1/8/32 with arrivals
  staggered so steps mix prefill and decode; the graphs must have replayed.
- default_config: the engine as a user starts it (auto sizing at 0.9, the host KV tier on)
  for 64 steps, stats() after each.
- sampling: seeded non-greedy sampling, a prefix hit, preemption.
- throughput: bf16 with graphs at batch 1 and 256 over 1k-token contexts beside the step's
  roofline (kernels of a step x an empty kernel's time; bytes / the copy's bandwidth); the
  issue's figures (1,000 and 60,000 tokens/s) are checks on a GPU.
- peer: transformers' continuous batching (generate_batch) and ours on one workload.
- kernels: the backend against an fp32 reference row by row (relative error of each
  token's output per head; fails past twice the torch backend's or a floor per dtype) in
  bf16 and fp16 at real model shapes (ragged contexts up to 32k, chunks starting
  mid-block, GQA 1 to 7, head dims 64/80/96/128, block sizes 16/32), a KV pool past 2**31
  elements with the blocks at its top end, and a self-test: a merge with one split
  dropped must fail the check. The K/V store checked exactly; every slot no sequence owns
  holds NaN, so a missing mask shows.
- timings: L2 flushed before every call, CUDA events, medians of many calls, metadata built
  outside: decode at batch 32/256 x context 1k/4k for 3 and 8 KV heads (K/V bandwidth and
  its fraction of the copy's), prefill (TFLOP/s), the torch backend beside the first
  shape, and a sweep of keys per tile, warps, stages and split counts.
- quantized: the quantized linear layers' Triton kernels over a 4096 x 4096 weight in both
  layouts (4-bit codes in groups of 32, 8-bit in groups of 16) at 1/8/32/512 rows of bf16
  activations: the error against the dequantized weights (fails past 1.5x that of a bf16
  F.linear), the time beside F.linear on the dequantized bf16 weights, and the weight
  bytes read per second against the copy's.
- compile: every kernel variant the backend can launch (K/V store, decode and prefill
  attention, split merge) at head dims 64/80/96/128/256 in bf16/fp16/fp32, and the
  quantized linear layers' GEMV and dot kernels in both layouts per dtype, compiled for
  each architecture asked (the GPU's own on a GPU) through triton's own compiler, with the
  registers and spills ptxas reports and the shared memory against the architecture's;
  any spill or overflow fails. Launches are captured from the real wrappers, so the
  argument lists cannot drift from the kernels; specialisation (ints == 1, multiples of
  16, aligned pointers) follows what triton's JIT does at launch.

The dry run's engine stages use the torch attention backend (the interpreter would take
minutes); its kernel stages run the Triton kernels interpreted. Writes the JSON summary to
$OUT/device_check.json (or ./device_check.json, or --out).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
import triton

from benchmarks import engine_checks
from benchmarks.engine_checks import DRY_ENGINE_PLAN, GPU_ENGINE_PLAN, EnginePlan
from paged_chat.engine.attention import triton_paged_attention
from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.torch_backend import TorchAttention
from paged_chat.engine.attention.triton_backend import (
    SHARED_MEMORY_BYTES,
    TileConfig,
    TritonAttention,
    device_arch,
)
from paged_chat.engine.models.quant import triton_dequant
from paged_chat.engine.models.quant.layout import QuantizedWeight


@dataclass(frozen=True)
class Shape:
    """The attention shape of a model family."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


SHAPES = [
    Shape("smollm2-135m", 9, 3, 64, 16),
    Shape("llama3-8b", 32, 8, 128, 16),
    Shape("qwen2-7b", 28, 4, 128, 32),        # GQA 7
    Shape("d80-gqa5", 20, 4, 80, 32),
    Shape("phi3-mini", 32, 32, 96, 16),       # MHA, head dim 96
]
TINY_SHAPES = [Shape("tiny-d80-gqa3", 6, 2, 80, 16)]


@dataclass(frozen=True)
class Plan:
    """How much each stage does: the GPU run, or the CPU dry run at toy sizes."""

    device: torch.device
    shapes: list[Shape]
    # (cached prefix, new tokens) per sequence, decodes first: ragged, mid-block, long.
    kernel_batches: dict[str, list[tuple[int, int]]]
    timing_shapes: list[Shape]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    sweep_cases: set[tuple[str, str]]                   # (shape, case) swept over tiles
    sweep_grid: tuple[tuple[int, ...], ...]            # keys per tile, warps, stages
    prefill_cases: dict[str, list[tuple[int, int]]]
    self_test_batch: list[tuple[int, int]]          # decodes long enough for 4 splits
    big_pool_blocks: int                             # 0: no pool past 2**31 elements
    copy_bytes: int
    iters: int
    engine: EnginePlan
    quantized_matrix: tuple[int, int]                # weight rows, in_features
    quantized_rows: tuple[int, ...]                  # rows of activations timed


GPU_PLAN = Plan(
    device=torch.device("cuda"), shapes=SHAPES,
    kernel_batches={
        "decode-64": [(int(n), 1) for n in torch.linspace(0, 4095, 64).long().tolist()],
        "decode-long": [(32000, 1), (17001, 1)],
        "mixed": [(100, 1), (3000, 1), (0, 1), (0, 512), (3001, 77), (47, 300), (9000, 3)]},
    timing_shapes=[Shape("smollm2-135m", 9, 3, 64, 16),
                   Shape("llama3-8b", 32, 8, 128, 16)],           # 3 and 8 KV heads
    decode_batches=(32, 256), decode_contexts=(1024, 4096),
    sweep_cases={("llama3-8b", "b32 ctx4096")}, sweep_grid=((32, 64, 128), (4, 8), (2, 3, 4)),
    prefill_cases={"prompt-512": [(0, 512)], "4x-prompt-512": [(0, 512)] * 4,
                   "chunk-512-after-3584": [(3584, 512)], "turn-64-after-8000": [(8000, 64)]},
    self_test_batch=[(4000, 1), (1500, 1), (777, 1)],
    big_pool_blocks=2**31 // (16 * 3 * 64) + 64,   # smollm2's blocks: 3 KV heads x 64 x 16
    copy_bytes=2**30, iters=20, engine=GPU_ENGINE_PLAN, quantized_matrix=(4096, 4096), quantized_rows=(1, 8, 32, 512))
DRY_PLAN = Plan(
    device=torch.device("cpu"), shapes=TINY_SHAPES,
    kernel_batches={"decode": [(37, 1), (15, 1), (0, 1)],
                    "mixed": [(20, 1), (21, 19), (0, 13)]},
    timing_shapes=TINY_SHAPES, decode_batches=(2,), decode_contexts=(40,),
    sweep_cases={("tiny-d80-gqa3", "b2 ctx40")}, sweep_grid=((32,), (4,), (2,)), prefill_cases={"turn-5-after-33": [(33, 5)]},
    self_test_batch=[(70, 1), (45, 1)], big_pool_blocks=0,
    copy_bytes=2**24, iters=2, engine=DRY_ENGINE_PLAN, quantized_matrix=(72, 96), quantized_rows=(1, 17))


# ---- batches -----------------------------------------------------------------------------


class Batch:
    """One step's flat batch on `device`: shuffled block tables, NaN in every unowned slot."""

    def __init__(self, shape: Shape, seqs: list[tuple[int, int]], dtype: torch.dtype,
                 device: torch.device, seed: int = 0, pool_blocks: int = 0) -> None:
        """`pool_blocks` makes the pool at least that large, the batch's blocks at its top end."""
        generator = torch.Generator(device=device).manual_seed(seed)
        bs, kvh, dim = shape.block_size, shape.num_kv_heads, shape.head_dim
        seq_lens = [prefix + new for prefix, new in seqs]
        counts = [-(-n // bs) for n in seq_lens]
        num_blocks = max(1 + sum(counts), pool_blocks)
        order = num_blocks - 1 - torch.randperm(sum(counts), device=device, generator=generator)
        width = max(counts) + 1
        self.block_tables = torch.zeros(len(seqs), width, dtype=torch.int32, device=device)
        cursor = 0
        for i, count in enumerate(counts):
            self.block_tables[i, :count] = order[cursor:cursor + count]
            cursor += count
        cache_shape = (kvh, num_blocks, bs, dim)
        self.key_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
        self.value_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
        slots, starts = [], [0]
        for i, (prefix, new) in enumerate(seqs):
            positions = torch.arange(prefix + new, device=device)
            seq_slots = self.block_tables[i, positions // bs].long() * bs + positions % bs
            for cache in (self.key_cache, self.value_cache):
                cache.view(kvh, -1, dim)[:, seq_slots[:prefix]] = torch.randn(
                    kvh, prefix, dim, device=device, generator=generator).to(dtype)
            slots.append(seq_slots[prefix:])
            starts.append(starts[-1] + new)
        tokens = starts[-1]
        self.query = torch.randn(tokens, shape.num_heads, dim, device=device,
                                 generator=generator).to(dtype)
        self.key = torch.randn(tokens, kvh, dim, device=device, generator=generator).to(dtype)
        self.value = torch.randn(tokens, kvh, dim, device=device, generator=generator).to(dtype)
        self.seq_lens = seq_lens
        self.slot_mapping = torch.cat(slots)
        self.starts = starts

    def meta(self) -> AttentionMetadata:
        """Fresh metadata (backends cache per-step plans in it)."""
        query_lens = [end - start for start, end in zip(self.starts, self.starts[1:])]
        return AttentionMetadata.build(query_lens, self.seq_lens, self.block_tables,
                                       self.key_cache.shape[2], self.query.device,
                                       slot_mapping=self.slot_mapping)


def backends(shape: Shape) -> tuple[TritonAttention, TorchAttention]:
    args = (shape.num_heads, shape.num_kv_heads, shape.head_dim)
    scale = shape.head_dim ** -0.5
    return TritonAttention(*args, scale=scale), TorchAttention(*args, scale=scale)


# ---- stage: compile ----------------------------------------------------------------------


@contextmanager
def captured_launches(forward: bool = False
                      ) -> Iterator[list[tuple[Any, dict[str, Any], dict[str, Any]]]]:
    """Swap the kernels of the attention backend and of the quantized weights for
    recorders: (kernel, arguments by name, launch options) per launch; `forward` also
    launches them (else nothing runs)."""
    launches: list[tuple[Any, dict[str, Any], dict[str, Any]]] = []
    kernels = {triton_paged_attention: ("_store_kv_kernel", "_paged_attention_kernel",
                                "_merge_splits_kernel"),
               triton_dequant: ("_gemv_kernel", "_dot_kernel")}
    originals = {(module, name): getattr(module, name)
                 for module, names in kernels.items() for name in names}

    class Recorder:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            def record(*args: Any, **kwargs: Any) -> None:
                options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
                named = dict(zip(self.kernel.arg_names, args)) | {
                    k: v for k, v in kwargs.items() if k not in options}
                launches.append((self.kernel, named, options))
                if forward:
                    self.kernel[grid](*args, **kwargs)
            return record

    for (module, name), kernel in originals.items():
        setattr(module, name, Recorder(kernel))
    try:
        yield launches
    finally:
        for (module, name), kernel in originals.items():
            setattr(module, name, kernel)


def variant_key(kernel: Any, named: dict[str, Any], options: dict[str, Any]) -> tuple:
    """What triton's JIT caches a compiled kernel under, for one launch: two launches with
    the same key share a compiled variant."""
    kernel = jit_function(kernel)
    signature, constexprs, attrs = specialise(kernel, named)
    return (kernel.fn.__name__, repr(sorted(signature.items())), repr(constexprs),
            repr(sorted(attrs)), repr(sorted(options.items())))


def jit_function(kernel: Any) -> Any:
    """The kernel as triton's JIT sees it, also under the interpreter (which has no JIT)."""
    if hasattr(kernel, "params"):
        return kernel
    from triton.runtime.jit import JITFunction
    return JITFunction(kernel.fn, **kernel.kwargs)


_POINTER_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                  torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8"}


def specialise(kernel: Any, named: dict[str, Any]) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as triton's JIT would build them for these arguments."""
    skip = {kernel.arg_names[i] if isinstance(i, int) else i
            for i in getattr(kernel, "do_not_specialize", ())}
    constexpr_names = {kernel.arg_names[p.num] for p in kernel.params if p.is_constexpr}
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        value = named[name]
        if name in constexpr_names:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _POINTER_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1 and name not in skip:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and name not in skip:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def ptxas_usage(ptx: str, arch: str) -> dict[str, int]:
    """Registers and spill bytes ptxas reports for `ptx`."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as file:
        file.write(ptx)
        file.flush()
        report = subprocess.run([str(ptxas), f"-arch={arch}", "-v", file.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    return {"registers": int(registers.group(1)) if registers else -1, "spill_bytes": sum(spills)}


# One model shape per head dim the compile matrix covers (tiles depend on the head dim, the
# dtype and the architecture; the group only changes how the rows are split into tokens).
COMPILE_SHAPES = {
    64: Shape("smollm2-135m", 9, 3, 64, 16),
    80: Shape("d80-gqa5", 20, 4, 80, 32),
    96: Shape("phi3-mini", 32, 32, 96, 16),
    128: Shape("qwen2-7b", 28, 4, 128, 32),
    256: Shape("gemma3-d256", 8, 4, 256, 16),
}
COMPILE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_ARCHS = (80, 86, 89, 90)


def variant_launches(shape: Shape, dtype: torch.dtype, arch: int
                     ) -> list[tuple[Any, dict[str, Any], dict[str, Any]]]:
    """Every kernel launch the backend can make for this shape and dtype on `arch`: the K/V
    store, and the decode and prefill launch with a split merge (the split count and the
    sliding window are runtime arguments: one variant serves every value)."""
    batch = Batch(shape, [(40, 1), (9, 1), (21, 19), (600, 3)], dtype, torch.device("cpu"))
    triton_backend, _ = backends(shape)
    meta = batch.meta()
    output = torch.empty_like(batch.query)
    with captured_launches() as launches:
        triton_paged_attention.store_kv(batch.key, batch.value, batch.key_cache, batch.value_cache,
                                meta.slot_mapping)
        for seqs, kind in ((range(2), "decode"), (range(2, 4), "prefill")):
            block_q, tiles = triton_backend.tile(kind, dtype, arch)
            triton_paged_attention.paged_attention(
                batch.query, batch.key_cache, batch.value_cache, output, meta, seqs, 0.125,
                block_q=block_q, tile_n=tiles.tile_n, num_splits=4, num_warps=tiles.num_warps,
                num_stages=tiles.num_stages)
    return launches


# The quantized weights' two layouts (layout.py): 4-bit codes in groups of 32 (Q4_0/Q4_1/
# Q4_K and Q5_K's groups without their high bits) and 8-bit codes in groups of 16 (Q6_K;
# Q8_0 is 8-bit in groups of 32, which the two cover between them).
QUANT_LAYOUTS = {"4bit-g32": (32, False), "8bit-g16": (16, True)}


def random_quantized(rows: int, in_features: int, layout: str, device: torch.device,
                     generator: torch.Generator) -> QuantizedWeight:
    """A QuantizedWeight of random codes, scales and offsets in one of QUANT_LAYOUTS."""
    group, high = QUANT_LAYOUTS[layout]
    planes = [torch.randint(0, 256, (rows, in_features // 2), dtype=torch.uint8,
                            generator=generator).to(device) for _ in range(1 + high)]
    scale = (torch.rand(rows, in_features // group, generator=generator) * 0.01).to(device)
    offset = (torch.randn(rows, in_features // group, generator=generator) * 0.05).to(device)
    return QuantizedWeight(layout, group, planes[0], planes[1] if high else None, scale, offset)


def quantized_launches(dtype: torch.dtype) -> list[tuple[Any, dict[str, Any], dict[str, Any]]]:
    """Every kernel launch the quantized linear layers make for activations of `dtype`: the
    GEMV (decode) and the tl.dot kernel (prefill) in both layouts."""
    generator = torch.Generator().manual_seed(0)
    with captured_launches() as launches:
        for layout in QUANT_LAYOUTS:
            weight = random_quantized(64, 256, layout, torch.device("cpu"), generator)
            for rows in (1, triton_dequant.GEMV_MAX_ROWS + 1):
                x = torch.zeros(rows, 256, dtype=dtype)
                out = torch.empty(rows, 64, dtype=dtype)
                triton_dequant.matmul(x, weight, out)
    return launches


def compile_stage(archs: list[int], head_dims: list[int],
                  dtypes: list[str]) -> list[dict[str, Any]]:
    """Compile every variant for every (arch, head dim, dtype) with triton's own compiler
    (no GPU needed), and the quantized linear layers' kernels per (arch, dtype), with the
    registers and spills ptxas reports and the shared memory the launch needs against what
    the architecture has (`ok` is False past either)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = []
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        ptx_arch = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        shared_limit = SHARED_MEMORY_BYTES[arch]
        seen = set()
        cases = [(COMPILE_SHAPES[head_dim].name, head_dim, dtype_name,
                  variant_launches(COMPILE_SHAPES[head_dim], COMPILE_DTYPES[dtype_name], arch))
                 for head_dim in head_dims for dtype_name in dtypes]
        cases += [("quantized-linear", None, dtype_name,
                   quantized_launches(COMPILE_DTYPES[dtype_name])) for dtype_name in dtypes]
        for shape_name, head_dim, dtype_name, launches in cases:
            for kernel, named, options in launches:
                kernel = jit_function(kernel)
                key = variant_key(kernel, named, options)
                if key in seen:
                    continue
                seen.add(key)
                signature, constexprs, attrs = specialise(kernel, named)
                start = time.perf_counter()
                compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                          target=target, options=options)
                entry = {"arch": arch, "kernel": kernel.fn.__name__, "head_dim": head_dim,
                         "shape": shape_name, "dtype": dtype_name,
                         "constexprs": {k: v for k, v in constexprs.items() if k.isupper()},
                         "num_warps": options.get("num_warps", 4),
                         "num_stages": options.get("num_stages"),
                         "shared_bytes": compiled.metadata.shared,
                         "shared_limit": shared_limit,
                         "compile_s": round(time.perf_counter() - start, 2)}
                entry |= ptxas_usage(compiled.asm["ptx"], ptx_arch)
                entry["ok"] = entry["spill_bytes"] == 0 and entry["shared_bytes"] <= shared_limit
                results.append(entry)
    return results


# ---- timing helpers ----------------------------------------------------------------------


# Bigger than any L2 this runs on (H200: 60 MB): zeroed before every timed call, so no
# call finds its K/V (a decode case of a few MB) still in cache from the one before.
L2_FLUSH_BYTES = 256 * 2**20


@functools.cache
def _l2_flush_buffer(device: torch.device) -> torch.Tensor:
    return torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)


def time_ms(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median of `iters` timed calls after `warmup` calls. On a GPU each call is timed by
    its own pair of CUDA events around the call alone, L2 flushed before it, and nothing
    syncs until the last one (the host runs ahead, so launch cost hides as it would in a
    step); on the CPU by the wall clock."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e3)
        return statistics.median(times)
    flush = _l2_flush_buffer(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Hand freed memory back, so the next stage's sizes and timings start clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bandwidth_stage(plan: Plan) -> dict[str, Any]:
    """Device-to-device copy: bytes read plus written per second."""
    source = torch.randint(0, 256, (plan.copy_bytes,), dtype=torch.uint8, device=plan.device)
    target = torch.empty_like(source)
    ms = time_ms(lambda: target.copy_(source), plan.device, plan.iters)
    return {"copy_gb_per_s": round(2 * source.numel() / ms / 1e6, 1),
            "checks": [engine_checks.check("the copy is exact", torch.equal(target, source))]}


# ---- stage: kernels ----------------------------------------------------------------------


# A row (one token's output for one head) is wrong when its relative error against the fp32
# reference exceeds twice the torch backend's on the same inputs, or this floor: rounding
# alone is ~4e-3 in bf16 and ~5e-4 in fp16, while a lost split of 2-32 moves a row by
# 0.1-1 (test_device_check_catches_a_dropped_split).
ROW_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def row_errors(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of each (token, head) row of `ours` against `reference`."""
    diff = (ours.float() - reference).norm(dim=-1)
    return diff / reference.norm(dim=-1).clamp_min(1e-6)


@contextmanager
def dropped_split(index: int) -> Iterator[list[int]]:
    """Make every split merge ignore split `index` (its log-sum-exp forced to -inf), as a
    broken split bound or merge would; yields the list of merges it dropped a split from."""
    original = triton_paged_attention._merge_splits_kernel
    fired: list[int] = []

    class Dropping:
        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            def launch(partial_out: torch.Tensor, partial_lse: torch.Tensor, *args: Any,
                       **kwargs: Any) -> None:
                partial_lse[..., index] = float("-inf")
                fired.append(index)
                original[grid](partial_out, partial_lse, *args, **kwargs)
            return launch

    triton_paged_attention._merge_splits_kernel = Dropping()
    try:
        yield fired
    finally:
        triton_paged_attention._merge_splits_kernel = original


def check_batch(shape: Shape, seqs: list[tuple[int, int]], dtype: torch.dtype,
                device: torch.device, *, seed: int = 0, pool_blocks: int = 0,
                num_splits: int | None = None) -> dict[str, Any]:
    """The Triton backend against an fp32 reference (the torch backend on the same cache),
    row by row, next to the torch backend in `dtype`; the K/V store checked exactly.
    `num_splits` forces a split count on the kernels (the backend picks its own when None)."""
    batch = Batch(shape, seqs, dtype, device, seed=seed, pool_blocks=pool_blocks)
    triton_backend, torch_backend = backends(shape)
    expected_k, expected_v = batch.key_cache.clone(), batch.value_cache.clone()
    for cache, new in ((expected_k, batch.key), (expected_v, batch.value)):
        cache.view(shape.num_kv_heads, -1, shape.head_dim)[:, batch.slot_mapping] = \
            new.transpose(0, 1)
    clean = [c.nan_to_num(0.0) for c in (expected_k, expected_v)]
    reference = torch_backend(batch.query.float(), batch.key.float(), batch.value.float(),
                              *(c.float() for c in clean), batch.meta())
    torch_out = torch_backend(batch.query, batch.key, batch.value, *clean, batch.meta())
    del clean
    if num_splits is None:
        triton_out = triton_backend(batch.query, batch.key, batch.value, batch.key_cache,
                                    batch.value_cache, batch.meta())
    else:
        meta = batch.meta()
        triton_paged_attention.store_kv(batch.key, batch.value, batch.key_cache, batch.value_cache,
                                meta.slot_mapping)
        triton_out = torch.empty_like(batch.query)
        block_q, tiles = triton_backend.tile("decode", dtype, device_arch(device))
        triton_paged_attention.paged_attention(
            batch.query, batch.key_cache, batch.value_cache, triton_out, meta,
            range(meta.num_seqs), shape.head_dim ** -0.5, block_q=block_q,
            tile_n=tiles.tile_n, num_splits=num_splits)
    synchronize(device)
    stored = all(torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))
                 for ours, theirs in ((batch.key_cache, expected_k), (batch.value_cache, expected_v)))
    triton_rows = row_errors(triton_out, reference)
    torch_rows = row_errors(torch_out, reference)
    bad = ~(triton_rows <= torch.clamp(2 * torch_rows, min=ROW_TOLERANCE[dtype]))
    return {"shape": shape.name, "dtype": str(dtype).removeprefix("torch."),
            "tokens": batch.query.shape[0], "pool_elements": batch.key_cache.numel(),
            "triton_worst_row_err": triton_rows.max().item(),
            "torch_worst_row_err": torch_rows.max().item(),
            "bad_rows": int(bad.sum()), "store_exact": stored,
            "ok": stored and not bool(bad.any())}


def drop_split_self_test(shape: Shape, seqs: list[tuple[int, int]], dtype: torch.dtype,
                         device: torch.device) -> dict[str, Any]:
    """The row check passes a correct 4-way split and fails one with a split dropped: if it
    did not, a broken merge would pass the device check unseen."""
    clean = check_batch(shape, seqs, dtype, device, num_splits=4)
    with dropped_split(1) as fired:
        dropped = check_batch(shape, seqs, dtype, device, num_splits=4)
    return {"shape": shape.name, "batch": "self-test: split 1 of 4 dropped",
            "dtype": str(dtype).removeprefix("torch."), "clean_ok": clean["ok"],
            "dropped_ok": dropped["ok"], "dropped_bad_rows": dropped["bad_rows"],
            "ok": clean["ok"] and bool(fired) and not dropped["ok"]}


def kernels_stage(plan: Plan) -> list[dict[str, Any]]:
    """Row-by-row checks in bf16 and fp16 at every shape and batch of the plan, a KV pool
    past 2**31 elements with the batch's blocks at its top end, and the check's self-test."""
    results = []
    for dtype in (torch.bfloat16, torch.float16):
        for shape in plan.shapes:
            for name, seqs in plan.kernel_batches.items():
                results.append({"batch": name} | check_batch(shape, seqs, dtype, plan.device,
                                                             seed=len(results)))
                release(plan.device)
    shape = plan.shapes[0]
    if plan.big_pool_blocks:
        results.append({"batch": "pool past 2**31 elements"} | check_batch(
            shape, plan.kernel_batches["mixed"], torch.bfloat16, plan.device,
            pool_blocks=plan.big_pool_blocks))
        release(plan.device)
    results.append(drop_split_self_test(shape, plan.self_test_batch, torch.float16, plan.device))
    return results


# ---- stage: timings ----------------------------------------------------------------------


def attention_bytes(batch: Batch, shape: Shape) -> int:
    """K and V bytes a decode must read: every context token, every KV head, once."""
    element = batch.key_cache.element_size()
    return 2 * sum(batch.seq_lens) * shape.num_kv_heads * shape.head_dim * element


def attention_flops(batch: Batch, shape: Shape) -> int:
    """Causal attention FLOPs of the batch's chunks (QK^T and PV, 2 FLOPs per MAC)."""
    total = 0
    for seq in range(len(batch.seq_lens)):
        new = batch.starts[seq + 1] - batch.starts[seq]
        prefix = batch.seq_lens[seq] - new
        total += sum(prefix + j + 1 for j in range(new))
    return 4 * total * shape.num_heads * shape.head_dim


def timings_stage(plan: Plan, copy_gb_per_s: float | None) -> list[dict[str, Any]]:
    """Decode at every (shape, batch, context) of the plan and the prefill cases: the Triton
    backend call (K/V store included), the attention kernel alone (decode: K/V bandwidth
    and its fraction of the copy's; prefill: TFLOP/s) and, at the first shape, the torch
    backend. Metadata is built (and the backend's per-step plan made) before timing."""
    sms = (torch.cuda.get_device_properties(plan.device).multi_processor_count
           if plan.device.type == "cuda" else 1)
    arch = device_arch(plan.device)
    results = []
    decode = [("decode", f"b{b} ctx{n}", [(n - 1, 1)] * b)
              for b in plan.decode_batches for n in plan.decode_contexts]
    prefill = [("prefill", name, seqs) for name, seqs in plan.prefill_cases.items()]
    for index, shape in enumerate(plan.timing_shapes):
        triton_backend, torch_backend = backends(shape)
        for kind, name, seqs in decode + prefill:
            batch = Batch(shape, seqs, torch.bfloat16, plan.device)
            batch.key_cache.nan_to_num_(0.0)
            batch.value_cache.nan_to_num_(0.0)
            block_q, tiles = triton_backend.tile(kind, torch.bfloat16, arch)
            programs = sum(triton.cdiv(new, block_q) for _, new in seqs) * shape.num_kv_heads
            splits = triton_paged_attention.choose_num_splits(programs, max(batch.seq_lens), sms)
            run = KernelRun(batch, shape, block_q, plan)
            entry = {"kind": kind, "shape": shape.name, "case": name, "splits": splits,
                     "triton_backend_ms": backend_ms(triton_backend, batch, plan),
                     "kernel_ms": run.ms(tiles, splits)}
            if index == 0:
                entry["torch_backend_ms"] = backend_ms(torch_backend, batch, plan)
            if kind == "decode":
                gb = attention_bytes(batch, shape) / 1e9
                entry["kernel_gb_per_s"] = round(gb / entry["kernel_ms"] * 1e3, 1)
                if copy_gb_per_s:
                    entry["fraction_of_copy"] = round(entry["kernel_gb_per_s"] / copy_gb_per_s, 3)
            else:
                flops = attention_flops(batch, shape)
                entry["kernel_tflops"] = round(flops / entry["kernel_ms"] / 1e9, 1)
            entry["ok"] = 0 < entry["kernel_ms"] < float("inf")
            if (shape.name, name) in plan.sweep_cases:
                entry["sweep"] = run.sweep(tiles, splits)
            results.append(entry)
            del batch, run
            release(plan.device)
    return results


def backend_ms(backend: Any, batch: Batch, plan: Plan) -> float:
    """One backend call on metadata built (and planned, by a first call) outside the timing."""
    meta = batch.meta()
    return time_ms(lambda: backend(batch.query, batch.key, batch.value, batch.key_cache,
                                   batch.value_cache, meta), plan.device, plan.iters)


class KernelRun:
    """The attention kernel alone over a batch, at any tiles and split count."""

    def __init__(self, batch: Batch, shape: Shape, block_q: int, plan: Plan) -> None:
        self.batch, self.shape, self.block_q, self.plan = batch, shape, block_q, plan
        self.meta = batch.meta()
        self.output = torch.empty_like(batch.query)

    def ms(self, tiles: TileConfig, splits: int) -> float:
        batch = self.batch
        workspace = triton_paged_attention.split_workspace(
            batch.query.shape[0], self.shape.num_heads, self.shape.head_dim, splits,
            batch.query.device) if splits > 1 else None
        return time_ms(lambda: triton_paged_attention.paged_attention(
            batch.query, batch.key_cache, batch.value_cache, self.output, self.meta,
            range(len(batch.seq_lens)), self.shape.head_dim ** -0.5, block_q=self.block_q,
            tile_n=tiles.tile_n, num_splits=splits, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages, workspace=workspace), self.plan.device, self.plan.iters)

    def sweep(self, tiles: TileConfig, splits: int) -> dict[str, float]:
        """Kernel ms at other keys per tile, warps, stages and split counts (the next tuning
        pass's data; a variant that does not fit this GPU reports its error instead)."""
        results: dict[str, Any] = {}
        variants = [(TileConfig(tiles.rows, tile_n, warps, stages), splits)
                    for tile_n in self.plan.sweep_grid[0] for warps in self.plan.sweep_grid[1]
                    for stages in self.plan.sweep_grid[2]]
        variants += [(tiles, max(1, splits // 2)), (tiles, min(triton_paged_attention.MAX_SPLITS,
                                                               2 * splits))]
        for variant, variant_splits in variants:
            key = (f"tile_n{variant.tile_n}_warps{variant.num_warps}_stages{variant.num_stages}"
                   f"_splits{variant_splits}")
            try:
                results[key] = round(self.ms(variant, variant_splits), 4)
            except Exception as error:  # noqa: BLE001 - out of resources is a result here
                results[key] = f"{type(error).__name__}: {str(error)[:80]}"
        return results


# ---- stage: quantized ---------------------------------------------------------------------


def quantized_stage(plan: Plan, copy_gb_per_s: float | None) -> list[dict[str, Any]]:
    """The quantized linear layers' kernels (quant/triton_dequant.py) in both layouts, bf16
    activations, at each row count of the plan: the error against the dequantized weights
    in fp32, the kernel's time against F.linear over the same weights dequantized to bf16,
    and the weight bytes the kernel reads per second (its fraction of the copy's)."""
    generator = torch.Generator().manual_seed(0)
    rows_w, in_features = plan.quantized_matrix
    results = []
    for layout in QUANT_LAYOUTS:
        weight = random_quantized(rows_w, in_features, layout, plan.device, generator)
        dense = weight.dequantize()
        dense_bf16 = dense.to(torch.bfloat16)
        for rows in plan.quantized_rows:
            x = torch.randn(rows, in_features, generator=generator)
            x = x.to(plan.device, torch.bfloat16)
            out = torch.empty(rows, rows_w, dtype=torch.bfloat16, device=plan.device)
            triton_dequant.matmul(x, weight, out)
            reference = x.float() @ dense.T
            error = float((out.float() - reference).abs().max() / reference.abs().max())
            baseline = float((F.linear(x, dense_bf16).float() - reference).abs().max()
                             / reference.abs().max())
            kernel_ms = time_ms(lambda: triton_dequant.matmul(x, weight, out),
                                plan.device, plan.iters)
            entry = {"layout": layout, "rows": rows, "matrix": f"{rows_w}x{in_features}",
                     "max_rel_err": error, "f_linear_bf16_max_rel_err": baseline,
                     "ok": error <= 1.5 * baseline + 1e-6,
                     "kernel_ms": round(kernel_ms, 4),
                     "f_linear_bf16_ms": round(time_ms(lambda: F.linear(x, dense_bf16),
                                                       plan.device, plan.iters), 4),
                     "weight_gb_per_s": round(weight.nbytes / kernel_ms / 1e6, 1)}
            if copy_gb_per_s:
                entry["fraction_of_copy"] = round(entry["weight_gb_per_s"] / copy_gb_per_s, 3)
            results.append(entry)
        del weight, dense, dense_bf16
        release(plan.device)
    return results


# ---- driver ------------------------------------------------------------------------------


class StageTimeout(Exception):
    """A stage ran past its time cap."""


@dataclass(frozen=True)
class Stage:
    """One stage of the run: `run(summary so far)` returns its result, whose checks
    (`stage_checks`) decide whether it passed; `cap_s` bounds its wall time."""

    name: str
    run: Callable[[dict[str, Any]], Any]
    cap_s: float


# Past its cap a stage is interrupted where Python regains control; one stuck in a call
# that never returns (a hung kernel) ends the run this long after the cap, the table printed.
HANG_GRACE_S = 30.0
# The whole GPU run fits one 10-minute device command with room to start and copy back.
GPU_BUDGET_S = 540.0
DRY_BUDGET_S = 900.0
COMPILE_ONLY_CAP_S = 3600.0


def stage_list(plan: Plan, archs: list[int], head_dims: list[int], dtypes: list[str]
               ) -> list[Stage]:
    """Every stage in its order, the engine's first (after the one-second copy that the
    roofline needs), each with its cap: GPU caps add up to GPU_BUDGET_S."""
    dry = plan.device.type == "cpu"
    engine = plan.engine

    def copy_gb_per_s(summary: dict[str, Any]) -> float | None:
        return (summary.get("bandwidth") or {}).get("copy_gb_per_s")

    caps = {"bandwidth": 10, "transformers": 100, "graphs": 50, "default_config": 50,
            "sampling": 40, "throughput": 70, "peer": 60, "kernels": 40, "timings": 45,
            "quantized": 15, "compile": 60}
    if dry:
        caps = {name: max(60, 2 * cap) for name, cap in caps.items()}
    runs: dict[str, Callable[[dict[str, Any]], Any]] = {
        "bandwidth": lambda summary: bandwidth_stage(plan),
        "transformers": lambda summary: engine_checks.transformers_stage(engine),
        "graphs": lambda summary: engine_checks.graphs_stage(engine),
        "default_config": lambda summary: engine_checks.default_config_stage(engine),
        "sampling": lambda summary: engine_checks.sampling_stage(engine),
        "throughput": lambda summary: engine_checks.throughput_stage(engine, copy_gb_per_s(summary)),
        "peer": lambda summary: engine_checks.peer_stage(engine),
        "kernels": lambda summary: kernels_stage(plan),
        "timings": lambda summary: timings_stage(plan, copy_gb_per_s(summary)),
        "quantized": lambda summary: quantized_stage(plan, copy_gb_per_s(summary)),
        "compile": lambda summary: (compile_in_child(archs, head_dims, dtypes)
                                    if triton.knobs.runtime.interpret
                                    else compile_stage(archs, head_dims, dtypes))}
    return [Stage(name, run, caps[name]) for name, run in runs.items()]


def compile_in_child(archs: list[int], head_dims: list[int], dtypes: list[str]
                     ) -> list[dict[str, Any]]:
    """compile_stage in a child without the interpreter (triton's compiler cannot lower the
    interpreter's kernels), as --compile-only runs it."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "compile.json"
        child = subprocess.run(
            [sys.executable, "-m", "benchmarks.device_check", "--compile-only",
             "--arch", ",".join(map(str, archs)), "--head-dims", ",".join(map(str, head_dims)),
             "--dtypes", ",".join(dtypes), "--out", str(out)],
            env=env, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        if not out.exists():
            raise RuntimeError(f"--compile-only wrote nothing: {child.stderr[-2000:]}")
        return json.loads(out.read_text()).get("compile") or []


def stage_checks(result: Any) -> list[dict[str, Any]]:
    """The checks a stage's result holds: its "checks" list, or the result itself when it
    is a list of entries that each say whether they are `ok`."""
    if isinstance(result, dict):
        return list(result.get("checks") or [])
    if isinstance(result, list):
        return [entry for entry in result if isinstance(entry, dict) and "ok" in entry]
    return []


@contextmanager
def time_cap(seconds: float) -> Iterator[None]:
    """Raise StageTimeout in the main thread `seconds` from now (where Python code runs)."""
    def expire(signum: int, frame: Any) -> None:
        raise StageTimeout(f"past its cap of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_stages(stages: list[Stage], summary: dict[str, Any], out: Path, budget_s: float) -> None:
    """Run the stages in order, each under min(its cap, what is left of the budget):
    record each one's result, status and time in `summary`, write the JSON and print the
    table after every stage. A stage that raises, overruns or fails a check does not stop
    the others; one stuck past its cap plus HANG_GRACE_S ends the process (exit 3)."""
    deadline = time.monotonic() + budget_s
    for stage in stages:
        cap = min(stage.cap_s, deadline - time.monotonic())
        record: dict[str, Any] = {"stage": stage.name, "cap_s": round(cap, 1)}
        summary["stages"].append(record)
        if deadline - time.monotonic() < 1:
            record |= {"status": "skipped", "seconds": 0.0,
                       "reason": "the run's time budget is spent"}
            continue
        watchdog = threading.Timer(cap + HANG_GRACE_S, hung, (summary, out, stage.name))
        watchdog.daemon = True
        watchdog.start()
        start = time.perf_counter()
        try:
            with time_cap(cap):
                summary[stage.name] = stage.run(summary)
        except StageTimeout as error:
            record["status"], summary["errors"][stage.name] = "timeout", str(error)
        except Exception:  # noqa: BLE001 - one failed stage must not hide the others
            record["status"], summary["errors"][stage.name] = "error", traceback.format_exc()
            print(summary["errors"][stage.name], file=sys.stderr)
        finally:
            watchdog.cancel()
        record["seconds"] = round(time.perf_counter() - start, 1)
        if "status" not in record:
            checks = stage_checks(summary.get(stage.name))
            failed = [c for c in checks if not c["ok"]]
            record["status"] = "failed" if failed or not checks else "ok"
            if not checks:
                record["reason"] = "the stage made no checks"
        if torch.cuda.is_available():  # the next stage sizes and times a clean card
            release(torch.device("cuda"))
        write_summary(summary, out)
        print(table(summary), flush=True)


def hung(summary: dict[str, Any], out: Path, name: str) -> None:
    """A stage stuck past its cap in a call that does not return: give the verdict so far."""
    summary["stages"][-1] |= {"status": "hung", "reason": "stuck past its cap"}
    write_summary(summary, out)
    print(table(summary), flush=True)
    os._exit(3)


def write_summary(summary: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1, default=str))


def verdict(summary: dict[str, Any]) -> int:
    """0 when every stage ran and passed every check, else 1."""
    return 0 if summary["stages"] and all(
        record["status"] == "ok" for record in summary["stages"]) else 1


def table(summary: dict[str, Any]) -> str:
    """The numbers a person reads first, one line each, and the verdict so far."""
    lines = [f"device: {summary['env'].get('device')}  torch {summary['env']['torch']}  "
             f"triton {summary['env']['triton']}"]
    done = {record["stage"] for record in summary["stages"]}
    for name in ENGINE_STAGES:
        result = summary.get(name)
        if name in done and isinstance(result, dict):
            lines += [f"{name} {key}: {value}" for key, value in result.items() if key != "checks"]
            lines += [f"{name} FAILED {c['check']}: "
                      + ", ".join(f"{k}={v}" for k, v in c.items() if k not in ("check", "ok"))
                      for c in stage_checks(result) if not c["ok"]]
    lines += kernel_lines(summary)
    for record in summary["stages"]:
        reason = record.get("reason") or (summary["errors"].get(record["stage"]) or "").strip()
        reason = f": {reason.splitlines()[-1]}" if reason else ""
        lines.append(f"stage {record['stage']:15s} {record['status']:8s} "
                     f"{record.get('seconds', 0):6.1f} s of {record['cap_s']:5.1f}{reason}")
    failing = [r["stage"] for r in summary["stages"] if r["status"] != "ok"]
    lines.append("VERDICT so far: " + (f"FAIL ({', '.join(failing)})" if failing else "PASS"))
    return "\n".join(lines)


ENGINE_STAGES = ("transformers", "graphs", "default_config", "sampling", "throughput", "peer")


def kernel_lines(summary: dict[str, Any]) -> list[str]:
    """The kernel stages' lines: compile, copy bandwidth, row checks, timings, quantized."""
    def entries(stage: str) -> list[dict[str, Any]]:
        result = summary.get(stage)
        return result if isinstance(result, list) else []

    lines = []
    compiled = entries("compile")
    if compiled:
        worst = max(compiled, key=lambda c: (c["spill_bytes"], c["registers"]))
        lines.append(f"compile: {len(compiled)} variants, max registers "
                     f"{max(c['registers'] for c in compiled)}, worst spills "
                     f"{worst['spill_bytes']} B ({worst['kernel']} {worst['shape']})")
        for c in compiled:
            if not c["ok"]:
                lines.append(f"compile FAILED sm_{c['arch']} {c['kernel']} d{c['head_dim']} "
                             f"{c['dtype']} {c['constexprs']}: {c['spill_bytes']} B spilled, "
                             f"{c['shared_bytes']} of {c['shared_limit']} B shared")
    if "copy_gb_per_s" in (summary.get("bandwidth") or {}):
        lines.append(f"copy bandwidth: {summary['bandwidth']['copy_gb_per_s']} GB/s")
    for check in entries("kernels"):
        if "triton_worst_row_err" not in check:
            lines.append(f"kernels {check['shape']:14s} {check['batch']}: ok={check['ok']} "
                         f"(clean passes: {check['clean_ok']}, dropped passes: "
                         f"{check['dropped_ok']}, {check['dropped_bad_rows']} bad rows)")
            continue
        lines.append(f"kernels {check['shape']:14s} {check['batch']:12s} {check['dtype']:8s} "
                     f"ok={check['ok']!s:5s} worst row err triton "
                     f"{check['triton_worst_row_err']:.2e}, torch "
                     f"{check['torch_worst_row_err']:.2e}; {check['bad_rows']} bad rows; "
                     f"store exact {check['store_exact']}")
    for t in entries("timings"):
        rate = (f"{t['kernel_gb_per_s']} GB/s = {t.get('fraction_of_copy')} of copy"
                if t["kind"] == "decode" else f"{t['kernel_tflops']} TFLOP/s")
        torch_ms = f", torch {t['torch_backend_ms']:.3f} ms" if "torch_backend_ms" in t else ""
        lines.append(f"{t['kind']:7s} {t['shape']:12s} {t['case']:20s} backend triton "
                     f"{t['triton_backend_ms']:.3f} ms{torch_ms}; kernel {t['kernel_ms']:.3f} ms "
                     f"({t['splits']} splits), {rate}")
        if "sweep" in t:
            timed = {k: v for k, v in t["sweep"].items() if isinstance(v, float)}
            best = min(timed, key=timed.get) if timed else None
            lines.append(f"        sweep: best {best} {timed.get(best)} ms of {len(t['sweep'])}")
    for q in entries("quantized"):
        lines.append(f"quantized {q['layout']:8s} {q['matrix']} x{q['rows']:<4d} "
                     f"ok={q['ok']!s:5s} err {q['max_rel_err']:.2e} (bf16 F.linear "
                     f"{q['f_linear_bf16_max_rel_err']:.2e}); {q['kernel_ms']:.4f} ms vs "
                     f"F.linear {q['f_linear_bf16_ms']:.4f} ms; {q['weight_gb_per_s']} GB/s "
                     f"of weights = {q.get('fraction_of_copy')} of copy")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--compile-only", action="store_true",
                      help="only compile the kernels for the GPU (none needed)")
    mode.add_argument("--cpu-dry-run", action="store_true",
                      help="every stage at toy sizes on the CPU (needs TRITON_INTERPRET=1)")
    parser.add_argument("--arch", type=_int_list, help="compute capabilities to compile for "
                        f"(default {','.join(map(str, DEFAULT_ARCHS))}; on a GPU, its own)")
    parser.add_argument("--head-dims", type=_int_list, help="head dims to compile (default "
                        "all: 64,80,96,128,256; the dry run: 64)")
    parser.add_argument("--dtypes", type=lambda text: text.split(","),
                        help="bf16,fp16,fp32 (default all; the dry run: bf16)")
    parser.add_argument("--out", type=Path, help="where to write the JSON summary")
    args = parser.parse_args(argv)
    out = args.out or Path(os.environ.get("OUT", ".")) / "device_check.json"
    cuda = torch.cuda.is_available()
    summary: dict[str, Any] = {
        "env": {"torch": torch.__version__, "triton": triton.__version__,
                "device": torch.cuda.get_device_name() if cuda else "none",
                "sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None},
        "stages": [], "errors": {}}
    if args.cpu_dry_run and not triton.knobs.runtime.interpret:
        parser.error("--cpu-dry-run runs the kernels in the interpreter: set TRITON_INTERPRET=1")
    if not (args.cpu_dry_run or args.compile_only or cuda):
        parser.error("no GPU here: pass --compile-only or --cpu-dry-run")
    plan = DRY_PLAN if args.cpu_dry_run else GPU_PLAN
    archs = args.arch or ([device_arch(torch.device("cuda"))] if cuda and not args.cpu_dry_run
                          else [90] if args.cpu_dry_run else list(DEFAULT_ARCHS))
    head_dims = args.head_dims or ([64] if args.cpu_dry_run else list(COMPILE_SHAPES))
    dtypes = args.dtypes or (["bf16"] if args.cpu_dry_run else list(COMPILE_DTYPES))
    stages = stage_list(plan, archs, head_dims, dtypes)
    if args.compile_only:  # the whole matrix, however long it takes
        stages = [replace(stage, cap_s=COMPILE_ONLY_CAP_S) for stage in stages
                  if stage.name == "compile"]
        budget_s = COMPILE_ONLY_CAP_S
    else:
        budget_s = DRY_BUDGET_S if args.cpu_dry_run else GPU_BUDGET_S
    run_stages(stages, summary, out, budget_s)
    print(f"summary: {out}")
    return verdict(summary)


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


if __name__ == "__main__":
    sys.exit(main())
