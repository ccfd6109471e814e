"""The devices and dtypes the engine runs on, by the names the config and the command line use."""

from __future__ import annotations

import torch

from paged_chat.engine.core.errors import PagedChatError

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: torch.device, holds_quantized: bool = False) -> torch.dtype:
    """The torch dtype for a config's `dtype`; "auto" picks by what the device does fast.

    On the CPU, a model whose weights are held quantized (`holds_quantized`) runs float32
    even where the CPU has bf16 dot products: its kernels compute in float32 (bf16
    activations would be converted around every layer) and the fused decode step is
    float32 only, so bf16 is slower there too (the closing note of issue 32)."""
    if dtype != "auto":
        return TORCH_DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_native_bf16() and not holds_quantized else torch.float32


def resolve_kv_cache_dtype(kv_cache_dtype: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """What the KV pool holds for a config's `kv_cache_dtype`: "auto" (or None) the model's
    own dtype, else the dtype named (int8: rows of codes and a scale, attention/kv_rows.py)."""
    if kv_cache_dtype in (None, "auto"):
        return model_dtype
    return torch.int8 if kv_cache_dtype == "int8" else TORCH_DTYPES[kv_cache_dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cpu_has_native_bf16() -> bool:
    """bf16 halves the bytes every decode step reads, but only pays where the CPU has bf16
    dot products (AVX512-BF16 or AMX); elsewhere torch emulates it and fp32 is faster."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> torch.device:
    """The torch device for a config's `device`; "auto" picks CUDA when torch sees one."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise PagedChatError("device='cuda' but torch sees no CUDA device: use device='cpu'")
    return torch.device(device)
