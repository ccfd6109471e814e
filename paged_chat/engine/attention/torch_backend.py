"""Paged attention in plain torch: the reference for every kernel, and the CPU path.

The head-major cache layout (attention/backend.py) lets one `index_select` gather a
batch's blocks into `[kv_heads, seqs, context, head_dim]`, contiguous and ready for
batched matrix products with no transpose copy.

The cache may hold a narrower dtype than the model computes in (`kv_cache_dtype`): K/V
are rounded to it as they are stored and widened back to the query's dtype as they are
gathered (kv_rows.py), so every product runs in the model's dtype.

A step first writes the new tokens' K/V into their slots, then attends; so a sequence
that reuses a block another sequence fills in this same step reads it after it was
written (the scheduler relies on that when it caches blocks at schedule time).

Decodes run as two 3-D batched matrix products, one matrix per (KV head, sequence) with the
query heads of that KV head's group stacked as its rows; softmax runs in fp32: faster on the
CPU than SDPA for single-token queries in bf16, and than 4-D `matmul` over the same data,
which takes a much slower path (docs/ has the timings). The products pad every context to
the longest, so decodes of very different lengths run in groups of similar ones
(`_DecodeLayout`). Prefill chunks go through SDPA (its flash kernel on the CPU), one chunk
at a time, over their cached prefix plus the new tokens, with a causal mask offset by the
prefix length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from paged_chat.engine.attention.backend import AttentionBackend
from paged_chat.engine.attention.kv_rows import from_cache_rows, to_cache_rows
from paged_chat.engine.attention.metadata import AttentionMetadata


class TorchAttention(AttentionBackend):
    """Reference paged attention in plain torch."""

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        self._store(key, key_cache, meta.slot_mapping)
        self._store(value, value_cache, meta.slot_mapping)
        output = torch.empty_like(query)
        if meta.num_decodes:
            output[:meta.num_decodes] = self._decode(query[:meta.num_decodes], key_cache,
                                                     value_cache, meta, sliding_window)
        for seq in range(meta.num_decodes, meta.num_seqs):
            start, end = meta.query_start_loc_list[seq], meta.query_start_loc_list[seq + 1]
            output[start:end] = self._prefill(query[start:end], key_cache, value_cache, meta, seq,
                                              sliding_window)
        return output

    def _store(self, new: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        cache.view(self.num_kv_heads, -1, cache.shape[-1]).index_copy_(
            1, slots, to_cache_rows(new.transpose(0, 1), cache.dtype))

    def _gather(self, cache: torch.Tensor, rows: torch.Tensor, num_seqs: int,
                dtype: torch.dtype) -> torch.Tensor:
        """[kv_heads, num_seqs, blocks * block_size, head_dim] in `dtype` for the
        `block_rows` of a flat [num_seqs * blocks] index."""
        kv_heads, _, block_size, width = cache.shape
        flat = cache.view(-1, block_size * width).index_select(0, rows)
        return from_cache_rows(flat.view(kv_heads, num_seqs, -1, width), dtype)

    def _decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, sliding_window: int | None) -> torch.Tensor:
        layout = _DecodeLayout.of(meta, query.shape[0], key_cache.shape[:2])
        shared = None
        if layout.shared_rows is not None:
            # Cascade: the prefix every sequence shares is read once, for all their queries.
            shared = tuple(self._gather(cache, layout.shared_rows, 1, query.dtype).view(
                self.num_kv_heads, -1, self.head_dim) for cache in (key_cache, value_cache))
        if len(layout.groups) == 1:
            return self._decode_group(query, key_cache, value_cache, layout.groups[0], shared,
                                      sliding_window)
        output = torch.empty_like(query)
        for group in layout.groups:
            output[group.seqs] = self._decode_group(query[group.seqs], key_cache, value_cache,
                                                    group, shared, sliding_window)
        return output

    def _decode_group(self, query: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, decodes: _DecodeGroup,
                      shared: tuple[torch.Tensor, torch.Tensor] | None,
                      sliding_window: int | None) -> torch.Tensor:
        num_seqs, kv_heads, group, dim = query.shape[0], self.num_kv_heads, self.group_size, self.head_dim
        grouped = query.view(num_seqs, kv_heads, group, dim).transpose(0, 1).contiguous()
        batch = kv_heads * num_seqs
        keys = self._gather(key_cache, decodes.unique_rows, num_seqs, query.dtype).view(batch, -1, dim)
        values = self._gather(value_cache, decodes.unique_rows, num_seqs, query.dtype).view(
            batch, -1, dim)
        scores = torch.bmm(grouped.view(batch, group, dim), keys.transpose(1, 2))
        scores = scores.view(kv_heads, num_seqs, group, -1)
        if shared is not None:
            shared_scores = torch.bmm(grouped.view(kv_heads, num_seqs * group, dim),
                                      shared[0].transpose(1, 2))
            scores = torch.cat((shared_scores.view(kv_heads, num_seqs, group, -1), scores), dim=-1)
        scores = scores.float().masked_fill_(decodes.mask(sliding_window), float("-inf"))
        probs = torch.softmax(scores.mul_(self.scale), dim=-1).to(values.dtype)
        shared_len = scores.shape[-1] - keys.shape[1]
        out = torch.bmm(probs[..., shared_len:].reshape(batch, group, -1), values)
        if shared is not None:
            out += torch.bmm(probs[..., :shared_len].reshape(kv_heads, num_seqs * group, -1),
                             shared[1]).view(batch, group, dim)
        return out.view(kv_heads, num_seqs, group, dim).transpose(0, 1).reshape(
            num_seqs, self.num_heads, dim)

    def _prefill(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 meta: AttentionMetadata, seq: int, sliding_window: int | None) -> torch.Tensor:
        num_new = query.shape[0]
        seq_len = meta.seq_lens_list[seq]
        rows = block_rows(meta.block_tables[seq, :-(-seq_len // meta.block_size)],
                          key_cache.shape)
        keys = self._gather(key_cache, rows, 1, query.dtype)[:, 0, :seq_len]   # [kvh, L, d]
        values = self._gather(value_cache, rows, 1, query.dtype)[:, 0, :seq_len]
        # Query j sits at position seq_len - num_new + j and sees keys up to it.
        query_pos = torch.arange(seq_len - num_new, seq_len, device=query.device)
        key_pos = torch.arange(seq_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        if sliding_window is not None:
            mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
        # With a batch dimension: 3-D inputs take torch's math path on the CPU, 3x slower
        # than its flash kernel (a 512-token chunk over 2,000 tokens: 56 against 19 ms).
        out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys[None],
                                             values[None], attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.group_size > 1)
        return out[0].transpose(0, 1)


_MIN_SHARED_BLOCKS = 2


def block_rows(block_ids: torch.Tensor, cache_shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """The rows of `cache.view(-1, block_size * head_dim)` that hold `block_ids` (flat), every
    KV head's in turn: gathering whole blocks along dimension 0 copies each as one
    contiguous run, twice as fast as `index_select` along the block axis of the 4-D cache."""
    kv_heads, num_blocks = cache_shape[:2]
    heads = torch.arange(0, kv_heads * num_blocks, num_blocks, device=block_ids.device)
    return (heads[:, None] + block_ids[None, :].long()).view(-1)


# What one more group of decodes costs (a dozen more ops per layer), in blocks of padding it
# must save. Measured on the default model, batch-32 decode steps, 31 short chats beside one
# long one, split or not, alternating: 100 beside 300 tokens 125 against 155 ms, 200 beside
# 600 145 against 208; 200 beside 420, 50 beside 120 and 10 beside 60 the same either way.
_GROUP_COST_BLOCKS = 48


@dataclass(slots=True)
class _DecodeGroup:
    """Decode sequences attended as one batch, each one's table past the shared prefix
    padded to the longest of them.

    `seqs` indexes them among the step's decodes (None: all of them, in order);
    `unique_rows` are the cache rows (`block_rows`) of their tables past the shared prefix;
    `padding` marks positions past each sequence's end, over the shared and unique keys in
    that order (which are positions 0, 1, ... of each sequence). `windowed` caches, per
    sliding window, the padding plus the keys outside the window.
    """

    seqs: torch.Tensor | None
    unique_rows: torch.Tensor
    padding: torch.Tensor
    key_positions: torch.Tensor
    last_positions: torch.Tensor
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """Where a decode query must not look: past its end, and before its window."""
        if sliding_window is None:
            return self.padding
        mask = self.windowed.get(sliding_window)
        if mask is None:
            early = self.key_positions[None, :] <= self.last_positions[:, None] - sliding_window
            mask = self.windowed[sliding_window] = self.padding | early[None, :, None, :]
        return mask


@dataclass(slots=True)
class _DecodeLayout:
    """Where a step's decode sequences read their context: the same for every layer, so
    built once per step (kept in `meta.per_step`).

    `shared_rows` are the cache rows (`block_rows`) of the leading blocks every decode
    sequence has in its table (a shared system prompt, a forked chat), or None. `groups`
    split the sequences by length, so that one long chat does not make every other decode
    gather and multiply its length in padding; `_length_groups` says where they split.
    """

    shared_rows: torch.Tensor | None
    groups: list[_DecodeGroup]

    @classmethod
    def of(cls, meta: AttentionMetadata, num_seqs: int,
           cache_shape: torch.Size) -> "_DecodeLayout":
        layout = meta.per_step.get("torch_decode")
        if layout is None:
            layout = meta.per_step["torch_decode"] = cls._build(meta, num_seqs, cache_shape)
        return layout

    @classmethod
    def _build(cls, meta: AttentionMetadata, num_seqs: int,
               cache_shape: torch.Size) -> "_DecodeLayout":
        seq_lens = meta.seq_lens_list[:num_seqs]
        blocks = -(-np.asarray(seq_lens) // meta.block_size)
        tables = meta.block_tables[:num_seqs, :int(blocks.max())].long()
        full_in_all = min(seq_lens) // meta.block_size
        shared = 0
        if num_seqs > 1 and full_in_all >= _MIN_SHARED_BLOCKS:
            same = (tables[:, :full_in_all] == tables[:1, :full_in_all]).all(dim=0)
            shared = int(same.int().cumprod(0).sum())
        if shared < _MIN_SHARED_BLOCKS:
            shared = 0
        groups = [cls._group(meta, tables, shared, seqs, blocks, cache_shape)
                  for seqs in _length_groups(blocks - shared)]
        return cls(shared_rows=block_rows(tables[0, :shared], cache_shape) if shared else None,
                   groups=groups)

    @staticmethod
    def _group(meta: AttentionMetadata, tables: torch.Tensor, shared: int,
               seqs: np.ndarray | None, blocks: np.ndarray,
               cache_shape: torch.Size) -> _DecodeGroup:
        """The group of decodes `seqs` (None: all); `blocks` counts every decode's blocks."""
        seq_lens = meta.seq_lens[:len(tables)]
        index = None
        if seqs is not None:
            index = torch.from_numpy(seqs).to(tables.device)
            tables, seq_lens, blocks = tables[index], seq_lens[index], blocks[seqs]
        num_blocks = int(blocks.max())
        positions = torch.arange(num_blocks * meta.block_size, device=tables.device)
        padding = positions[None, :] >= seq_lens[:, None]
        return _DecodeGroup(seqs=index,
                            unique_rows=block_rows(tables[:, shared:num_blocks].reshape(-1),
                                                   cache_shape),
                            padding=padding[None, :, None, :], key_positions=positions,
                            last_positions=seq_lens - 1)


def _length_groups(unique_blocks: np.ndarray) -> list[np.ndarray | None]:
    """The decodes of each group (`_DecodeLayout`), longest first; [None] for one group of all.

    The candidate cuts are where the length, in order, falls under half of the last
    candidate's; a group starts at one when the sequences from there on would save at least
    `_GROUP_COST_BLOCKS` blocks of padding against the current group's longest."""
    order = np.argsort(-unique_blocks, kind="stable")
    ranked = unique_blocks[order]
    starts, cut = [0], 0
    while True:
        cut += int(np.searchsorted(-ranked[cut:], -ranked[cut] / 2, side="right"))
        if cut == len(ranked):
            break
        if (len(ranked) - cut) * (ranked[starts[-1]] - ranked[cut]) >= _GROUP_COST_BLOCKS:
            starts.append(cut)
    if len(starts) == 1:
        return [None]
    return [order[a:b] for a, b in zip(starts, [*starts[1:], len(order)])]
