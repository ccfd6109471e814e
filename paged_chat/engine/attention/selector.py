"""Which paged-attention backend an engine runs: `EngineConfig.attention_backend` on a device."""

from __future__ import annotations

import os

import torch

from paged_chat.engine.attention.backend import AttentionBackend
from paged_chat.engine.attention.torch_backend import TorchAttention
from paged_chat.engine.errors import PagedChatError
from paged_chat.engine.models.model_config import ModelConfig


def select_attention(backend: str, model: ModelConfig, device: torch.device) -> AttentionBackend:
    """Triton kernels on CUDA when triton imports ("auto"), else the torch reference.

    The Triton backend is imported here, not at module level: triton is an optional extra,
    and TRITON_INTERPRET (the CPU interpreter the tests use) is read when kernels are
    defined, so they must not be defined before a test has set it.
    """
    args = (model.num_heads, model.num_kv_heads, model.head_dim)
    scale = model.attention_scale
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
