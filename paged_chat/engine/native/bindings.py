"""The engine's native library: every C source of csrc/ built into one library (build.py),
loaded once per process, and its interface from Python: each function's argument and
result types, and the C structs mirrored as ctypes Structures. At load, each Structure's
size is checked against the C side's sizeof (a `dl_*_size`/`pa_problem_size` function), so
a layout that drifted is an error naming the struct, not memory read at the wrong offsets.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from pathlib import Path

from paged_chat.engine.native.build import NATIVE_FLAG_SETS, compile_library

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(CSRC / name for name in ("decode_layer.c", "fused_ops.c", "paged_attention.c",
                                         "quant_kernels.c"))
LIBRARY_NAME = "paged-chat-kernels"
MAX_PARTS = 3  # decode_layer.c's DL_MAX_PARTS

_P, _I, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int

# paged_attention.h's PA_KV_*: the KV cache dtypes the kernels read and write, by name.
KV_DTYPE_CODES = {"float32": 0, "bfloat16": 1, "int8": 2}


class PagedAttentionProblem(ctypes.Structure):
    """paged_attention.h's pa_problem: one call's attention."""
    _fields_ = [("query", _P), ("key", _P), ("value", _P), ("q_stride", _I), ("k_stride", _I),
                ("v_stride", _I), ("key_cache", _P), ("value_cache", _P), ("kv_dtype", _I),
                ("num_blocks", _I),
                ("block_size", _I), ("slot_mapping", _P), ("num_tokens", _I),
                ("query_start", _P), ("seq_lens", _P), ("block_tables", _P),
                ("table_width", _I), ("num_seqs", _I), ("heads", _I), ("kv_heads", _I),
                ("dim", _I), ("scale", _F), ("window", _I), ("out", _P)]


class LinearStruct(ctypes.Structure):
    """decode_layer.c's dl_linear: one quantized linear layer's parts."""
    _fields_ = [("low", _P * MAX_PARTS), ("high", _P * MAX_PARTS), ("scale", _P * MAX_PARTS),
                ("offset", _P * MAX_PARTS), ("rows", _I * MAX_PARTS), ("group", _I * MAX_PARTS),
                ("column", _I * MAX_PARTS), ("parts", _I), ("in_features", _I),
                ("out_features", _I)]


class LayerStruct(ctypes.Structure):
    """decode_layer.c's dl_layer: what a layer holds."""
    _fields_ = [("qkv", LinearStruct), ("o", LinearStruct), ("gate_up", LinearStruct),
                ("down", LinearStruct),
                ("input_norm", _P), ("post_norm", _P), ("eps", _F), ("scale", _F),
                ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("window", _I),
                ("key_cache", _P), ("value_cache", _P), ("kv_dtype", _I), ("num_blocks", _I),
                ("block_size", _I)]


class StepStruct(ctypes.Structure):
    """decode_layer.c's dl_step: what one step shares over its layers."""
    _fields_ = [("tokens", _I), ("num_seqs", _I), ("table_width", _I), ("stream_max_rows", _I),
                ("cos", _P), ("sin", _P), ("slot_mapping", _P), ("query_start", _P),
                ("seq_lens", _P), ("block_tables", _P), ("normed", _P), ("qkv", _P),
                ("attended", _P), ("gate_up", _P), ("mid", _P), ("threads", _INT)]


# Each mirrored struct and the C function that returns its sizeof.
STRUCT_SIZES: tuple[tuple[type[ctypes.Structure], str], ...] = (
    (PagedAttentionProblem, "pa_problem_size"), (LinearStruct, "dl_linear_size"),
    (LayerStruct, "dl_layer_size"), (StepStruct, "dl_step_size"))

_MATMUL = [_P, _I, _P, _P, _P, _P, _I, _I, _I, _P, _I, _INT]
# name -> (argtypes, restype); None marks what only AVX2 builds have.
_FUNCTIONS: dict[str, tuple[list, type | None]] = {
    "pa_attention": ([ctypes.POINTER(PagedAttentionProblem), _INT], None),
    "fo_add_rms_norm": ([_P, _P, _P, _F, _I, _I, _P, _INT], None),
    "fo_rope": ([_P, _I, _I, _I, _I, _P, _P, _INT], None),
    "fo_silu_and_mul": ([_P, _I, _I, _P, _INT], None),
    "pc_matmul": (_MATMUL, None),
    "pc_dequantize": ([_P, _P, _P, _P, _I, _P, _I, _I, _I, _P, _INT], _INT),
    **{function: ([], _I) for _, function in STRUCT_SIZES},
}
_AVX2_FUNCTIONS: dict[str, tuple[list, type | None]] = {
    "pc_gemm": (_MATMUL, None),
    "dl_decode_layers": ([_P, _I, _P, _P, _P], _INT),
}


class StructLayoutError(RuntimeError):
    """A Structure here and its C struct differ in size: one was edited without the other."""


def check_struct_sizes(lib: ctypes.CDLL,
                       structs: Sequence[tuple[type[ctypes.Structure], str]] = STRUCT_SIZES
                       ) -> None:
    """Raise StructLayoutError where a Structure's size is not its C struct's."""
    for struct, function in structs:
        in_c = getattr(lib, function)()
        if ctypes.sizeof(struct) != in_c:
            raise StructLayoutError(
                f"{struct.__name__} is {ctypes.sizeof(struct)} bytes in bindings.py but "
                f"{in_c} in C ({function}): update one to match the other")


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (argtypes, restype) in _FUNCTIONS.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    for name, (argtypes, restype) in _AVX2_FUNCTIONS.items():
        if hasattr(lib, name):
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, restype
    check_struct_sizes(lib)
    return lib


def build(flag_sets: Sequence[list[str]]) -> ctypes.CDLL | None:
    """The library built with the first of `flag_sets` the compiler takes, declared and
    checked, or None (tests build variants: without AVX2, say)."""
    lib = compile_library(LIBRARY_NAME, SOURCES, flag_sets)
    return None if lib is None else _declare(lib)


_library: ctypes.CDLL | None = None
_loaded = False
_lock = threading.Lock()


def library() -> ctypes.CDLL | None:
    """The library built for this machine (once per process), or None where it does not
    build or load (then the torch paths run)."""
    global _library, _loaded
    if _loaded:  # the hot path: several hundred calls a decode step, no lock
        return _library
    with _lock:
        if not _loaded:
            _library = build(NATIVE_FLAG_SETS)
            _loaded = True
    return _library

