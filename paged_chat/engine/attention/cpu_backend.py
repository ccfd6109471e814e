"""Paged attention on the CPU by one C kernel per layer (paged_attention.c): the new K/V
stored and the decodes attended in one call, each K/V block read once, in place, with an
online softmax across blocks; float32 caches only.

Against the torch reference (torch_backend.py) it gathers nothing, builds no masks and
pads no context to the batch's longest, so nothing is derived per step either: the
kernel reads the metadata's lengths and tables as they are. Measured by
benchmarks/cpu_attention_probe.py (2-core AVX2 EPYC, one thread, SmolLM2-135M's shapes,
CPU time, loaded machine): decodes 3.6-9.5x faster than the reference's gather + bmm
(batch 1 to 32, 400 to 2,000 tokens); a 256-token prefill chunk over 256 cached tokens
0.7x of the reference's gather + SDPA flash kernel. So prefill chunks keep the
reference's path unless `prefill_in_kernel` (the kernel attends them exactly too).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.torch_backend import TorchAttention
from paged_chat.engine.native.build import NativeLibrary

_P, _I = ctypes.c_void_p, ctypes.c_int64


def _declare(lib: ctypes.CDLL) -> None:
    lib.pa_attention.argtypes = [_P, _I, _P, _I, _P, _I, _P, _P, _I, _I, _P, _I, _P, _P, _P,
                                 _I, _I, _I, _I, _I, ctypes.c_float, _I, _P, ctypes.c_int]


_native = NativeLibrary(Path(__file__).parents[1] / "native" / "csrc" / "paged_attention.c", _declare)


def cpu_kernels_available() -> bool:
    """Whether the kernel builds on this machine (a C compiler is there)."""
    return _native.load() is not None


class CpuAttention(TorchAttention):
    """Paged attention in one C call per layer (prefill chunks: see the module docstring);
    float32 on the CPU."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 prefill_in_kernel: bool = False) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.prefill_in_kernel = prefill_in_kernel

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        lib = _native.load()
        assert lib is not None, "CpuAttention needs the C kernel: check cpu_kernels_available()"
        assert key_cache.dtype == torch.float32 and key_cache.is_contiguous()
        query, key, value = (_rows(t) for t in (query, key, value))
        out = torch.empty(query.shape)
        in_kernel = meta.num_seqs if self.prefill_in_kernel else meta.num_decodes
        tables = meta.block_tables
        assert tables.is_contiguous() and meta.slot_mapping.dtype == torch.int64
        lib.pa_attention(query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0),
                         value.data_ptr(), value.stride(0), key_cache.data_ptr(),
                         value_cache.data_ptr(), key_cache.shape[1], key_cache.shape[2],
                         meta.slot_mapping.data_ptr(), query.shape[0],
                         meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(),
                         tables.data_ptr(), tables.shape[1], in_kernel, self.num_heads,
                         self.num_kv_heads, self.head_dim, self.scale, sliding_window or 0,
                         out.data_ptr(), torch.get_num_threads())
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
