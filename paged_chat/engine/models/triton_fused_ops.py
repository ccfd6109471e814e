"""The decoder's pointwise work on the CUDA path as one Triton kernel each: residual add +
RMSNorm, RoPE (after the q/k norm where the model has one) fused with the K/V store into
the paged cache, and the gated activation (SiLU or GELU-tanh, times the up projection).
Gemma 3's norm after attention, residual add and norm before the MLP are one kernel too.

Numerics follow the torch ops in llama.py, rounding where they round: the sum of the
residual add, the normalised rows before Llama's weight, each product of the rotation and
the activation before its multiply are rounded to the model's dtype, everything else is
fp32.

Each kernel takes its sizes from the model (constexprs: one compiled variant per model)
and its row count from the grid, so a step's batch never compiles another variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_chat.engine.attention.triton_paged_attention import cache_offsets, cache_strides

# sqrt(2 / pi): the tanh approximation of GELU, as torch's approximate="tanh".
_GELU_BETA = tl.constexpr(0.7978845608028654)
_GELU_KAPPA = tl.constexpr(0.044715)
# Columns of the gated activation per program.
_ACTIVATION_BLOCK = 1024


@triton.jit
def _rms_norm(x, weight_ptr, cols, valid, eps, dtype, HIDDEN: tl.constexpr,
              UNIT_OFFSET: tl.constexpr):
    """RMSNorm(x) * weight (Llama) or * (1 + weight) (Gemma) of fp32 `x`, in `dtype`."""
    normed = x * tl.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)
    weight = tl.load(weight_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        return (normed * (1.0 + weight)).to(dtype)
    return (normed.to(dtype).to(tl.float32) * weight).to(dtype)


@triton.jit
def _add_rms_norm_kernel(
    delta_ptr, residual_ptr, weight_ptr, delta_weight_ptr, out_ptr, eps, delta_eps,
    stride_delta, stride_residual, stride_out,
    HIDDEN: tl.constexpr, HIDDEN_PAD: tl.constexpr, HAS_DELTA: tl.constexpr,
    DELTA_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    """One program per row: residual += delta (RMSNormed by the delta weights first if
    DELTA_NORM; the sum rounded and stored) unless HAS_DELTA is off, then
    out = RMSNorm(residual) * weight (Llama) or * (1 + weight) (Gemma, both norms)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, HIDDEN_PAD)
    valid = cols < HIDDEN
    dtype = residual_ptr.dtype.element_ty
    x = tl.load(residual_ptr + row * stride_residual + cols, mask=valid, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row * stride_delta + cols, mask=valid, other=0.0)
        if DELTA_NORM:
            delta = _rms_norm(delta.to(tl.float32), delta_weight_ptr, cols, valid, delta_eps,
                              dtype, HIDDEN, UNIT_OFFSET)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(dtype)
        tl.store(residual_ptr + row * stride_residual + cols, x, mask=valid)
    out = _rms_norm(x.to(tl.float32), weight_ptr, cols, valid, eps, dtype, HIDDEN, UNIT_OFFSET)
    tl.store(out_ptr + row * stride_out + cols, out, mask=valid)


