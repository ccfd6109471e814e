"""What every paged-attention backend shares: its shape and the KV cache layout.

Layout: each layer's key (and value) cache is `[kv_heads, num_blocks, block_size,
head_dim]`, head-major. Both backends use it, so a cache is interchangeable between them:
the torch path gathers a batch's blocks with one `index_select` into contiguous
`[kv_heads, seqs, context, head_dim]`, and the Triton kernels read one head's rows of a
block as one contiguous run.
"""

from __future__ import annotations

import torch

from paged_chat.engine.attention.kv_rows import row_width
from paged_chat.engine.attention.metadata import AttentionMetadata


class AttentionBackend:
    """Stores a step's K/V by slot mapping, then attends. `scale` is 1/sqrt(head_dim)
    unless the model says otherwise. `compiles_kernels`: its kernels compile on first use
    (the engine warms such a backend up before it serves). `attends_stored_kv`: it has
    `attend`, attention over K/V the model already stored (Triton's)."""

    compiles_kernels = False
    attends_stored_kv = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group_size = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def kv_cache_shape(self, num_blocks: int, block_size: int,
                       dtype: torch.dtype = torch.float32) -> tuple[int, ...]:
        """Shape of one layer's key (or value) cache of `dtype` (an int8 cache's rows hold
        their scale too: kv_rows.py)."""
        return (self.num_kv_heads, num_blocks, block_size, row_width(self.head_dim, dtype))

    def plan_graph(self, meta: AttentionMetadata, cache: torch.Tensor, longest: int) -> None:
        """Fix what a decode step about to be captured in a CUDA graph launches, for contexts
        up to `longest`; a backend that plans nothing per step has nothing to fix."""

    def native_attends_step(self, meta: AttentionMetadata) -> bool:
        """Whether this backend is the native library's paged attention and attends every
        sequence of the step `meta` describes (then the fused decode step may run the
        layers, attention included, in C)."""
        return False

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        """query [T, heads, dim], key/value [T, kv_heads, dim] -> output [T, heads, dim].

        With `sliding_window`, a query at position p attends the keys at k with
        p - sliding_window < k <= p (transformers' sliding_window_overlay); else all k <= p.
        """
        raise NotImplementedError
