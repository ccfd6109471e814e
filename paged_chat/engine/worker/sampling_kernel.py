"""The sampler's device path as one Triton kernel (CUDA; CPU tensors under TRITON_INTERPRET):
each row's settings read from the persistent tables (input_batch.SamplingRows), its
counter-based uniform hashed from its seed's stream and output index, temperature, min-p,
top-k and top-p, and the draw, one program per row.

It picks what the torch ops of sampler.py pick from the same logits and uniforms: the
greedy rows' first argmax; the others' inverse-CDF draw in token-id order over the tokens
they keep (weights exp(x - max), none under exp(_EXP_FLOOR), the CDF summed in float64 and
compared in float32 as torch's CPU cumsum does). Top-k and top-p keep every token above a
per-row threshold found without a sort: a search over the float32 values' order (as int32
keys), each pass over the row counting the tokens and summing the weights above a few
pivots, until at most one token lies between the last pivot that drops and the first that
keeps. Where tokens tie at the threshold the kernel keeps all of them; a sort keeps those
its order puts first, so the two agree where no tie straddles the threshold.

A row whose logits hold NaN or +inf, or nothing above -inf, gets -1 (what the runner reports
as a SamplingError), as the torch path's check of the chosen logit finds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_chat.engine.worker.sampler import (
    _EXP_FLOOR,
    _GREEDY,
    _MIN_P,
    _TEMPERATURE,
    _TOP_K,
    _TOP_P,
    SettingsRows,
)

# Pivots a threshold search tries per pass over the row: each pass narrows the interval of
# keys 16-fold (or, by value, its width) for one read of the row.
_NUM_PIVOTS = 16
# Passes that space the pivots by value (as many tokens near the top as at the bottom)
# before they are spaced by key: value spacing crawls through the many keys near 0, key
# spacing ends any search within 32 bits / 4 = 8 more passes.
_VALUE_PASSES = 6
_MAX_BLOCK = 512  # columns a program holds at once, times _NUM_PIVOTS in a search pass
_KERNEL_EXP_FLOOR = tl.constexpr(_EXP_FLOOR)  # the sampler's, as a constant a kernel reads


@triton.jit
def _key(x):
    """int64 keys in the order of the float32 values `x` (-0 just under +0)."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _value(key):
    """The float32 value whose `_key` is `key`."""
    bits = key.to(tl.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _chunk(row_ptr, start, temperature, BLOCK: tl.constexpr,
           VOCAB: tl.constexpr):
    """Columns start..start+BLOCK of the row divided by its temperature (fp32, -inf past the
    vocabulary) and their ids."""
    cols = start + tl.arange(0, BLOCK)
    logits = tl.load(row_ptr + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
    return tl.math.div_rn(logits, temperature), cols


@triton.jit
def _weights(x, row_max, floor, above):
    """exp(x - max) of the tokens a row may draw, 0 for the others: under its min-p `floor`,
    under exp(_EXP_FLOOR), at or under the key `above`."""
    shifted = x - row_max
    alive = (shifted >= _KERNEL_EXP_FLOOR) & (x >= floor) & (_key(x) > above)
    return tl.where(alive, tl.exp(shifted), 0.0), alive


@triton.jit
def _cdf(row_ptr, start, below, temperature, row_max, floor, above, BLOCK: tl.constexpr,
         VOCAB: tl.constexpr):
    """The CDF (float64, unnormalised) of `_weights` over columns start..start+BLOCK, `below`
    the CDF before them, and the columns' ids."""
    x, cols = _chunk(row_ptr, start, temperature, BLOCK, VOCAB)
    weights, _ = _weights(x, row_max, floor, above)
    return below + tl.cumsum(weights.to(tl.float64), axis=0), cols


@triton.jit
def _threshold(row_ptr, temperature, row_max, floor, above, limit,
               BY_MASS: tl.constexpr, BLOCK: tl.constexpr, VOCAB: tl.constexpr,
               NUM_PIVOTS: tl.constexpr, VALUE_PASSES: tl.constexpr):
    """The key under which a row drops its tokens: the largest k such that the tokens above
    k (among those `_weights` lets through) weigh at least `limit` times all of them
    (BY_MASS: top-p) or number at least `limit` (top-k), or `above` when none is.

    Invariant: the tokens above `lo` reach the limit and those above `hi` do not; a pass
    moves both to neighbouring pivots, and it ends once at most one token lies in (lo, hi]:
    then every token above lo is kept."""
    lo = above
    hi = _key(row_max)
    tokens_above_hi = tl.full((), 0, tl.int32)
    target = limit
    passes = tl.full((), 0, tl.int32)
    searching = tl.full((), 1, tl.int1)
    pivot_index = tl.arange(0, NUM_PIVOTS).to(tl.int64)
    while searching:
        span = hi - lo
        by_key = lo + span * pivot_index // NUM_PIVOTS
        lo_value = _value(lo)
        by_value = _key(lo_value + (_value(hi) - lo_value) * (pivot_index.to(tl.float32)
                                                             / NUM_PIVOTS))
        by_value = tl.minimum(tl.maximum(by_value, lo + pivot_index),
                              hi - NUM_PIVOTS + pivot_index)
        use_keys = (span < NUM_PIVOTS) | (passes >= VALUE_PASSES)
        pivots = tl.where(pivot_index == 0, lo, tl.where(use_keys, by_key, by_value))
        mass = tl.zeros([NUM_PIVOTS], dtype=tl.float32)
        count = tl.zeros([NUM_PIVOTS], dtype=tl.int32)
        for start in range(0, VOCAB, BLOCK):
            x, _ = _chunk(row_ptr, start, temperature, BLOCK, VOCAB)
            weights, alive = _weights(x, row_max, floor, above)
            counted = alive[:, None] & (_key(x)[:, None] > pivots[None, :])
            mass += tl.sum(tl.where(counted, weights[:, None], 0.0), axis=0)
            count += tl.sum(counted.to(tl.int32), axis=0)
        if BY_MASS:  # pivot 0 of the first pass is `above`: the mass of every token
            target = tl.where(passes == 0,
                              limit * tl.sum(tl.where(pivot_index == 0, mass, 0.0), axis=0),
                              target)
            reaching = mass >= target
        else:
            reaching = count.to(tl.float32) >= limit
        num_reaching = tl.sum(reaching.to(tl.int32), axis=0)  # none: every token is kept
        at_lo = pivot_index == num_reaching - 1
        at_hi = pivot_index == num_reaching
        tokens_above_lo = tl.sum(tl.where(at_lo, count, 0), axis=0)
        if num_reaching < NUM_PIVOTS:
            hi = tl.sum(tl.where(at_hi, pivots, 0), axis=0)
            tokens_above_hi = tl.sum(tl.where(at_hi, count, 0), axis=0)
        lo = tl.where(num_reaching > 0, tl.sum(tl.where(at_lo, pivots, 0), axis=0), lo)
        searching = ((num_reaching > 0) & (tokens_above_lo - tokens_above_hi > 1)
                     & (hi - lo > 1))
        passes += 1
    return lo


@triton.jit
def _uniform(stream, output_index):
    """sampler.stream_uniforms of one row, float64."""
    z = (stream + output_index).to(tl.uint64, bitcast=True) + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return ((z >> 12).to(tl.float64) + 0.5) * 2.220446049250313e-16  # 2^-52


@triton.jit
def _sample_kernel(
    logits_ptr, stride_logits, table_ptr, stride_table, streams_ptr, rows_ptr,
    output_indices_ptr, tokens_ptr,
    VOCAB: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr,
    VALUE_PASSES: tl.constexpr, TEMPERATURE: tl.constexpr, MIN_P: tl.constexpr,
    TOP_K: tl.constexpr, TOP_P: tl.constexpr, GREEDY: tl.constexpr,
):
    """One program per row of `logits` [rows, VOCAB]: its token, or -1, into tokens_ptr."""
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_logits
    settings = table_ptr + tl.load(rows_ptr + row) * stride_table
    temperature = tl.load(settings + TEMPERATURE)
    greedy = tl.load(settings + GREEDY) > 0

    # Pass 1: the row's largest value, its first argmax, and whether it can be sampled.
    row_max = tl.full((), float("-inf"), tl.float32)
    argmax = tl.full((), 0, tl.int32)
    unsampleable = tl.full((), 0, tl.int1)
    for start in range(0, VOCAB, BLOCK):
        x, _ = _chunk(row_ptr, start, temperature, BLOCK, VOCAB)
        unsampleable |= tl.max(((x != x) | (x == float("inf"))).to(tl.int32), axis=0) > 0
        chunk_max = tl.max(x, axis=0)
        if chunk_max > row_max:
            row_max = chunk_max
            argmax = start + tl.argmax(x, axis=0, tie_break_left=True)
    unsampleable |= row_max == float("-inf")

    token = argmax.to(tl.int64)
    if unsampleable:
        token = tl.full((), -1, tl.int64)
    elif not greedy:
        min_p = tl.load(settings + MIN_P)
        floor = float("-inf")
        if min_p > 0:
            floor = row_max + tl.log(min_p)
        above = tl.minimum(_key(row_max - 88.0), _key(row_max) - 1)  # under every weight
        top_k = tl.load(settings + TOP_K)
        if top_k < VOCAB:
            above = _threshold(row_ptr, temperature, row_max, floor, above, top_k,
                               False, BLOCK, VOCAB, NUM_PIVOTS, VALUE_PASSES)
        top_p = tl.load(settings + TOP_P)
        if top_p < 1.0:
            above = _threshold(row_ptr, temperature, row_max, floor, above, top_p,
                               True, BLOCK, VOCAB, NUM_PIVOTS, VALUE_PASSES)
        # The total as the scan below sums it, to the last bit: the last CDF value reaches
        # any target under it.
        total = tl.full((), 0.0, tl.float64)
        for start in range(0, VOCAB, BLOCK):
            cdf, cols = _cdf(row_ptr, start, total, temperature, row_max, floor, above,
                             BLOCK, VOCAB)
            total = tl.max(cdf, axis=0)
        uniform = _uniform(tl.load(streams_ptr + tl.load(rows_ptr + row)),
                           tl.load(output_indices_ptr + row))
        target = (uniform * total.to(tl.float32).to(tl.float64)).to(tl.float32)
        token = tl.full((), -1, tl.int64)
        below = tl.full((), 0.0, tl.float64)
        start = tl.full((), 0, tl.int32)
        while (token < 0) & (start < VOCAB):
            cdf, cols = _cdf(row_ptr, start, below, temperature, row_max, floor, above,
                             BLOCK, VOCAB)
            first = tl.min(tl.where((cdf.to(tl.float32) >= target) & (cols < VOCAB), cols,
                                    VOCAB), axis=0)
            if first < VOCAB:
                token = first.to(tl.int64)
            below = tl.max(cdf, axis=0)
            start += BLOCK
    tl.store(tokens_ptr + row, token)


def sample_in_kernel(logits: torch.Tensor, settings: SettingsRows,
                     block: int | None = None) -> torch.Tensor:
    """Each row's token (int64 [rows]; -1 for a row it cannot sample, see the module
    docstring) of `logits` [rows, vocab] (any float dtype, rows contiguous), the rows'
    settings in `settings`. `block`: the columns a program holds at once (a power of 2),
    by default as many as the vocabulary needs up to _MAX_BLOCK."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the kernel reads each row's logits contiguous"
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    block = block or min(_MAX_BLOCK, triton.next_power_of_2(vocab))
    _sample_kernel[(rows,)](
        logits, logits.stride(0), settings.table, settings.table.stride(0), settings.streams,
        settings.rows, settings.output_indices, tokens,
        VOCAB=vocab, BLOCK=block, NUM_PIVOTS=_NUM_PIVOTS, VALUE_PASSES=_VALUE_PASSES,
        TEMPERATURE=_TEMPERATURE, MIN_P=_MIN_P, TOP_K=_TOP_K, TOP_P=_TOP_P, GREEDY=_GREEDY,
        num_warps=8)
    return tokens