@triton.jit
def _rotate_heads(row_ptr, norm_ptr, cos, sin, eps,
                  NUM: tl.constexpr, NUM_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HALF_PAD: tl.constexpr, QK_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """The NUM heads at `row_ptr` (head-major, HEAD_DIM apart), each RMSNormed by the
    weights at `norm_ptr` if QK_NORM, rotated (rotate-half) by cos/sin [HALF_PAD]:
    (first halves, second halves, mask), [NUM_PAD, HALF_PAD] each, in the row's dtype."""
    dtype = row_ptr.dtype.element_ty
    heads = tl.arange(0, NUM_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    valid = (heads < NUM) & (dims < HEAD_DIM // 2)
    first = row_ptr + heads * HEAD_DIM + dims
    x1 = tl.load(first, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(first + HEAD_DIM // 2, mask=valid, other=0.0).to(tl.float32)
    if QK_NORM:
        scale = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        w1 = tl.load(norm_ptr + dims, mask=dims < HEAD_DIM // 2, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + HEAD_DIM // 2 + dims, mask=dims < HEAD_DIM // 2,
                     other=0.0).to(tl.float32)
        x1 = x1 * scale[:, None]
        x2 = x2 * scale[:, None]
        if UNIT_OFFSET:
            x1 = (x1 * (1.0 + w1)).to(dtype).to(tl.float32)
            x2 = (x2 * (1.0 + w2)).to(dtype).to(tl.float32)
        else:
            x1 = (x1.to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            x2 = (x2.to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    out1 = ((x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32))
    out2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32))
    return out1.to(dtype), out2.to(dtype), valid


@triton.jit
def _rope_and_store_kernel(
    qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr,
    key_cache_ptr, value_cache_ptr, slot_mapping_ptr, eps,
    stride_qkv, stride_table, stride_cb, stride_cs, stride_ch, stride_cd,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QK_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    """One program per token of the fused QKV output [tokens, (heads + 2 kv_heads) * dim]:
    rotate its Q heads in place, and write its rotated K and its V into its cache slot
    (none for slot -1). The cos/sin tables repeat their first half (cat(freqs, freqs))."""
    token = tl.program_id(0)
    row_ptr = qkv_ptr + token.to(tl.int64) * stride_qkv
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + position * stride_table + dims, mask=dims < HEAD_DIM // 2,
                  other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + position * stride_table + dims, mask=dims < HEAD_DIM // 2,
                  other=0.0).to(tl.float32)[None, :]

    q1, q2, q_valid = _rotate_heads(row_ptr, q_norm_ptr, cos, sin, eps, NUM_HEADS, HEADS_PAD,
                                    HEAD_DIM, HALF_PAD, QK_NORM, UNIT_OFFSET)
    q_first = row_ptr + tl.arange(0, HEADS_PAD)[:, None] * HEAD_DIM + dims[None, :]
    tl.store(q_first, q1, mask=q_valid)
    tl.store(q_first + HEAD_DIM // 2, q2, mask=q_valid)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        k_ptr = row_ptr + NUM_HEADS * HEAD_DIM
        k1, k2, k_valid = _rotate_heads(k_ptr, k_norm_ptr, cos, sin, eps, NUM_KV_HEADS,
                                        KV_HEADS_PAD, HEAD_DIM, HALF_PAD, QK_NORM, UNIT_OFFSET)
        heads = tl.arange(0, KV_HEADS_PAD)[:, None]
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        k_first = key_cache_ptr + cache_offsets(block, offset, heads, dims[None, :],
                                                stride_cb, stride_cs, stride_ch, stride_cd)
        cache_type = key_cache_ptr.dtype.element_ty
        tl.store(k_first, k1.to(cache_type), mask=k_valid)
        tl.store(k_first + (HEAD_DIM // 2) * stride_cd, k2.to(cache_type), mask=k_valid)
        v_ptr = k_ptr + NUM_KV_HEADS * HEAD_DIM
        v_first = value_cache_ptr + cache_offsets(block, offset, heads, dims[None, :],
                                                  stride_cb, stride_cs, stride_ch, stride_cd)
        for part in tl.static_range(2):  # V unrotated, in the halves K was written in
            v = tl.load(v_ptr + heads * HEAD_DIM + part * (HEAD_DIM // 2) + dims[None, :],
                        mask=k_valid, other=0.0)
            tl.store(v_first + part * (HEAD_DIM // 2) * stride_cd, v.to(cache_type),
                     mask=k_valid)


@triton.jit
def _act_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out,
    SIZE: tl.constexpr, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr,
):
    """Grid (rows, column blocks): out = act(gate) * up for gate_up rows [gate | up]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < SIZE
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + SIZE + cols, mask=valid, other=0.0)
    if GELU_TANH:
        inner = _GELU_BETA * (gate + _GELU_KAPPA * gate * gate * gate)
        # tanh from exp(-2|u|), which never overflows.
        decay = tl.exp(-2.0 * tl.abs(inner))
        magnitude = (1.0 - decay) / (1.0 + decay)
        tanh = tl.where(inner >= 0, magnitude, -magnitude)
        activated = 0.5 * gate * (1.0 + tanh)
    else:
        activated = gate / (1.0 + tl.exp(-gate))
    dtype = out_ptr.dtype.element_ty
    out = activated.to(dtype).to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(dtype), mask=valid)


def _row_warps(width: int) -> int:
    """Warps for one program over a row of `width` elements: enough that each thread
    holds a few of them."""
    return max(1, min(16, triton.next_power_of_2(width) // 256))


def add_rms_norm(delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, unit_offset: bool = False,
                 delta_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """residual += delta in place (unless None), then RMSNorm(residual) times `weight`
    (times 1 + weight with `unit_offset`, Gemma's); rows [rows, hidden], unit column stride.
    `delta_norm` (weight, eps): the delta is RMSNormed with them first (Gemma's norm after
    attention, then the residual add and the norm before the MLP, in one kernel)."""
    rows, hidden = residual.shape
    out = torch.empty((rows, hidden), dtype=residual.dtype, device=residual.device)
    if rows == 0:
        return out
    assert residual.stride(1) == 1 and (delta is None or delta.stride(1) == 1)
    has_delta = delta is not None
    delta_weight, delta_eps = delta_norm if delta_norm is not None else (weight, eps)
    _add_rms_norm_kernel[(rows,)](
        delta if has_delta else residual, residual, weight, delta_weight, out, eps, delta_eps,
        delta.stride(0) if has_delta else 0, residual.stride(0), out.stride(0),
        HIDDEN=hidden, HIDDEN_PAD=triton.next_power_of_2(hidden), HAS_DELTA=has_delta,
        DELTA_NORM=delta_norm is not None, UNIT_OFFSET=unit_offset,
        num_warps=_row_warps(hidden))
    return out


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int, qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
                   eps: float = 0.0, unit_offset: bool = False) -> torch.Tensor:
    """Rotate the Q heads of the fused QKV output `qkv` [tokens, (heads + 2 kv_heads) *
    head_dim] in place and store each token's rotated K and its V in slot
    `slot_mapping[t]` of the caches (as `store_kv`; slot -1 stores nothing). cos/sin are
    the whole tables [positions, head_dim], read at `positions`; `qk_norm`: the (q, k)
    RMSNorm weights applied per head before the rotation. Returns the queries, a view
    [tokens, heads, head_dim] of `qkv`."""
    num_tokens = qkv.shape[0]
    query = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    if num_tokens == 0:
        return query
    assert qkv.stride(1) == 1 and cos.stride() == sin.stride() and cos.stride(1) == 1
    assert key_cache.stride() == value_cache.stride(), "K and V caches must share a layout"
    q_norm, k_norm = qk_norm if qk_norm is not None else (cos, cos)
    _rope_and_store_kernel[(num_tokens,)](
        qkv, positions, cos, sin, q_norm, k_norm, key_cache, value_cache, slot_mapping, eps,
        qkv.stride(0), cos.stride(0), *cache_strides(key_cache),
        NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HALF_PAD=triton.next_power_of_2(head_dim // 2),
        BLOCK_SIZE=key_cache.shape[2], QK_NORM=qk_norm is not None, UNIT_OFFSET=unit_offset,
        num_warps=_row_warps(num_heads * head_dim))
    return query


def act_and_mul(gate_up: torch.Tensor, gelu_tanh: bool = False) -> torch.Tensor:
    """silu(gate) * up, or gelu_tanh(gate) * up, for gate_up [rows, 2 * size] (gate first)
    -> [rows, size]."""
    rows, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, size), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    assert gate_up.stride(1) == 1
    block = min(_ACTIVATION_BLOCK, triton.next_power_of_2(size))
    _act_and_mul_kernel[(rows, triton.cdiv(size, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), SIZE=size, BLOCK=block,
        GELU_TANH=gelu_tanh, num_warps=_row_warps(block))
    return out
