"""The modules the decoder uses in place of nn.Linear / nn.Embedding for quantized weights.

A QuantizedLinear's output rows are one or more `parts`, each a QuantizedWeight of one
format (a fused Q/K/V projection of a Q4_K_M file is Q4_K for Q and K but Q6_K for V). Its
forward runs the kernel kernels.py picks for the device and the number of rows, part by
part, into slices of one output: float32 on the CPU (other activation dtypes are converted
around it), the activations' own dtype on a GPU (Triton, triton_kernels.py). The quantized
tensors are registered as buffers, never parameters: nothing may train them, and the
model counts its parameters by the shapes they stand for (`num_weights`).
"""

from __future__ import annotations

import torch
from torch import nn

from paged_chat.engine.models.quant import kernels
from paged_chat.engine.models.quant.layout import BlockFormat, QuantizedWeight


class QuantizedLinear(nn.Module):
    """y = x @ W.T (+ bias) for 2-D x, W the rows of `parts` stacked in order."""

    def __init__(self, parts: list[QuantizedWeight], bias: nn.Parameter | None = None) -> None:
        super().__init__()
        assert parts and len({p.in_features for p in parts}) == 1
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.rows for p in parts)
        self.bias = bias
        self.matmul = kernels.LayerMatmul(parts)
        for i, part in enumerate(parts):
            for suffix, tensor in part.tensors().items():
                self.register_buffer(f"part{i}_{suffix}", tensor, persistent=False)

    @classmethod
    def empty(cls, shards: list[tuple[BlockFormat, int]], in_features: int,
              bias: nn.Parameter | None = None) -> QuantizedLinear:
        """Uninitialised, for `shards` (format, rows) in row order; neighbouring shards of
        one format share a part."""
        merged: list[tuple[BlockFormat, int]] = []
        for fmt, rows in shards:
            if merged and merged[-1][0] == fmt:
                merged[-1] = (fmt, merged[-1][1] + rows)
            else:
                merged.append((fmt, rows))
        return cls([QuantizedWeight.empty(fmt, rows, in_features) for fmt, rows in merged], bias)

    def rows(self, start: int, count: int) -> QuantizedWeight:
        """Output rows [start, start + count), which must lie in one part (a checkpoint
        tensor's slice of a fused layer)."""
        for part in self.parts:
            if start < part.rows:
                assert start + count <= part.rows, "a shard spans two formats"
                return part.narrow(start, count)
            start -= part.rows
        raise AssertionError("rows past the layer's end")

    @property
    def formats(self) -> list[str]:
        return [part.format for part in self.parts]

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        on_cpu = flat.device.type == "cpu"
        if on_cpu and flat.dtype != torch.float32:  # the C kernels take float32 only
            flat = flat.float()
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.empty(flat.shape[0], self.out_features, dtype=flat.dtype, device=flat.device)
        self.matmul(flat, out)
        if self.bias is not None:
            out += self.bias
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)


class QuantizedEmbedding(nn.Module):
    """Rows of a quantized [vocab, hidden] table, gathered then dequantized into `dtype`;
    `as_linear()` is the tied output projection over the same table."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = QuantizedLinear([weight])
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.rows, weight.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = kernels.dequantize(self.table.parts[0], ids.reshape(-1))
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def as_linear(self) -> QuantizedLinear:
        return self.table
