"""How many KV blocks the pool gets, and its one allocation.

The pool is `KVCacheSpec.shape(num_blocks)`: every layer's keys and values in the attention
backend's layout, plus the reserved null block (block 0, `block_pool.NULL_BLOCK`), which
costs one block's bytes and is never handed out. Sizing, by the first that applies:
`num_blocks`; on CUDA what `kv_budget` leaves of the card after profiling the largest
step; `kv_cache_memory`; a fifth of the RAM available now, at most 2 GiB.
"""

from __future__ import annotations

import math
import mmap
import os
from dataclasses import dataclass

import torch

from paged_chat.engine.attention.backend import AttentionBackend
from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.core.config import EngineConfig
from paged_chat.engine.core.errors import PagedChatError, out_of_memory
from paged_chat.engine.core.sampling_params import SamplingParams
from paged_chat.engine.models.llama import LlamaForCausalLM
from paged_chat.engine.worker.sampler import SamplingBatch, sample

_DEFAULT_CPU_KV_FRACTION = 0.2
_DEFAULT_CPU_KV_CAP = 2 * 2**30
# Kept free for the allocator's fragmentation and what the profile does not see (cuBLAS
# workspaces, Triton's loaded modules, a CUDA graph pool): a share of the card.
_FRAGMENTATION_SLACK = 0.03


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    """The layout of a KV cache: [num_layers, 2, *attention.kv_cache_shape(blocks, block_size,
    dtype)]."""

    num_layers: int
    block_size: int
    attention: AttentionBackend
    dtype: torch.dtype
    device: torch.device

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2,
                *self.attention.kv_cache_shape(num_blocks, self.block_size, self.dtype))

    @property
    def bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return math.prod(self.shape(1)) * element


def size_kv_pool(spec: KVCacheSpec, config: EngineConfig, model: LlamaForCausalLM,
                 model_len: int) -> int:
    """The number of blocks requests can use when `num_blocks` is unset (the null block
    comes on top)."""
    if spec.device.type == "cuda":
        budget = cuda_kv_budget(spec, config, model, model_len)
    elif config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    else:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = min(int(available * _DEFAULT_CPU_KV_FRACTION), _DEFAULT_CPU_KV_CAP)
    num_blocks = budget // spec.bytes_per_block - 1
    if num_blocks < 1:
        raise PagedChatError(f"the KV cache budget ({budget} bytes) holds no block: "
                             "raise kv_cache_memory or gpu_memory_utilization")
    return int(num_blocks)


def longest_sequence(num_blocks: int, block_size: int, sliding_window: int | None,
                     max_chunk: int) -> int | None:
    """The most tokens one sequence can hold in a pool of `num_blocks`, or None for no bound:
    with a sliding window the pool only ever holds its window and a chunk of at most
    `max_chunk` new tokens (block boundaries may cost one block more), and when that fits,
    a request running alone can always go on."""
    if sliding_window is not None:
        live_blocks = -(-(sliding_window - 1 + max_chunk) // block_size) + 1
        if live_blocks <= num_blocks:
            return None
    return num_blocks * block_size


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, config: EngineConfig) -> torch.Tensor:
    """The KV pool of `num_blocks` blocks and the null block, allocated once, here, at exactly
    the bytes its sizing counted: the engine never allocates KV memory past its budget
    afterwards. When it does not fit, the error names the setting that sized it."""
    nbytes = (num_blocks + 1) * spec.bytes_per_block
    setting = ("num_blocks" if config.num_blocks is not None
               else "gpu_memory_utilization" if spec.device.type == "cuda"
               else "kv_cache_memory")
    size = f"{num_blocks} blocks, {nbytes / 2**30:.2f} GiB"
    ram = available_ram()
    if spec.device.type == "cpu" and nbytes > ram:  # zeroing it would wake the OOM killer
        raise PagedChatError(f"the KV cache ({size}) is larger than this machine's "
                             f"{ram / 2**30:.1f} GiB of available RAM: lower {setting}")
    with out_of_memory(f"allocating the KV cache ({size})", f"lower {setting}"):
        if spec.device.type == "cpu":
            kv_cache = zeroed_host_memory(nbytes).view(spec.dtype).view(spec.shape(num_blocks + 1))
        else:
            kv_cache = torch.zeros(spec.shape(num_blocks + 1), dtype=spec.dtype, device=spec.device)
    assert kv_cache.nbytes == nbytes, "the KV layout is not linear in num_blocks"
    return kv_cache


