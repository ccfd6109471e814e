"""Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0: blocks of 32 weights with one fp16 scale (and Q4_1 and
Q5_1 a minimum).

Q4_0: w = d * (q - 8); Q4_1: w = d * q + m; both with q in 0..15, byte i of a block holding
weights i (low nibble) and i + 16 (high nibble), which is already layout.py's order.
Q5_0: w = d * (q - 16); Q5_1: w = d * q + m; q in 0..31, its low 4 bits as in Q4_0 and bit
4 of weight j in bit j of the block's 32-bit `qh`.
Q8_0: w = d * q with q an int8; its code is q + 128, its offset -128 d.
"""

from __future__ import annotations

import numpy as np

from paged_chat.engine.models.quant.layout import BlockFormat

_BLOCK = 32


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = raw.shape[0]
    return raw.reshape(rows, -1, block_bytes)


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(
        np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[rows, blocks, 16] bytes to [rows, blocks * 32] codes, low nibbles first."""
    codes = np.concatenate((qs & 15, qs >> 4), axis=-1)
    return codes.reshape(codes.shape[0], -1)


def decode_q4_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = _blocks(raw, 18)
    d = _fp16(blocks, 0)
    return _nibbles(blocks[..., 2:]), d, -8 * d


def decode_q4_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = _blocks(raw, 20)
    return _nibbles(blocks[..., 4:]), _fp16(blocks, 0), _fp16(blocks, 2)


def _five_bit_codes(blocks: np.ndarray, qh_start: int) -> np.ndarray:
    """Q5_0/Q5_1 codes [rows, blocks * 32]: the nibbles after `qh`, bit 4 from `qh`."""
    qh = np.ascontiguousarray(blocks[..., qh_start:qh_start + 4]).view("<u4")
    high_bits = (qh >> np.arange(_BLOCK, dtype=np.uint32)) & 1  # [rows, blocks, 32]
    low = _nibbles(blocks[..., qh_start + 4:])
    return low | (high_bits.reshape(low.shape).astype(np.uint8) << 4)


def decode_q5_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = _blocks(raw, 22)
    d = _fp16(blocks, 0)
    return _five_bit_codes(blocks, 2), d, -16 * d


def decode_q5_1(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = _blocks(raw, 24)
    return _five_bit_codes(blocks, 4), _fp16(blocks, 0), _fp16(blocks, 2)


def decode_q8_0(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    blocks = _blocks(raw, 34)
    d = _fp16(blocks, 0)
    codes = blocks[..., 2:] ^ np.uint8(0x80)  # int8 q as the uint8 q + 128
    return codes.reshape(raw.shape[0], -1), d, -128 * d


FORMATS = (
    BlockFormat("Q4_0", _BLOCK, False, decode_q4_0),
    BlockFormat("Q4_1", _BLOCK, False, decode_q4_1),
    BlockFormat("Q5_0", _BLOCK, True, decode_q5_0),
    BlockFormat("Q5_1", _BLOCK, True, decode_q5_1),
    BlockFormat("Q8_0", _BLOCK, True, decode_q8_0),
)
