"""A model's tensors on disk, read one at a time straight into their destination.

Opening a checkpoint reads only its header: names, shapes, where each tensor's bytes
are. `read_into` then reads one tensor into the parameter slice that holds it, converting
to the parameter's dtype on the way, so a load never holds more than one tensor beyond
the model itself. Plain reads rather than a memory map keep the file's pages in the page
cache, not in this process's resident set.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_chat.engine.core.errors import ModelLoadError
from paged_chat.engine.regular_files import open_regular

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "U8": torch.uint8,  # quantized codes, in the converted-weights cache
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
# A safetensors header is JSON of a few hundred bytes per tensor; more is not a checkpoint.
_MAX_HEADER_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one tensor's bytes are: `nbytes` at `offset` of `file`, in the stored `dtype`
    (a safetensors dtype name, or a GGML type name in a GGUF file); `shape` is HF's."""

    file: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def read_exact(file: Path, offset: int, out: memoryview) -> None:
    """Fill `out` with the bytes of `file` from `offset` (a short file is a ModelLoadError)."""
    with open_regular(file, buffered=False) as f:
        f.seek(offset)
        filled = 0
        while filled < len(out):
            count = f.readinto(out[filled:])
            if not count:
                raise ModelLoadError(f"{file} ends inside a tensor: it is truncated, download "
                                     f"or convert it again")
            filled += count


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, without a copy."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


class SafetensorsFile:
    """The header of one .safetensors file: its tensors and its metadata."""

    def __init__(self, file: Path) -> None:
        self.file = file
        size = file.stat().st_size
        with open_regular(file) as f:
            prefix = f.read(8)
            (header_len,) = struct.unpack("<Q", prefix) if len(prefix) == 8 else (size,)
            if header_len > min(size - 8, _MAX_HEADER_BYTES):
                raise self._broken(f"its header length {header_len} exceeds the file")
            try:
                header = json.loads(f.read(header_len))
            except ValueError as exc:
                raise self._broken(f"unreadable header: {exc}") from exc
        if not isinstance(header, dict):
            raise self._broken("its header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.data_size = size - 8 - header_len
        self.tensors = {name: self._stored(name, entry, 8 + header_len)
                        for name, entry in header.items()}

    def _stored(self, name: str, entry: object, data_start: int) -> StoredTensor:
        try:
            begin, end = entry["data_offsets"]
            dtype, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
            ok = 0 <= begin <= end <= self.data_size and all(d >= 0 for d in shape)
        except (TypeError, KeyError, ValueError):
            ok = False
        if ok and dtype in SAFETENSORS_DTYPES:
            ok = end - begin == math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if not ok:
            raise self._broken(f"tensor {name!r} has a malformed entry or lies past the end")
        return StoredTensor(self.file, data_start + begin, end - begin, dtype, shape)

    def _broken(self, why: str) -> ModelLoadError:
        return ModelLoadError(f"{self.file} is not a readable safetensors file ({why}): it is "
                              f"probably truncated or corrupt, download it again")


def read_safetensor(stored: StoredTensor, out: torch.Tensor, checksum: int = 0) -> int:
    """Read a safetensors tensor into `out` (converting its dtype); return the CRC-32 of the
    stored bytes (continuing `checksum`), which the converted-weights cache checks."""
    dtype = SAFETENSORS_DTYPES.get(stored.dtype)
    if dtype is None:
        raise ModelLoadError(f"{stored.file}: a tensor is stored as {stored.dtype}; paged-chat "
                             f"reads F32, F16 and BF16 safetensors")
    direct = dtype == out.dtype and out.is_contiguous() and out.device.type == "cpu"
    buffer = out if direct else torch.empty(stored.shape, dtype=dtype)
    view = byte_view(buffer)
    read_exact(stored.file, stored.offset, view)
    if not direct:
        out.copy_(buffer)
    return zlib.crc32(view, checksum)


class Checkpoint:
    """A model's tensors under HF names, in safetensors files unless a subclass says how
    its format is read."""

    def __init__(self, tensors: dict[str, StoredTensor]) -> None:
        self.tensors = tensors

    def tensor_names(self) -> list[str]:
        """The HF names of its tensors, in file order."""
        return list(self.tensors)

    def read_into(self, name: str, out: torch.Tensor) -> int:
        """Read tensor `name` into `out` (its shape, any dtype); return a CRC-32 of the
        stored bytes where the format has one worth checking, else 0."""
        return read_safetensor(self.tensors[name], out)


class TensorCheckpoint(Checkpoint):
    """Tensors already in memory under HF names (random weights of a model's shape, for a
    device check without the model file)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__({})
        self.tensors = tensors

    def read_into(self, name: str, out: torch.Tensor) -> int:
        out.copy_(self.tensors[name])
        return 0
