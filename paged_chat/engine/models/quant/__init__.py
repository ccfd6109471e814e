"""GGUF weights kept in their quantized formats: one layout for every format (layout.py),
one decoder module per format family (legacy_formats.py, k_formats.py), the CPU kernels
(kernels.c, kernels.py) and the modules the decoder uses (linear.py)."""

from __future__ import annotations

from paged_chat.engine.models.quant import k_formats, legacy_formats
from paged_chat.engine.models.quant.layout import BlockFormat

BLOCK_FORMATS: dict[str, BlockFormat] = {
    fmt.name: fmt for fmt in (*legacy_formats.FORMATS, *k_formats.FORMATS)}
