"""Q4_K, Q5_K and Q6_K: super-blocks of 256 weights with quantized sub-block scales.

Q4_K / Q5_K: 8 sub-blocks of 32, w = (d * sc) * q - dmin * m with 6-bit sc and m packed in
12 bytes (unpacked by gguf's own `Q4_K.get_scale_min`); q is 4 bits (Q5_K: plus one high
bit from qh). The 128 bytes of low nibbles hold sub-blocks 2j (low) and 2j + 1 (high) in
32-byte chunk j. Q6_K: 16 sub-blocks of 16, w = (d * sc) * (q - 32) with an int8 sc and a
6-bit q (4 low bits in ql, 2 high bits in qh).
"""

from __future__ import annotations

import numpy as np
from gguf.quants import Q4_K

from paged_chat.engine.models.quant.layout import BlockFormat

_SUPER = 256


def _split(raw: np.ndarray, block_bytes: int, sizes: list[int]) -> list[np.ndarray]:
    blocks = raw.reshape(-1, block_bytes)
    return np.split(blocks, np.cumsum(sizes), axis=-1)


def _fp16(field: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(field).view(np.float16).astype(np.float32)  # [blocks, 1]


def _low_nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 128] to [blocks, 8, 32]: sub-block 2j is chunk j's low nibbles, 2j+1 its high."""
    chunks = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 15).reshape(-1, 8, 32)


def _scales_and_offsets(d: np.ndarray, dmin: np.ndarray,
                        scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, m = Q4_K.get_scale_min(scales)
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _rows(raw: np.ndarray, codes: np.ndarray, scale: np.ndarray,
          offset: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = raw.shape[0]
    return codes.reshape(rows, -1), scale.reshape(rows, -1), offset.reshape(rows, -1)


def decode_q4_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin, scales, qs, _ = _split(raw, 144, [2, 2, 12, 128])
    scale, offset = _scales_and_offsets(_fp16(d), _fp16(dmin), scales)
    return _rows(raw, _low_nibbles(qs), scale, offset)


def decode_q5_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin, scales, qh, qs, _ = _split(raw, 176, [2, 2, 12, 32, 128])
    scale, offset = _scales_and_offsets(_fp16(d), _fp16(dmin), scales)
    high = qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    codes = _low_nibbles(qs) | ((high & 1) << 4)
    return _rows(raw, codes, scale, offset)


def decode_q6_k(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ql, qh, scales, d, _ = _split(raw, 210, [128, 64, 16, 2])
    low = ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = (low & 15).reshape(-1, 8, 32) | ((high & 3).reshape(-1, 8, 32) << 4)
    scale = _fp16(d) * scales.view(np.int8).astype(np.float32)
    return _rows(raw, codes, scale, -32 * scale)


FORMATS = (
    BlockFormat("Q4_K", 32, False, decode_q4_k),
    BlockFormat("Q5_K", 32, True, decode_q5_k),
    BlockFormat("Q6_K", 16, True, decode_q6_k),
)