def zeroed_host_memory(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeros (uint8) that cost nothing until used: anonymous pages, which the
    kernel zeroes as each is first touched. torch.zeros writes every byte up front, at
    start, most of them for blocks a chat never reaches. Page-aligned; the tensor keeps
    the mapping alive."""
    try:
        pages = mmap.mmap(-1, nbytes)
    except OSError as error:  # ENOMEM: the kernel would not commit that much
        raise MemoryError(f"cannot map {nbytes} bytes: {error.strerror}") from error
    return torch.frombuffer(pages, dtype=torch.uint8)


def cuda_kv_budget(spec: KVCacheSpec, config: EngineConfig, model: LlamaForCausalLM,
                   model_len: int) -> int:
    """Profile the largest step this config allows (a full token budget of prefill, logits
    for max_num_seqs rows, then the sampler at its worst over them) against a scratch
    cache; the pool gets what `kv_budget` leaves of the card after that."""
    device = spec.device
    tokens = min(config.max_num_batched_tokens, model_len)
    blocks = -(-tokens // spec.block_size)
    scratch = torch.zeros(spec.shape(blocks), dtype=spec.dtype, device=device)
    model.build_rope_tables(tokens)
    meta = AttentionMetadata.build([tokens], [tokens], [list(range(blocks))], spec.block_size,
                                   device)
    rows = torch.arange(min(config.max_num_seqs, tokens), device=device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        logits = model(torch.zeros_like(meta.positions), meta.positions, scratch, meta,
                       spec.attention, rows)
        sample(torch.zeros_like(logits), worst_case_sampling(len(rows), logits.shape[-1], device))
    torch.cuda.synchronize(device)
    step_peak = torch.cuda.max_memory_allocated(device) - before
    del scratch, meta, logits
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = kv_budget(total, free, step_peak, config.gpu_memory_utilization)
    if budget <= 0:
        raise PagedChatError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} leaves no room for "
            f"the KV cache: {(total - free) / 2**30:.1f} GiB of the card are in use (weights, "
            f"CUDA context, other processes) and a {tokens}-token step takes "
            f"{step_peak / 2**30:.1f} GiB more; raise it, or lower max_num_batched_tokens "
            "or max_num_seqs")
    return budget


def kv_budget(total: int, free: int, step_peak: int, utilization: float) -> int:
    """Bytes for the KV pool on a card of `total` bytes with `free` free now (so the weights,
    the CUDA context and other processes' memory are counted, not only this process's
    tensors), when a step needs `step_peak` bytes beyond that at its worst, and the process
    may use `utilization` of the card in all."""
    assert 0 < utilization < 1
    in_use = total - free
    return int(total * utilization) - in_use - step_peak - int(total * _FRAGMENTATION_SLACK)


def worst_case_sampling(rows: int, vocab_size: int, device: torch.device) -> SamplingBatch:
    """Every filter and penalty on for every row, so `sample` makes all its [rows, vocab]
    buffers; with uniform logits top-p's nucleus spans the vocabulary (its largest sort)."""
    params = SamplingParams(temperature=0.7, top_p=0.95, top_k=vocab_size // 2, min_p=1e-9,
                            repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1)
    return SamplingBatch.build(params=[params] * rows, seeds=list(range(rows)),
                               output_indices=[1] * rows, token_histories=[[0, 1]] * rows,
                               prompt_lens=[1] * rows, vocab_size=vocab_size, device=device,
                               host_reads=device.type == "cpu")


def available_ram() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), which is
    what a new allocation can count on; total RAM where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as meminfo:
            line = next(line for line in meminfo if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
