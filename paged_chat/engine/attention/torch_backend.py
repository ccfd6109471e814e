"""Paged attention in plain torch: the reference for every kernel, and the CPU path.

Layout: each layer's key (and value) cache is `[kv_heads, num_blocks, block_size,
head_dim]`, head-major, so gathering a batch's blocks with one `index_select` yields
`[kv_heads, seqs, context, head_dim]`, contiguous and ready for batched matrix products
with no transpose copy.

A step first writes the new tokens' K/V into their slots, then attends; so a sequence
that reuses a block another sequence fills in this same step reads it after it was
written (the scheduler relies on that when it caches blocks at schedule time).

Decodes run as two 3-D batched matrix products, one matrix per (KV head, sequence) with
the query heads of that KV head's group stacked as its rows; softmax runs in fp32. On
this CPU that is about 2x faster than SDPA for single-token queries in bf16, and 4-D
`matmul` over the same data hits a path ~20x slower (shared/perf/NOTES.md has the
probes). Prefill chunks go through SDPA, one chunk at a time, over their cached prefix
plus the new tokens, with a causal mask offset by the prefix length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_chat.engine.attention.metadata import AttentionMetadata


class TorchAttention:
    """Reference paged attention; `scale` is 1/sqrt(head_dim) unless the model says otherwise."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group_size = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's key (or value) cache."""
        return (self.num_kv_heads, num_blocks, block_size, self.head_dim)

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """query [T, heads, dim], key/value [T, kv_heads, dim] -> output [T, heads, dim]."""
        self._store(key, key_cache, meta.slot_mapping)
        self._store(value, value_cache, meta.slot_mapping)
        output = torch.empty_like(query)
        if meta.num_decodes:
            output[:meta.num_decodes] = self._decode(query[:meta.num_decodes], key_cache,
                                                     value_cache, meta)
        for seq in range(meta.num_decodes, meta.num_seqs):
            start, end = meta.query_start_loc_list[seq], meta.query_start_loc_list[seq + 1]
            output[start:end] = self._prefill(query[start:end], key_cache, value_cache, meta, seq)
        return output

    def _store(self, new: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        cache.view(self.num_kv_heads, -1, self.head_dim).index_copy_(1, slots, new.transpose(0, 1))

    def _gather(self, cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """[kv_heads, num_seqs, blocks * block_size, head_dim] for a flat [num_seqs * blocks] index."""
        kv_heads, _, block_size, head_dim = cache.shape
        flat = cache.view(kv_heads, -1, block_size * head_dim).index_select(1, block_ids)
        return flat.view(kv_heads, num_seqs, -1, head_dim)

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        num_seqs = query.shape[0]
        block_ids, padding = self._decode_layout(meta, num_seqs)
        keys = self._gather(key_cache, block_ids, num_seqs)
        values = self._gather(value_cache, block_ids, num_seqs)
        context = keys.shape[2]
        batch = self.num_kv_heads * num_seqs
        grouped = (query.view(num_seqs, self.num_kv_heads, self.group_size, self.head_dim)
                   .transpose(0, 1).reshape(batch, self.group_size, self.head_dim))
        scores = torch.bmm(grouped, keys.view(batch, context, self.head_dim).transpose(1, 2))
        scores = scores.float().view(self.num_kv_heads, num_seqs, self.group_size, context)
        scores.masked_fill_(padding, float("-inf"))
        probs = torch.softmax(scores * self.scale, dim=-1).to(values.dtype)
        out = torch.bmm(probs.view(batch, self.group_size, context),
                        values.view(batch, context, self.head_dim))
        return (out.view(self.num_kv_heads, num_seqs, self.group_size, self.head_dim)
                .transpose(0, 1).reshape(num_seqs, self.num_heads, self.head_dim))

    @staticmethod
    def _decode_layout(meta: AttentionMetadata, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode gather index and padding mask: the same for every layer, so built once."""
        cached = meta.per_step.get("torch_decode")
        if cached is None:
            longest = max(meta.seq_lens_list[:num_seqs])
            num_blocks = -(-longest // meta.block_size)
            block_ids = meta.block_tables[:num_seqs, :num_blocks].reshape(-1).long()
            positions = torch.arange(num_blocks * meta.block_size, device=block_ids.device)
            padding = positions[None, :] >= meta.seq_lens[:num_seqs, None]
            cached = meta.per_step["torch_decode"] = (block_ids, padding[None, :, None, :])
        return cached

    def _prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata, seq: int) -> torch.Tensor:
        num_new = query.shape[0]
        seq_len = meta.seq_lens_list[seq]
        block_ids = meta.block_tables[seq, :-(-seq_len // meta.block_size)].long()
        keys = self._gather(key_cache, block_ids, 1)[:, 0, :seq_len]        # [kvh, L, d]
        values = self._gather(value_cache, block_ids, 1)[:, 0, :seq_len]
        # Query j sits at position seq_len - num_new + j and sees keys up to it.
        query_pos = torch.arange(seq_len - num_new, seq_len, device=query.device)
        key_pos = torch.arange(seq_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(query.transpose(0, 1), keys, values, attn_mask=mask,
                                             scale=self.scale, enable_gqa=self.group_size > 1)
        return out.transpose(0, 1)
