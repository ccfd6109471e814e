"""The CPU kernels of kernels.c, built once per machine with the system C compiler and
called through ctypes (which releases the GIL for the call).

Which kernel runs is chosen per shape, by measurement (scripts/quant_kernel_probe.py, on a
2-core AVX2 EPYC, float32, SmolLM2-135M's matrices, ms per decode step's linear layers):
up to `STREAM_MAX_ROWS` rows of activations, `pc_matmul` streams the packed weights once
and dequantizes them in registers (1 row: 11 ms, 2.8x faster than oneDNN on the
dequantized float32 weights); above, where the product is compute-bound, `pc_gemm`
dequantizes tiles of weight rows into a buffer that stays in L2 and multiplies them by
register-blocked FMAs (32 rows: 76 ms, against 96 for oneDNN on float32 weights and 120-130
for dequantized tiles through MKL; 512 rows: 1.18 against 1.25 s). Without AVX2 that
path is `tile_matmul`'s: tiles dequantized (in torch ops where nothing is built), then MKL.

The library is built by engine/native.py (once per machine, -march=native).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from paged_chat.engine.models.quant.layout import QuantizedWeight
from paged_chat.engine.native import NativeLibrary

STREAM_MAX_ROWS = 4
# Weight rows per dequantized tile: about 1 MiB of float32, L2-sized on the CPUs measured.
_TILE_BYTES = 1 << 20
_SOURCE = Path(__file__).with_name("kernels.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64

_scratch = threading.local()


def _declare(lib: ctypes.CDLL) -> None:
    lib.pc_matmul.argtypes = [_P, _I, _P, _P, _P, _P, _I, _I, _I, _P, _I, ctypes.c_int]
    if hasattr(lib, "pc_gemm"):
        lib.pc_gemm.argtypes = lib.pc_matmul.argtypes
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
        return
    lib = library()
    if lib is not None and x.shape[0] <= STREAM_MAX_ROWS:
        stream_matmul(x, weight, out)
    elif lib is not None and hasattr(lib, "pc_gemm"):
        gemm_matmul(x, weight, out)
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


def gemm_matmul(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor) -> None:
    """`matmul` by pc_gemm: tiles of weight rows dequantized once into L2, register-blocked."""
    assert x.dtype == out.dtype == torch.float32 and x.is_contiguous() and out.stride(1) == 1
    lib = library()
    assert lib is not None and hasattr(lib, "pc_gemm"), "no AVX2 kernels on this machine"
    lib.pc_gemm(x.data_ptr(), x.shape[0], weight.low.data_ptr(), _pointer(weight.high),
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
