"""The CPU kernels of kernels.c, built once per machine with the system C compiler and
called through ctypes (which releases the GIL for the call).

Which kernel runs is chosen per shape, by measurement (scripts/quant_kernel_probe.py, on a
2-core AVX2 EPYC, float32, SmolLM2-135M's matrices): up to `STREAM_MAX_ROWS` rows of
activations, `pc_matmul` streams the packed weights once and dequantizes them in registers
(2.8x faster than oneDNN on the dequantized float32 weights at 1 row); above, where the
product is compute-bound, tiles of weight rows are dequantized into a reused float32
buffer that stays in cache and multiplied by MKL's GEMM. Without a compiler (or on a
failed build) every shape takes the tile path, dequantized in torch ops.

The library is built by engine/native.py (once per machine, -march=native).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from paged_chat.engine.models.quant.layout import QuantizedWeight
from paged_chat.engine.native import NativeLibrary

STREAM_MAX_ROWS = 8
# Weight rows per dequantized tile: about 1 MiB of float32, L2-sized on the CPUs measured.
_TILE_BYTES = 1 << 20
_SOURCE = Path(__file__).with_name("kernels.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64

_scratch = threading.local()


def _declare(lib: ctypes.CDLL) -> None:
    lib.pc_matmul.argtypes = [_P, _I, _P, _P, _P, _P, _I, _I, _I, _P, _I, ctypes.c_int]
    lib.pc_dequantize.argtypes = [_P, _P, _P, _P, _I, _I, _I, _P, ctypes.c_int]


_native = NativeLibrary(_SOURCE, _declare)


def library() -> ctypes.CDLL | None:
    """The built kernels, or None where no C compiler builds them."""
    return _native.load()


def build(flag_sets: tuple[list[str], ...]) -> ctypes.CDLL | None:
    """kernels.c built with the first of `flag_sets` the compiler takes, or None."""
    return _native.build(flag_sets)


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """float32 [rows, in_features] of `weight` (a tile, or gathered embedding rows)."""
    lib = library()
    if lib is None:
        return weight.dequantize()
    out = torch.empty(weight.rows, weight.in_features)
    _dequantize_into(lib, weight, out)
    return out


def _dequantize_into(lib: ctypes.CDLL, weight: QuantizedWeight, out: torch.Tensor) -> None:
    lib.pc_dequantize(weight.low.data_ptr(), _pointer(weight.high), weight.scale.data_ptr(),
                      weight.offset.data_ptr(), weight.rows, weight.in_features, weight.group,
                      out.data_ptr(), torch.get_num_threads())


def matmul(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor) -> None:
    """out (float32 [rows, weight.rows], a view with unit column stride) = x @ W.T, for
    float32 x [rows, in_features], by the kernel measured fastest for the shape; on a GPU,
    the Triton kernels (any activation dtype, out in x's)."""
    if x.device.type == "cuda":
        from paged_chat.engine.models.quant import triton_kernels

        triton_kernels.matmul(x, weight, out)
    elif x.shape[0] <= STREAM_MAX_ROWS and library() is not None:
        stream_matmul(x, weight, out)
    else:
        tile_matmul(x, weight, out)


def stream_matmul(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor) -> None:
    """`matmul` by pc_matmul: each packed weight byte read once, dequantized in registers."""
    assert x.dtype == out.dtype == torch.float32 and x.is_contiguous() and out.stride(1) == 1
    lib = library()
    assert lib is not None, "no C kernels on this machine"
    lib.pc_matmul(x.data_ptr(), x.shape[0], weight.low.data_ptr(), _pointer(weight.high),
                  weight.scale.data_ptr(), weight.offset.data_ptr(), weight.rows,
                  weight.in_features, weight.group, out.data_ptr(), out.stride(0),
                  torch.get_num_threads())


def tile_matmul(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor) -> None:
    """`matmul` by tiles of weight rows dequantized into a reused buffer, then MKL."""
    assert x.dtype == out.dtype == torch.float32 and out.stride(1) == 1
    lib = library()
    tile_rows = max(1, _TILE_BYTES // (4 * weight.in_features))
    buffer = _tile_buffer(tile_rows * weight.in_features)
    for start in range(0, weight.rows, tile_rows):
        tile = weight.narrow(start, min(tile_rows, weight.rows - start))
        if lib is None:
            values = tile.dequantize()
        else:
            values = buffer[:tile.rows * tile.in_features].view(tile.rows, tile.in_features)
            _dequantize_into(lib, tile, values)
        torch.mm(x, values.t(), out=out[:, start:start + tile.rows])


def _tile_buffer(elements: int) -> torch.Tensor:
    """This thread's reused float32 tile buffer, grown to at least `elements`."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < elements:
        buffer = _scratch.buffer = torch.empty(elements)
    return buffer
