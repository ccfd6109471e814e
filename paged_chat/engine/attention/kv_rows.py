"""How K/V rows are held in a KV cache of a given dtype (`EngineConfig.kv_cache_dtype`), in
torch: the reference that native/csrc/paged_attention.c's store and widening match.

- float32, bfloat16, float16: the values, rounded to the cache's dtype (nearest even).
- int8: a row of head_dim codes then its float32 scale's 4 bytes (head_dim + 4 int8s), as
  llama.cpp's q8_0 per row: scale = max |x| / 127, code = round-half-even(x / scale), with
  1 in place of a zero scale (an all-zero row), so nothing divides by zero.
"""

from __future__ import annotations

import torch

INT8_SCALE_BYTES = 4


def row_width(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements of one cached row of `head_dim` values."""
    return head_dim + INT8_SCALE_BYTES if cache_dtype == torch.int8 else head_dim


def to_cache_rows(values: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """`values` [..., head_dim] as the cache's rows [..., row_width]."""
    if cache_dtype != torch.int8:
        return values.to(cache_dtype)
    values = values.float()
    scale = values.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.round(values / torch.where(scale > 0, scale, 1.0)).to(torch.int8)
    return torch.cat((codes, scale.view(torch.int8)), dim=-1)


def from_cache_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's rows [..., row_width] as values [..., head_dim] in `dtype`."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)
