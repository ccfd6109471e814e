"""GGUF weights kept in their quantized formats: one layout for every format (layout.py),
one decoder module per format family (legacy_formats.py, k_formats.py), the CPU kernels
(kernels.py) and the modules the decoder uses (linear.py), which transform.py swaps in."""

from __future__ import annotations

from paged_chat.engine.models.quant import k_formats, legacy_formats
from paged_chat.engine.models.quant.layout import BlockFormat

BLOCK_FORMATS: dict[str, BlockFormat] = {
    fmt.name: fmt for fmt in (*legacy_formats.FORMATS, *k_formats.FORMATS)}


def held_nbytes(type_name: str, shape: tuple[int, ...]) -> int | None:
    """The bytes a [rows, K] tensor stored as `type_name` takes held quantized (low and
    high nibbles, float32 scales and offsets), or None for a format kept dense."""
    fmt = BLOCK_FORMATS.get(type_name)
    if fmt is None or len(shape) != 2:
        return None
    rows, cols = shape
    return rows * cols // 2 * (2 if fmt.high else 1) + rows * cols // fmt.group * 8
