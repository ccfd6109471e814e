"""Triton kernels for paged attention: KV store, one causal paged-attention kernel, split merge.

Layouts:
- query / output `[num_tokens, num_heads, head_dim]`, key / value `[num_tokens, num_kv_heads,
  head_dim]`: the step's flat batch, sequences back to back (`query_start_loc`), decodes first.
- one layer's key or value cache `[num_kv_heads, num_blocks, block_size, head_dim]`, head-major
  like the torch backend's: token `i` of sequence `s` lives in block
  `block_tables[s, i // block_size]` at row `i % block_size`, and one head's rows of a block
  are one contiguous run of `block_size * head_dim` elements.

Every stride is passed explicitly (the kernels take the cache's as block, row, head, dim),
so views (the value part of a fused QKV projection, one layer of the stacked cache) are
read in place. Cache offsets are computed in int64: a large cache has over 2**31 elements.

The attention kernel serves decode and prefill alike. One program owns one KV head, a tile
of `BLOCK_Q` consecutive query tokens of one sequence and one split of its keys. Its rows
are (query token, query head of the KV head's group) pairs, `BLOCK_Q * GROUP_PAD` of them, so
each K/V tile is loaded once for the whole group (GQA) and both matrix products run on
tensor cores (`tl.dot` needs at least 16 rows: a decode tile holds `16 // GROUP_PAD` token
slots, of which only the first is real). Keys are walked in tiles of `TILE_N` positions; each
position finds its block through the block table, so no contiguous copy of the context is
ever made and a tile may span several blocks. Query token `j` of a chunk of `q_len` new
tokens in a sequence of `seq_len` sits at position `seq_len - q_len + j` and sees keys up to
it: a chunk that starts mid-sequence, even mid-block, sees its cached prefix. The softmax is
online (running max and sum, in base 2 with `log2(e)` folded into the scale) and in fp32.

Flash-decoding: with few programs (small batch) and long contexts most SMs would idle, so
the keys of each program are cut into `num_splits` ranges handled by separate programs that
write a normalised partial output and its log-sum-exp; `_merge_splits_kernel` combines them.
The split count and the sliding window are runtime arguments, not compile-time constants:
one compiled variant per (kind, shape, dtype) serves every step, so an engine can compile
all it will launch before it serves (`TritonAttention.warm_up`).

Sliding-window attention (transformers' semantics): a query at position p sees the keys
p - window < k <= p; tiles wholly before the first row's window are skipped.

Head dims that are not powers of two (80, 96) are padded to the next power of two and
masked, like the group of query heads and the tails of contexts, chunks and tiles. Inputs
are fp16, bf16 or fp32. 16-bit products run in their own type with fp32 accumulation; fp32
caches multiply in exact fp32 (not tf32), and so does bf16 under TRITON_INTERPRET, whose
bf16 dot is wrong.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from paged_chat.engine.attention.metadata import AttentionMetadata

MAX_SPLITS = 32
# A split shorter than this costs more in launch and merge than it wins in parallelism.
MIN_KEYS_PER_SPLIT = 256


@triton.jit
def cache_offsets(block, row, head, dim, stride_cb, stride_cs, stride_ch, stride_cd):
    """Element offsets into a cache, in int64: a pool holds more than 2**31 elements, so
    `block * stride_cb` (and a head's stride in a head-major cache) overflow int32."""
    return (block.to(tl.int64) * stride_cb + row.to(tl.int64) * stride_cs
            + head.to(tl.int64) * stride_ch + dim * stride_cd)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    """One program per new token: copy its [kv_heads, head_dim] K and V into its slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    dst = cache_offsets(slot // BLOCK_SIZE, slot % BLOCK_SIZE, heads, dims,
                         stride_cb, stride_cs, stride_ch, stride_cd)
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    tl.store(key_cache_ptr + dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    tl.store(value_cache_ptr + dst, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


# Integers that change from step to step (where a launch starts in the batch, the width of
# the block tables, the split count) or from layer to layer (the sliding window) are not
# specialised on (== 1, multiple of 16): each new combination would compile another kernel
# variant, a pause of a second or more mid-generation.
@triton.jit(do_not_specialize=["first_seq", "first_token", "stride_table", "num_splits",
                               "sliding_window"])
def _paged_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, output_ptr, partial_out_ptr, partial_lse_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    first_seq, first_token, num_heads, scale_log2, num_splits, sliding_window,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_ot, stride_oh, stride_od,
    stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Grid (sequences, query tiles, kv_heads * num_splits); see the module docstring.

    With one split the program writes its rows of `output`; with more it writes, per
    (token - first_token, head, split), the normalised partial output and its base-2
    log-sum-exp. `sliding_window` > 0 limits each query to that many keys ending at its
    own position; 0 means none.
    """
    seq = first_seq + tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len
    # Without a window a query sees its whole prefix: a window longer than any sequence.
    window = tl.where(sliding_window > 0, sliding_window, seq_len + 1)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_index = q_tile * BLOCK_Q + rows // GROUP_PAD          # token within the chunk
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (q_index < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = prefix_len + q_index                            # position in the sequence
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q = tl.load(query_ptr + (q_start + q_index)[:, None] * stride_qt
                + head[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys visible to any row of this tile (from the first row's window start to the last
    # row's position), cut into num_splits runs of whole tiles. Tiles wholly before the
    # window are never loaded.
    kv_len = tl.minimum(seq_len, prefix_len + (q_tile + 1) * BLOCK_Q)
    first_key = tl.maximum(prefix_len + q_tile * BLOCK_Q - window + 1, 0)
    first_tile = first_key // TILE_N
    num_tiles = (kv_len + TILE_N - 1) // TILE_N - first_tile
    tiles_per_split = (num_tiles + num_splits - 1) // num_splits
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, first_tile + num_tiles)

    # A finite floor instead of -inf: a row that has seen no visible key yet keeps
    # alpha = exp2(0) and p = 0, never exp2(-inf - -inf) = NaN.
    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    for tile in range(tile_lo, tile_hi):
        keys = tile * TILE_N + tl.arange(0, TILE_N)
        key_valid = keys < kv_len
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_valid, other=0)
        kv_offset = cache_offsets(block, keys % BLOCK_SIZE, kv_head, 0,
                                   stride_cb, stride_cs, stride_ch, stride_cd)
        k = tl.load(key_cache_ptr + kv_offset[None, :] + dims[:, None] * stride_cd,
                    mask=dim_valid[:, None] & key_valid[None, :], other=0.0)   # [dim, keys]
        v = tl.load(value_cache_ptr + kv_offset[:, None] + dims[None, :] * stride_cd,
                    mask=key_valid[:, None] & dim_valid[None, :], other=0.0)   # [keys, dim]
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, k, input_precision="ieee" if DOT_FP32 else "tf32") * scale_log2
        # Causal and windowed: q_pos - window < key <= q_pos. It also hides keys past kv_len
        # from every real row; padding rows see them as zeros (masked loads), never written.
        visible = (keys[None, :] <= q_pos[:, None]) & (keys[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                            input_precision="ieee" if DOT_FP32 else "tf32")
        m_i = m_new

    out_mask = row_valid[:, None] & dim_valid[None, :]
    if num_splits == 1:
        out = acc / l_i[:, None]
        tl.store(output_ptr + (q_start + q_index)[:, None] * stride_ot
                 + head[:, None] * stride_oh + dims[None, :] * stride_od,
                 out.to(output_ptr.dtype.element_ty), mask=out_mask)
    else:
        # A split with no key visible to a row keeps m_i at the floor: its merge weight is 0.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        lse = m_i + tl.log2(l_safe)
        partial = ((q_start + q_index - first_token) * num_heads + head) * num_splits + split
        tl.store(partial_lse_ptr + partial, lse, mask=row_valid)
        tl.store(partial_out_ptr + partial[:, None] * HEAD_DIM_PAD + dims[None, :],
                 acc / l_safe[:, None], mask=out_mask)


@triton.jit(do_not_specialize=["first_token", "num_splits"])
def _merge_splits_kernel(
    partial_out_ptr, partial_lse_ptr, output_ptr,
    first_token, num_heads, num_splits,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    """One program per (token, head): weight each split's output by exp2(its lse - max lse).

    Every real row sees a key in at least one split, so the max is a real log-sum-exp and
    splits that saw nothing (at the floor) weigh exp2(-1e30 - max) = 0.
    """
    token = tl.program_id(0)
    head = tl.program_id(1)
    split_ids = tl.arange(0, MAX_SPLITS)
    split_valid = split_ids < num_splits
    splits = (token * num_heads + head) * num_splits + split_ids
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    lse = tl.load(partial_lse_ptr + splits, mask=split_valid, other=float("-inf"))
    partial = tl.load(partial_out_ptr + splits[:, None] * HEAD_DIM_PAD + dims[None, :],
                      mask=split_valid[:, None] & dim_valid[None, :], other=0.0)
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(output_ptr + (first_token + token) * stride_ot + head * stride_oh + dims * stride_od,
             out.to(output_ptr.dtype.element_ty), mask=dim_valid)


def cache_strides(cache: torch.Tensor) -> tuple[int, int, int, int]:
    """A [kv_heads, blocks, block_size, head_dim] cache's strides as the kernels take them."""
    heads, block, row, dim = cache.stride()
    return block, row, heads, dim


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [num_tokens, kv_heads, head_dim] into their flat slots; slot -1 skips."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key_cache.stride() == value_cache.stride(), "K and V caches must share a layout"
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *cache_strides(key_cache),
        num_kv_heads, head_dim,
        BLOCK_SIZE=key_cache.shape[2], HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim))


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """How many key ranges each program's work is cut into (a power of two).

    Doubles while the launch would still not fill the GPU once (`num_programs * splits` at
    most `num_sms`, so a batch of many sequences or KV heads keeps one split) and every
    split of the longest context keeps at least `MIN_KEYS_PER_SPLIT` keys.
    """
    splits = 1
    while (splits < MAX_SPLITS and num_programs * splits <= num_sms
           and max_seq_len >= 2 * splits * MIN_KEYS_PER_SPLIT):
        splits *= 2
    return splits


@functools.cache
def _fp32_placeholder(device: torch.device) -> torch.Tensor:
    """Stands in for the split workspace when there is one split: the kernel's signature
    (pointer types) stays the same either way, so it compiles once."""
    return torch.empty(1, dtype=torch.float32, device=device)


def split_workspace(num_tokens: int, num_heads: int, head_dim: int, num_splits: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial outputs, their log-sum-exps) for `num_tokens` query tokens cut into
    `num_splits` key ranges; allocate once per step and reuse in every layer."""
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    return (torch.empty((num_tokens, num_heads, num_splits, head_dim_pad), dtype=torch.float32,
                        device=device),
            torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=device))


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    output: torch.Tensor, meta: AttentionMetadata, seqs: range, scale: float,
                    *, block_q: int, tile_n: int, num_splits: int = 1, num_warps: int = 4,
                    num_stages: int = 2, sliding_window: int | None = None,
                    workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Attend the query tokens of sequences `seqs` (consecutive in the flat batch) over their
    paged context, writing their rows of `output`.

    `block_q` query tokens (times the padded group of query heads, at least 16 rows) and
    `tile_n` key positions (at least 16) make one program's tile; both are powers of two.
    `num_splits` > 1 (at most MAX_SPLITS) runs flash-decoding plus a merge, in `workspace`
    (see `split_workspace`; made here when not given). `sliding_window` limits each query
    to the keys `position - sliding_window < key <= position`.
    """
    if not seqs:
        return
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[0]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    assert 1 <= num_splits <= MAX_SPLITS and tile_n >= 16 and block_q * group_pad >= 16
    assert sliding_window is None or sliding_window > 0, "a window holds at least one key"
    assert key_cache.stride() == value_cache.stride(), "K and V caches must share a layout"
    starts = meta.query_start_loc_list
    first_token, end_token = starts[seqs.start], starts[seqs.stop]
    max_query_len = max(starts[s + 1] - starts[s] for s in seqs)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        partial_out, partial_lse = workspace or split_workspace(
            end_token - first_token, num_heads, head_dim, num_splits, query.device)
        assert partial_out.shape[0] >= end_token - first_token
    else:  # never read (the kernel writes `output`), but fp32 like a workspace: one variant
        partial_out = partial_lse = _fp32_placeholder(query.device)
    dot_fp32 = key_cache.dtype == torch.float32 or (
        key_cache.dtype == torch.bfloat16 and triton.knobs.runtime.interpret)
    grid = (len(seqs), triton.cdiv(max_query_len, block_q), num_kv_heads * num_splits)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, output, partial_out, partial_lse,
        meta.block_tables, meta.seq_lens, meta.query_start_loc,
        seqs.start, first_token, num_heads, scale * math.log2(math.e), num_splits,
        sliding_window or 0,
        *query.stride(), *cache_strides(key_cache), *output.stride(),
        meta.block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=key_cache.shape[2], BLOCK_Q=block_q, TILE_N=tile_n, DOT_FP32=dot_fp32,
        num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _merge_splits_kernel[(end_token - first_token, num_heads)](
            partial_out, partial_lse, output, first_token, num_heads, num_splits,
            *output.stride(), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            MAX_SPLITS=MAX_SPLITS)
