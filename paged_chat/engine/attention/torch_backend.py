"""Paged attention in plain torch: the reference for every kernel, and the CPU path.

The KV cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads,
head_dim]` (keys, values). A step first writes the new tokens' K/V into their slots, then
attends; so a sequence that reuses a block another sequence fills in this same step
reads it after it was written (the scheduler relies on that when it caches blocks at
schedule time).

Decodes run as one grouped matrix product: the query heads that share a KV head are
stacked, so each gathered K/V is read once per group, and softmax runs in fp32. On CPU
that is ~15x faster than SDPA for single-token queries in bf16 (shared/perf/NOTES.md).
Prefill chunks go through SDPA, one chunk at a time, over their cached prefix plus the
new tokens, with a causal mask offset by the prefix length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_chat.engine.attention.metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `key`/`value` [num_tokens, kv_heads, head_dim] into their flat slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[num_seqs, num_blocks * block_size, kv_heads, head_dim] from the first blocks of each table."""
    gathered = cache[block_tables[:, :num_blocks]]
    num_seqs, _, block_size, kv_heads, head_dim = gathered.shape
    return gathered.view(num_seqs, num_blocks * block_size, kv_heads, head_dim)


class TorchAttention:
    """Reference paged attention; `scale` is 1/sqrt(head_dim) unless the model says otherwise."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group_size = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """query [T, heads, dim], key/value [T, kv_heads, dim] -> output [T, heads, dim]."""
        store_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        output = torch.empty_like(query)
        if meta.num_decodes:
            output[:meta.num_decodes] = self._decode(query[:meta.num_decodes], key_cache,
                                                     value_cache, meta)
        for seq in range(meta.num_decodes, meta.num_seqs):
            start, end = meta.query_start_loc_list[seq], meta.query_start_loc_list[seq + 1]
            output[start:end] = self._prefill(query[start:end], key_cache, value_cache, meta, seq)
        return output

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_seqs = query.shape[0]
        seq_lens = meta.seq_lens[:num_seqs]
        longest = max(meta.seq_lens_list[:num_seqs])
        num_blocks = -(-longest // meta.block_size)
        tables = meta.block_tables[:num_seqs]
        keys = gather_kv(key_cache, tables, num_blocks)      # [B, L, kvh, d]
        values = gather_kv(value_cache, tables, num_blocks)
        grouped = query.view(num_seqs, self.num_kv_heads, self.group_size, self.head_dim)
        scores = torch.matmul(grouped, keys.permute(0, 2, 3, 1)).float() * self.scale
        context = torch.arange(keys.shape[1], device=query.device)
        padding = context[None, :] >= seq_lens[:, None]                    # [B, L]
        scores.masked_fill_(padding[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values.permute(0, 2, 1, 3))               # [B, kvh, g, d]
        return out.reshape(num_seqs, self.num_heads, self.head_dim)

    def _prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata, seq: int) -> torch.Tensor:
        num_new = query.shape[0]
        seq_len = meta.seq_lens_list[seq]
        num_blocks = -(-seq_len // meta.block_size)
        table = meta.block_tables[seq:seq + 1]
        keys = gather_kv(key_cache, table, num_blocks)[0, :seq_len]          # [L, kvh, d]
        values = gather_kv(value_cache, table, num_blocks)[0, :seq_len]
        # Query j sits at position seq_len - num_new + j and sees keys up to it.
        query_pos = torch.arange(seq_len - num_new, seq_len, device=query.device)
        key_pos = torch.arange(seq_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, scale=self.scale, enable_gqa=self.group_size > 1)
        return out.transpose(0, 1)
