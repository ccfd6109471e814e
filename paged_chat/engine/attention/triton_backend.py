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

from paged_chat.engine.attention.backend import AttentionBackend
from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.triton_kernels import choose_num_splits, paged_attention, store_kv

# (query rows, keys per tile) of one program, rows being query tokens x the padded group of
# query heads. A decode has one token: its rows are the group, padded to tl.dot's minimum
# of 16. fp32 caches get exact fp32 dots, which run without tensor cores and need smaller
# tiles to stay in registers (ptxas reports no spills with these on sm_90).
TILES = {("decode", False): (16, 64), ("prefill", False): (64, 64),
         ("decode", True): (16, 32), ("prefill", True): (32, 32)}


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill; the interpreter (CPU) runs one program at a time."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonAttention(AttentionBackend):
    """Paged attention on Triton kernels, with the torch backend's cache layout and call."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._group_pad = triton.next_power_of_2(self.group_size)

    def tile(self, kind: str, dtype: torch.dtype) -> tuple[int, int]:
        """(query tokens, keys) per program for a "decode" or "prefill" launch."""
        rows, tile_n = TILES[kind, dtype == torch.float32]
        return max(1, rows // self._group_pad), tile_n

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        store_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        output = torch.empty_like(query)
        for seqs, block_q, tile_n, num_splits in self._launches(meta, key_cache):
            paged_attention(query, key_cache, value_cache, output, meta, seqs, self.scale,
                            block_q=block_q, tile_n=tile_n, num_splits=num_splits)
        return output

    def _launches(self, meta: AttentionMetadata,
                  cache: torch.Tensor) -> list[tuple[range, int, int, int]]:
        """(sequences, block_q, tile_n, num_splits) of the decode and the prefill launch; the
        same for every layer, so worked out once per step."""
        launches = meta.per_step.get("triton_launches")
        if launches is None:
            launches = []
            starts, num_sms = meta.query_start_loc_list, _num_sms(cache.device)
            for kind, seqs in (("decode", range(meta.num_decodes)),
                               ("prefill", range(meta.num_decodes, meta.num_seqs))):
                if not seqs:
                    continue
                block_q, tile_n = self.tile(kind, cache.dtype)
                q_tiles = sum(triton.cdiv(starts[s + 1] - starts[s], block_q) for s in seqs)
                longest = max(meta.seq_lens_list[seqs.start:seqs.stop])
                splits = choose_num_splits(q_tiles * self.num_kv_heads, longest, num_sms)
                launches.append((seqs, block_q, tile_n, splits))
            meta.per_step["triton_launches"] = launches
        return launches
