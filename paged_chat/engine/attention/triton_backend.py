"""Paged attention on Triton kernels: the CUDA path (and, under TRITON_INTERPRET=1, CPU tests).

Same contract as `TorchAttention`: store the step's K/V by slot mapping, then attend. The
flat batch is split where the metadata already splits it: the decodes (one query token
each, first) run as one launch with small query tiles and flash-decoding when the batch is
too small to fill the GPU; the prefill chunks run as a second launch with larger query
tiles, reading their cached prefix from the blocks.
"""

from __future__ import annotations

import functools

import torch
import triton

from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.triton_kernels import choose_num_splits, paged_attention, store_kv

# Query rows per program (query tokens x padded group of heads) and keys per tile. A decode
# has one token, so its tile is the group padded to tl.dot's minimum of 16 rows.
DECODE_ROWS, DECODE_TILE_N = 16, 64
PREFILL_ROWS, PREFILL_TILE_N = 64, 64


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; the interpreter (CPU) runs one program at a time."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonAttention:
    """Paged attention with Triton kernels; `scale` is 1/sqrt(head_dim) unless the model says otherwise."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group_size = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        group_pad = triton.next_power_of_2(self.group_size)
        self.decode_block_q = max(1, DECODE_ROWS // group_pad)
        self.prefill_block_q = max(1, PREFILL_ROWS // group_pad)

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """query [T, heads, dim], key/value [T, kv_heads, dim] -> output [T, heads, dim]."""
        store_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        output = torch.empty_like(query)
        num_sms = _num_sms(query.device)
        decodes = range(meta.num_decodes)
        prefills = range(meta.num_decodes, meta.num_seqs)
        if decodes:
            splits = choose_num_splits(len(decodes) * self.num_kv_heads,
                                       max(meta.seq_lens_list[:decodes.stop]), num_sms)
            paged_attention(query, key_cache, value_cache, output, meta, decodes, self.scale,
                            block_q=self.decode_block_q, tile_n=DECODE_TILE_N, num_splits=splits)
        if prefills:
            starts = meta.query_start_loc_list
            q_tiles = sum(triton.cdiv(starts[s + 1] - starts[s], self.prefill_block_q)
                          for s in prefills)
            splits = choose_num_splits(q_tiles * self.num_kv_heads,
                                       max(meta.seq_lens_list[prefills.start:]), num_sms)
            paged_attention(query, key_cache, value_cache, output, meta, prefills, self.scale,
                            block_q=self.prefill_block_q, tile_n=PREFILL_TILE_N,
                            num_splits=splits)
        return output
