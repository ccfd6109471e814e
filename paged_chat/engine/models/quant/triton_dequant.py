"""Triton kernels over the quantized layout of layout.py, for weights held on a GPU.

`out = x @ W.T` for activations x [M, K] (fp16, bf16 or fp32) and a QuantizedWeight W
[N, K]: w = scale * code + offset per group of G weights, the code's low nibbles in `low`
and its high nibbles, for formats of more than 4 bits, in `high`. In each group, byte i of
a plane holds weight i (bits 0-3) and weight i + G/2 (bits 4-7). A tile of BLOCK_K weights
is read as its BLOCK_K / 2 bytes; byte b stands for the two positions

    k_low(b) = k0 + (b // (G/2)) * G + b % (G/2)   and   k_low(b) + G/2,

so the kernels never interleave nibbles: they gather the matching entries of x instead,
and the product splits into the low-nibble half and the high-nibble half of every group.

- `_gemv_kernel` (M <= GEMV_MAX_ROWS, decode): one program per BLOCK_N weight rows and one
  of SPLIT_K ranges of K; the weights are dequantized in registers, multiplied into each
  row of x with fp32 accumulation, and the splits are summed by atomic adds into an fp32
  output (split-K keeps every SM busy when N alone gives too few programs).
- `_dot_kernel` (prefill and big batches): tiles of x [BLOCK_M, BLOCK_K/2] (two, one per
  half) and of W dequantized in registers to the activation dtype, two `tl.dot`s with fp32
  accumulation. fp32 activations multiply in exact fp32 (not tf32), and so do 16-bit ones
  under TRITON_INTERPRET, whose bf16 dot is wrong.

Every tile edge is masked (N need not be a multiple of BLOCK_N, nor M of BLOCK_M); K is a
multiple of 32, as layout.py asserts, and BLOCK_K divides into whole groups.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from paged_chat.engine.models.quant.layout import QuantizedWeight

GEMV_MAX_ROWS = 8
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dequantized_halves(low_ptr, high_ptr, scale_ptr, offset_ptr, rows, row_mask, byte,
                        byte_mask, stride_plane, stride_groups, GROUP: tl.constexpr,
                        HAS_HIGH: tl.constexpr):
    """The weights of bytes `byte` of weight rows `rows`, as (low half, high half) fp32
    [len(rows), len(byte)], zero where masked."""
    mask = row_mask[:, None] & byte_mask[None, :]
    planes = rows[:, None].to(tl.int64) * stride_plane + byte[None, :]
    packed = tl.load(low_ptr + planes, mask=mask, other=0).to(tl.int32)
    code_low = packed & 15
    code_high = packed >> 4
    if HAS_HIGH:
        upper = tl.load(high_ptr + planes, mask=mask, other=0).to(tl.int32)
        code_low = code_low | ((upper & 15) << 4)
        code_high = code_high | (upper & 0xF0)
    groups = rows[:, None].to(tl.int64) * stride_groups + (byte // (GROUP // 2))[None, :]
    scale = tl.load(scale_ptr + groups, mask=mask, other=0.0)
    offset = tl.load(offset_ptr + groups, mask=mask, other=0.0)
    return (code_low.to(tl.float32) * scale + offset,
            code_high.to(tl.float32) * scale + offset)


@triton.jit
def _weight_tile(low_ptr, high_ptr, scale_ptr, offset_ptr, rows, row_mask, k0, k_end,
                 stride_plane, stride_groups, GROUP: tl.constexpr, HAS_HIGH: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The tile of weights k0 <= k < min(k0 + BLOCK_K, k_end) of rows `rows`: (low half,
    high half, each [len(rows), BLOCK_K / 2] fp32, zero where masked; the positions k_low
    of the low half in x (the high half's are k_low + GROUP / 2); which bytes are real)."""
    index = tl.arange(0, BLOCK_K // 2)
    byte = k0 // 2 + index
    byte_mask = byte < k_end // 2
    w_low, w_high = _dequantized_halves(low_ptr, high_ptr, scale_ptr, offset_ptr, rows,
                                        row_mask, byte, byte_mask, stride_plane, stride_groups,
                                        GROUP, HAS_HIGH)
    k_low = k0 + (index // (GROUP // 2)) * GROUP + index % (GROUP // 2)
    return w_low, w_high, k_low, byte_mask


@triton.jit
def _gemv_kernel(x_ptr, low_ptr, high_ptr, scale_ptr, offset_ptr, out_ptr, M, N, K,
                 stride_xm, stride_plane, stride_groups, stride_om, k_per_split,
                 GROUP: tl.constexpr, HAS_HIGH: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for m in range(M):
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            w_low, w_high, k_low, byte_mask = _weight_tile(
                low_ptr, high_ptr, scale_ptr, offset_ptr, rows, row_mask, k0, k_end,
                stride_plane, stride_groups, GROUP, HAS_HIGH, BLOCK_K)
            x_row = x_ptr + m * stride_xm
            x_low = tl.load(x_row + k_low, mask=byte_mask, other=0.0).to(tl.float32)
            x_high = tl.load(x_row + k_low + GROUP // 2, mask=byte_mask, other=0.0).to(tl.float32)
            acc += tl.sum(w_low * x_low[None, :] + w_high * x_high[None, :], axis=1)
        tl.atomic_add(out_ptr + m * stride_om + rows, acc, mask=row_mask)


@triton.jit
def _dot_kernel(x_ptr, low_ptr, high_ptr, scale_ptr, offset_ptr, out_ptr, M, N, K,
                stride_xm, stride_plane, stride_groups, stride_om,
                GROUP: tl.constexpr, HAS_HIGH: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXACT_FP32: tl.constexpr):
    x_rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_mask = x_rows < M
    row_mask = rows < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_low, w_high, k_low, byte_mask = _weight_tile(
            low_ptr, high_ptr, scale_ptr, offset_ptr, rows, row_mask, k0, K, stride_plane,
            stride_groups, GROUP, HAS_HIGH, BLOCK_K)
        x_tile = x_ptr + x_rows[:, None].to(tl.int64) * stride_xm + k_low[None, :]
        x_mask_tile = x_mask[:, None] & byte_mask[None, :]
        x_low = tl.load(x_tile, mask=x_mask_tile, other=0.0)
        x_high = tl.load(x_tile + GROUP // 2, mask=x_mask_tile, other=0.0)
        if EXACT_FP32:
            acc += tl.dot(x_low.to(tl.float32), tl.trans(w_low), input_precision="ieee")
            acc += tl.dot(x_high.to(tl.float32), tl.trans(w_high), input_precision="ieee")
        else:
            acc += tl.dot(x_low, tl.trans(w_low.to(x_low.dtype)))
            acc += tl.dot(x_high, tl.trans(w_high.to(x_high.dtype)))
    out = out_ptr + x_rows[:, None].to(tl.int64) * stride_om + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=x_mask[:, None] & row_mask[None, :])


def choose_split_k(n_programs: int, k: int, block_k: int, target_programs: int) -> int:
    """How many K ranges a GEMV is cut into: enough programs for `target_programs` (about
    the SMs times their resident programs), never a range shorter than one tile."""
    tiles = triton.cdiv(k, block_k)
    return max(1, min(tiles, triton.cdiv(target_programs, n_programs)))


def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def matmul(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor, *,
           block_n: int = 64, block_k: int | None = None, block_m: int = 32,
           num_stages: int = 2) -> None:
    """out [M, weight.rows] (unit column stride) = x @ W.T for x [M, K], on x's device.
    fp32 activations take tiles of a quarter of the K (32, not 128), as the dot kernel's
    exact fp32 products run on FMA units, in registers: at 128 it overflowed sm_86/89's
    shared memory, at 64 it spilled even with 8 warps (device_check.py's compile stage)."""
    m, k = x.shape
    fp32 = x.dtype == torch.float32
    block_k = block_k or (32 if fp32 else 128)
    assert k == weight.in_features and out.shape == (m, weight.rows) and out.stride(1) == 1
    assert x.stride(1) == 1 and block_k % weight.group == 0 and block_k % 32 == 0
    high = weight.high if weight.high is not None else weight.low
    common = dict(GROUP=weight.group, HAS_HIGH=weight.high is not None)
    if m <= GEMV_MAX_ROWS:
        n_programs = triton.cdiv(weight.rows, block_n)
        splits = choose_split_k(n_programs, k, block_k, _target_programs(x.device))
        k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
        splits = triton.cdiv(k, k_per_split)
        partial = torch.zeros(m, weight.rows, dtype=torch.float32, device=x.device)
        _gemv_kernel[(n_programs, splits)](
            x, weight.low, high, weight.scale, weight.offset, partial, m, weight.rows, k,
            x.stride(0), weight.low.stride(0), weight.scale.stride(0), partial.stride(0),
            k_per_split, BLOCK_N=block_n, BLOCK_K=block_k, **common)
        out.copy_(partial)
        return
    # The interpreter truncates fp32 to 16 bits where a GPU rounds: it writes fp32 here.
    target = torch.empty(m, weight.rows, device=x.device) if _INTERPRETED else out
    grid = (triton.cdiv(m, block_m), triton.cdiv(weight.rows, block_n))
    _dot_kernel[grid](
        x, weight.low, high, weight.scale, weight.offset, target, m, weight.rows, k,
        x.stride(0), weight.low.stride(0), weight.scale.stride(0), target.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EXACT_FP32=fp32 or _INTERPRETED, num_stages=num_stages, **common)
    if target is not out:
        out.copy_(target)
