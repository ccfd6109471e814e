"""The one layout every GGUF block format is re-laid out into at load, and its registry.

Every supported format stores weight w[n, k] of a row-major [rows, K] matrix, exactly, as

    w = scale[n, k // G] * code[n, k] + offset[n, k // G],   code in 0..255,

with G = 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the sub-blocks of Q4_K and Q5_K) or 16 (Q6_K).
The products are exact in float32 (an fp16 scale, or one times a 6-bit sub-scale, times an
8-bit code fits in 24 bits), so dequantizing this layout gives `gguf.quants.dequantize`'s
values bit for bit. A `QuantizedWeight` holds:

- `low`: uint8 [rows, K/2], the code's low nibbles; in each group of G, byte i holds weight
  i in bits 0-3 and weight i + G/2 in bits 4-7 (kernels.c reads 16 bytes per 32 weights);
- `high`: the same for the code's high nibble, or None for 4-bit formats (Q5_K and Q6_K
  keep their 1 or 2 high bits in a nibble: 8 bits a weight, simpler than bit planes);
- `scale`, `offset`: float32 [rows, K/G].

Format modules (legacy_formats.py, k_formats.py) decode raw GGUF rows into
(codes, scale, offset); this module packs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# Decodes raw GGUF rows (uint8 [rows, row_bytes]) into codes uint8 [rows, K] and scale,
# offset float32 [rows, K / group].
Decoder = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """A GGUF format this package keeps quantized."""

    name: str        # the GGML type name, as GGUF tensor infos spell it
    group: int       # weights per scale/offset
    high: bool       # codes need more than 4 bits
    decode: Decoder


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A [rows, in_features] weight in the layout above; `format` names the GGUF format.
    Frozen: kernels.LayerMatmul keeps its tensors' addresses, so they are never replaced
    (filled in place only)."""

    format: str
    group: int
    low: torch.Tensor
    high: torch.Tensor | None
    scale: torch.Tensor
    offset: torch.Tensor

    def __post_init__(self) -> None:
        rows, half = self.low.shape
        assert self.low.dtype == torch.uint8 and self.low.is_contiguous()
        assert (2 * half) % self.group == 0 and (2 * half) % 32 == 0, "K is whole 32-blocks"
        assert self.high is None or self.high.shape == self.low.shape
        assert self.scale.shape == self.offset.shape == (rows, 2 * half // self.group)
        assert self.scale.dtype == self.offset.dtype == torch.float32

    @classmethod
    def empty(cls, fmt: BlockFormat, rows: int, in_features: int) -> QuantizedWeight:
        groups = in_features // fmt.group
        return cls(fmt.name, fmt.group,
                   torch.empty(rows, in_features // 2, dtype=torch.uint8),
                   torch.empty(rows, in_features // 2, dtype=torch.uint8) if fmt.high else None,
                   torch.empty(rows, groups), torch.empty(rows, groups))

    @property
    def rows(self) -> int:
        return self.low.shape[0]

    @property
    def in_features(self) -> int:
        return 2 * self.low.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that hold it, by suffix (what the converted-weights cache stores)."""
        named = {"low": self.low, "scale": self.scale, "offset": self.offset}
        if self.high is not None:
            named["high"] = self.high
        return named

    def narrow(self, start: int, count: int) -> QuantizedWeight:
        """Rows [start, start + count), sharing this weight's memory."""
        return QuantizedWeight(self.format, self.group, self.low.narrow(0, start, count),
                               None if self.high is None else self.high.narrow(0, start, count),
                               self.scale.narrow(0, start, count),
                               self.offset.narrow(0, start, count))

    def select(self, rows: torch.Tensor) -> QuantizedWeight:
        """A copy of the given rows (an embedding lookup)."""
        return QuantizedWeight(self.format, self.group, self.low[rows],
                               None if self.high is None else self.high[rows],
                               self.scale[rows], self.offset[rows])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def fill(self, codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> None:
        """Pack decoded codes [rows, K] into this weight's planes."""
        rows, cols = codes.shape
        grouped = codes.reshape(rows, cols // self.group, 2, self.group // 2)
        low = (grouped[:, :, 0] & 15) | ((grouped[:, :, 1] & 15) << 4)
        self.low.copy_(torch.from_numpy(np.ascontiguousarray(low).reshape(rows, cols // 2)))
        if self.high is not None:
            high = (grouped[:, :, 0] >> 4) | (grouped[:, :, 1] & 0xF0)
            self.high.copy_(torch.from_numpy(np.ascontiguousarray(high).reshape(rows, cols // 2)))
        else:
            assert codes.max(initial=0) < 16, "a 4-bit format decoded to a code above 15"
        self.scale.copy_(torch.from_numpy(scale))
        self.offset.copy_(torch.from_numpy(offset))

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, in_features] in plain torch ops: the reference every kernel
        matches, and the path where no kernel is built."""
        rows, half = self.low.shape
        groups = 2 * half // self.group

        def nibbles(plane: torch.Tensor) -> torch.Tensor:
            grouped = plane.view(rows, groups, self.group // 2)
            return torch.cat((grouped & 15, grouped >> 4), dim=-1)

        codes = nibbles(self.low)
        if self.high is not None:
            codes = codes | (nibbles(self.high) << 4)
        values = codes.float() * self.scale[..., None] + self.offset[..., None]
        return values.view(rows, 2 * half)
