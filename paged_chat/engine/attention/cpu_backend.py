"""Paged attention on the CPU by one C kernel per layer (native/csrc/paged_attention.c):
the new K/V stored and the decodes attended in one call, each K/V block read once, in
place, with an online softmax across blocks; float32 queries, over a float32 or bfloat16 cache
(`bindings.KV_DTYPE_CODES`: rounded as stored, widened as read).

Against the torch reference (torch_backend.py) it gathers nothing, builds no masks and
pads no context to the batch's longest, so nothing is derived per step either: the
kernel reads the metadata's lengths and tables as they are. Prefill chunks keep the
reference's path, whose SDPA flash kernel is the faster there
(benchmarks/cpu_attention_probe.py), unless `prefill_in_kernel` (the kernel attends them
exactly too).
"""

from __future__ import annotations

import ctypes

import torch

from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.torch_backend import TorchAttention
from paged_chat.engine.core.dtypes import dtype_name
from paged_chat.engine.native import bindings
from paged_chat.engine.native.bindings import KV_DTYPE_CODES, PagedAttentionProblem


def cpu_kernels_available() -> bool:
    """Whether the kernel builds on this machine (a C compiler is there)."""
    return bindings.library() is not None


class CpuAttention(TorchAttention):
    """Paged attention in one C call per layer (prefill chunks: see the module docstring);
    float32 on the CPU, over a float32 or bfloat16 KV cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 prefill_in_kernel: bool = False) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.prefill_in_kernel = prefill_in_kernel

    def native_attends_step(self, meta: AttentionMetadata) -> bool:
        """The kernel attends every sequence of the step: all decodes, or prefill chunks too
        where `prefill_in_kernel`."""
        return self.prefill_in_kernel or meta.num_decodes == meta.num_seqs

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        lib = bindings.library()
        assert lib is not None, "CpuAttention needs the C kernel: check cpu_kernels_available()"
        assert key_cache.is_contiguous()
        query, key, value = (_rows(t) for t in (query, key, value))
        out = torch.empty(query.shape)
        in_kernel = meta.num_seqs if self.prefill_in_kernel else meta.num_decodes
        tables = meta.block_tables
        assert tables.is_contiguous() and meta.slot_mapping.dtype == torch.int64
        problem = PagedAttentionProblem(
            query=query.data_ptr(), key=key.data_ptr(), value=value.data_ptr(),
            q_stride=query.stride(0), k_stride=key.stride(0), v_stride=value.stride(0),
            key_cache=key_cache.data_ptr(), value_cache=value_cache.data_ptr(),
            kv_dtype=KV_DTYPE_CODES[dtype_name(key_cache.dtype)], num_blocks=key_cache.shape[1], block_size=key_cache.shape[2],
            slot_mapping=meta.slot_mapping.data_ptr(), num_tokens=query.shape[0],
            query_start=meta.query_start_loc.data_ptr(), seq_lens=meta.seq_lens.data_ptr(),
            block_tables=tables.data_ptr(), table_width=tables.shape[1], num_seqs=in_kernel,
            heads=self.num_heads, kv_heads=self.num_kv_heads, dim=self.head_dim,
            scale=self.scale, window=sliding_window or 0, out=out.data_ptr())
        lib.pa_attention(ctypes.byref(problem), torch.get_num_threads())
        for seq in range(in_kernel, meta.num_seqs):
            start, end = meta.query_start_loc_list[seq], meta.query_start_loc_list[seq + 1]
            out[start:end] = self._prefill(query[start:end], key_cache, value_cache, meta, seq,
                                           sliding_window)
        return out


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` [tokens, heads, dim] float32 with each token's heads one contiguous run
    (any token stride: a view into the fused QKV output passes as it is)."""
    assert tensor.dtype == torch.float32
    if tensor.stride(2) != 1 or tensor.stride(1) != tensor.shape[2]:
        tensor = tensor.contiguous()
    return tensor
