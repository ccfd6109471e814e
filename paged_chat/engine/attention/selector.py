"""Which paged-attention backend an engine runs: `EngineConfig.attention_backend` on a device."""

from __future__ import annotations

import os

import torch

from paged_chat.engine.attention.backend import AttentionBackend
from paged_chat.engine.attention.cpu_backend import CpuAttention, cpu_kernels_available
from paged_chat.engine.attention.torch_backend import TorchAttention
from paged_chat.engine.core.errors import PagedChatError


def select_attention(backend: str, *, num_heads: int, num_kv_heads: int, head_dim: int,
                     scale: float, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend for a model's attention shape (query and KV heads, head size, the score
    scale) on `device` in `dtype`. "auto": Triton kernels on CUDA when triton imports; on
    the CPU in float32 the C kernel (cpu_backend.py) where it builds; else the torch
    reference.

    The Triton backend is imported here, not at module level: triton is an optional extra,
    and TRITON_INTERPRET (the CPU interpreter the tests use) is read when kernels are
    defined, so they must not be defined before a test has set it.
    """
    args = (num_heads, num_kv_heads, head_dim)
    if backend == "cpu":
        if device.type != "cpu" or dtype != torch.float32 or not cpu_kernels_available():
            raise PagedChatError("attention_backend='cpu' runs float32 on the CPU and needs a "
                                 "C compiler (cc): use dtype='float32', device='cpu', or "
                                 "attention_backend='torch'")
        return CpuAttention(*args, scale=scale)
    if backend == "auto" and device.type == "cpu":
        if dtype == torch.float32 and cpu_kernels_available():
            return CpuAttention(*args, scale=scale)
        return TorchAttention(*args, scale=scale)
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return TorchAttention(*args, scale=scale)
    try:
        from paged_chat.engine.attention.triton_backend import TritonAttention
    except ImportError as error:
        if backend == "auto":
            return TorchAttention(*args, scale=scale)
        raise PagedChatError(f"attention_backend='triton' needs triton ({error}): install "
                             "paged-chat[gpu], or use attention_backend='torch'") from error
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise PagedChatError("attention_backend='triton' runs on CUDA (on CPU only under "
                             "TRITON_INTERPRET=1, for tests): use device='cuda' or "
                             "attention_backend='torch'")
    return TritonAttention(*args, scale=scale)
