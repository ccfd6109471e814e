"""The decoder's pointwise work as one C call each (native/csrc/fused_ops.c), float32 on
the CPU: residual add + RMSNorm, RoPE in place, SiLU-and-mul. The model uses them where
`available()` says the kernels built, unless EngineConfig.fused_ops is off; the torch ops
in llama.py stay the reference (and the path for other dtypes and devices).
"""

from __future__ import annotations

import ctypes

import torch

from paged_chat.engine.native import bindings


def available() -> bool:
    """Whether the kernels build on this machine (a C compiler is there)."""
    return bindings.library() is not None


def _library() -> ctypes.CDLL:
    lib = bindings.library()
    assert lib is not None, "fused ops need the C kernels: check available()"
    return lib


def _check(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        assert tensor.dtype == torch.float32 and tensor.is_contiguous() and tensor.device.type == "cpu"


def add_rms_norm(delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += delta in place (unless None), then weight * RMSNorm(residual), both
    [rows, hidden]."""
    _check(residual, weight, *(() if delta is None else (delta,)))
    out = torch.empty_like(residual)
    _library().fo_add_rms_norm(None if delta is None else delta.data_ptr(), residual.data_ptr(),
                               weight.data_ptr(), eps, residual.shape[0], residual.shape[1],
                               out.data_ptr(), torch.get_num_threads())
    return out


def rope_(rows: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotate the first `heads` heads of each row of `rows` [tokens, width] (unit column
    stride: the fused QKV output, Q and K heads side by side) in place by each token's
    cos/sin rows (`tokens * head_dim` floats each, gathered at its position)."""
    _check(cos, sin)
    assert rows.dtype == torch.float32 and rows.stride(1) == 1
    assert cos.numel() == sin.numel() == rows.shape[0] * head_dim
    _library().fo_rope(rows.data_ptr(), rows.stride(0), rows.shape[0], heads, head_dim,
                       cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 * size] (gate first) -> [rows, size]."""
    _check(gate_up)
    size = gate_up.shape[1] // 2
    out = gate_up.new_empty(gate_up.shape[0], size)
    _library().fo_silu_and_mul(gate_up.data_ptr(), gate_up.shape[0], size, out.data_ptr(),
                               torch.get_num_threads())
    return out
