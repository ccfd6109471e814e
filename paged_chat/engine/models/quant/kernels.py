"""The CPU kernels of native/csrc/quant_kernels.c, called through ctypes (which releases
the GIL for the call), from the engine's native library (engine/native/bindings.py).

Which kernel runs is chosen per shape, by measurement (benchmarks/quant_kernel_probe.py):
up to `STREAM_MAX_ROWS` rows of activations, `pc_matmul` streams the packed weights once
and dequantizes them in registers; above, where the product is compute-bound, `pc_gemm`
dequantizes tiles of weight rows into a buffer that stays in L2 and multiplies them by
register-blocked FMAs. Without AVX2 that path is `tile_matmul`'s: tiles dequantized (in
torch ops where nothing is built), then MKL.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from paged_chat.engine.models.quant.layout import QuantizedWeight
from paged_chat.engine.native import bindings

STREAM_MAX_ROWS = 4
# Weight rows per dequantized tile: about 1 MiB of float32, L2-sized on the CPUs measured.
_TILE_BYTES = 1 << 20

_scratch = threading.local()


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def dequantize(weight: QuantizedWeight, ids: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [rows, in_features] of `weight`, or of its rows `ids` (int64, an embedding
    lookup: gathered and dequantized in one call, where the host's few ops before a step's
    weights stream in run with cold caches)."""
    lib = bindings.library()
    if lib is None or ids is not None and ids.device.type != "cpu":
        return (weight if ids is None else weight.select(ids)).dequantize()
    if ids is not None and ids.dtype != torch.int64:
        ids = ids.long()
    out = torch.empty(weight.rows if ids is None else ids.numel(), weight.in_features)
    _dequantize_into(lib, weight, out, ids)
    return out


def _dequantize_into(lib: ctypes.CDLL, weight: QuantizedWeight, out: torch.Tensor,
                     ids: torch.Tensor | None = None) -> None:
    low, high, scale, offset, rows, in_features, group = _weight_args(weight)
    assert ids is None or ids.dtype == torch.int64 and ids.is_contiguous()
    if lib.pc_dequantize(low, high, scale, offset, rows,
                         None if ids is None else ids.data_ptr(),
                         rows if ids is None else ids.numel(), in_features, group,
                         out.data_ptr(), torch.get_num_threads()) != 0:
        raise IndexError(f"a row id is outside the table's {rows} rows")


# (group, has a high plane) of every format family, as quant_kernels.c compiles its row kernels
# (FORMAT_VARIANTS): Q4_0/Q4_1/Q4_K; Q5_*/Q8_0; Q6_K.
KERNEL_FORMATS = ((32, False), (32, True), (16, True))


def _weight_args(weight: QuantizedWeight) -> tuple[int | None, ...]:
    """What every kernel of quant_kernels.c takes for a weight, in its order: the planes',
    scales' and offsets' addresses, rows, in_features, group."""
    assert (weight.group, weight.high is not None) in KERNEL_FORMATS, weight.format
    return (weight.low.data_ptr(), _pointer(weight.high), weight.scale.data_ptr(),
            weight.offset.data_ptr(), weight.rows, weight.in_features, weight.group)


class LayerMatmul:
    """out = x @ W.T for one layer's weight `parts` (their output rows side by side in
    out's columns), by the kernel measured fastest for the shape: pc_matmul up to
    STREAM_MAX_ROWS rows of x, pc_gemm above (tile_matmul where they are not built), the
    Triton kernels on a GPU. Each part's addresses are read once, here: a decode step
    calls a layer's product about 120 times, and reading them is most of a call's Python
    time. The parts' tensors are never replaced (nothing assigns a QuantizedWeight's
    fields) and this object holds them, so the addresses stay valid."""

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        self.parts = parts
        self.columns = [sum(p.rows for p in parts[:i]) for i in range(len(parts))]
        self.args = [_weight_args(part) for part in parts]

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """`out` (a view with unit column stride) = x @ W.T; float32 x and out on the CPU
        (x contiguous), any activation dtype on a GPU (out in x's)."""
        if x.device.type == "cuda":
            from paged_chat.engine.models.quant import triton_dequant

            for part, column in zip(self.parts, self.columns):
                triton_dequant.matmul(x, part, out[:, column:column + part.rows])
            return
        assert x.dtype == out.dtype == torch.float32 and x.is_contiguous() and out.stride(1) == 1
        rows, lib = x.shape[0], bindings.library()
        if lib is not None and rows <= STREAM_MAX_ROWS:
            kernel = lib.pc_matmul
        elif lib is not None and hasattr(lib, "pc_gemm"):
            kernel = lib.pc_gemm
        else:
            for part, column in zip(self.parts, self.columns):
                tile_matmul(x, part, out[:, column:column + part.rows])
            return
        x_address, out_address, out_stride = x.data_ptr(), out.data_ptr(), out.stride(0)
        threads = torch.get_num_threads()
        for args, column in zip(self.args, self.columns):
            kernel(x_address, rows, *args, out_address + 4 * column, out_stride, threads)


def stream_matmul(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor) -> None:
    """`LayerMatmul` of one weight by pc_matmul: each packed weight byte read once,
    dequantized in registers."""
    _run_kernel("pc_matmul", x, weight, out)


def gemm_matmul(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor) -> None:
    """`LayerMatmul` of one weight by pc_gemm: tiles of weight rows dequantized once into
    L2, register-blocked."""
    _run_kernel("pc_gemm", x, weight, out)


def _run_kernel(name: str, x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor) -> None:
    assert x.dtype == out.dtype == torch.float32 and x.is_contiguous() and out.stride(1) == 1
    lib = bindings.library()
    assert lib is not None and hasattr(lib, name), f"{name} is not built on this machine"
    getattr(lib, name)(x.data_ptr(), x.shape[0], *_weight_args(weight), out.data_ptr(),
                       out.stride(0), torch.get_num_threads())


def tile_matmul(x: torch.Tensor, weight: QuantizedWeight, out: torch.Tensor) -> None:
    """`LayerMatmul` of one weight by tiles of weight rows dequantized into a reused
    buffer, then MKL."""
    assert x.dtype == out.dtype == torch.float32 and out.stride(1) == 1
    lib = bindings.library()
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
