"""What every attention backend needs to run one step over a flat, unpadded batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step batch layout, shared by all layers.

    The step's tokens are one flat sequence of `num_tokens`. Sequence `i` owns the query
    tokens `query_start_loc[i]:query_start_loc[i + 1]`; after this step it has
    `seq_lens[i]` tokens of context (cached prefix + these new ones), whose K/V live in the
    blocks `block_tables[i, :ceil(seq_lens[i] / block_size)]`. New token `t` writes its
    K/V to the flat slot `slot_mapping[t]` (block id * block_size + offset).

    Sequences are ordered decodes first: the first `num_decodes` have exactly one query
    token, so backends can run them as one batched matrix product and loop only over the
    (few) prefill chunks. The `*_list` fields are host copies of the same numbers, so
    backends never sync with the device to read a length. `per_step` holds whatever a
    backend derives from these once per step (masks, gather indices) for every layer.
    """

    slot_mapping: torch.Tensor      # [num_tokens] int64
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32
    block_tables: torch.Tensor      # [num_seqs, max_blocks_per_seq] int32, padded with 0
    num_decodes: int
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    block_size: int
    per_step: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)
