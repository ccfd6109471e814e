"""The torch paged-attention backend against plain dense attention, sequence by sequence."""

from __future__ import annotations

import pytest
import torch

from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.torch_backend import TorchAttention, block_rows

BLOCK = 4
HEADS, KV_HEADS, DIM = 6, 2, 8


def dense_reference(query, keys, values, query_positions, window=None):
    """Causal attention of each query over keys[:position + 1] (the last `window` of them
    with a window), GQA by repetition."""
    group = HEADS // KV_HEADS
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    out = []
    for q, position in zip(query, query_positions):
        first = 0 if window is None else max(0, position + 1 - window)
        scores = torch.einsum("hd,lhd->hl", q, keys[first:position + 1]) * DIM ** -0.5
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values[first:position + 1]))
    return torch.stack(out)


# Decode contexts past the shared blocks: alike (one group), and one far longer than the
# rest (its own group: the others are not padded to it).
DECODE_LENGTHS = {"alike": (5, 9, 14, 3), "one_long": (5, 300, 14, 3)}


@pytest.mark.parametrize("shared_blocks", [0, 3])
@pytest.mark.parametrize("num_prefill", [0, 2])
@pytest.mark.parametrize("lengths", DECODE_LENGTHS)
@pytest.mark.parametrize("window", [None, 7])
def test_paged_attention_matches_dense(shared_blocks, num_prefill, lengths, window):
    generator = torch.Generator().manual_seed(shared_blocks * 10 + num_prefill)
    attention = TorchAttention(HEADS, KV_HEADS, DIM, DIM ** -0.5)
    num_blocks = 128
    key_cache = torch.randn(attention.kv_cache_shape(num_blocks, BLOCK), generator=generator)
    value_cache = torch.randn(attention.kv_cache_shape(num_blocks, BLOCK), generator=generator)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    shared = [free.pop() for _ in range(shared_blocks)]
    # Four decodes (some ending mid-block), then prefill chunks that start mid-sequence.
    seq_lens = [shared_blocks * BLOCK + n for n in (*DECODE_LENGTHS[lengths], *[11] * num_prefill)]
    new_tokens = [1, 1, 1, 1] + [6] * num_prefill
    tables, contexts = [], []
    for length in seq_lens:
        table = shared + [free.pop() for _ in range(-(-length // BLOCK) - shared_blocks)]
        tables.append(table)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
        contexts.append(slots)
    total = sum(new_tokens)
    query = torch.randn(total, HEADS, DIM, generator=generator)
    key = torch.randn(total, KV_HEADS, DIM, generator=generator)
    value = torch.randn(total, KV_HEADS, DIM, generator=generator)
    starts = [0]
    for count in new_tokens:
        starts.append(starts[-1] + count)
    slot_mapping = torch.cat([slots[length - count:] for slots, length, count
                              in zip(contexts, seq_lens, new_tokens)])
    meta = AttentionMetadata.build(new_tokens, seq_lens, tables, BLOCK, torch.device("cpu"),
                                   slot_mapping=slot_mapping)
    assert meta.num_decodes == 4

    out = attention(query, key, value, key_cache, value_cache, meta, sliding_window=window)

    flat_keys = key_cache.permute(1, 2, 0, 3).reshape(num_blocks * BLOCK, KV_HEADS, DIM)
    flat_values = value_cache.permute(1, 2, 0, 3).reshape(num_blocks * BLOCK, KV_HEADS, DIM)
    for seq, (slots, length, count) in enumerate(zip(contexts, seq_lens, new_tokens)):
        rows = slice(starts[seq], starts[seq + 1])
        assert torch.equal(flat_keys[slots[length - count:]], key[rows]), "K stored in its slots"
        expected = dense_reference(query[rows], flat_keys[slots], flat_values[slots],
                                   range(length - count, length), window)
        torch.testing.assert_close(out[rows], expected, rtol=1e-4, atol=1e-5)
    layout = meta.per_step["torch_decode"]
    assert len(layout.groups) == (2 if lengths == "one_long" else 1)
    if shared_blocks:
        shared_rows = block_rows(torch.tensor(shared), key_cache.shape)
        assert torch.equal(meta.per_step["torch_decode"].shared_rows, shared_rows)
