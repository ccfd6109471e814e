"""A bounded reader of a GGUF file's header: metadata and tensor infos, nothing else.

Every count in the header (keys, tensors, array lengths, string lengths, dimensions) is
checked against the bytes left in the file before it is looped on or allocated from, so
a hostile header is refused at once instead of looping for hours. Large arrays (the
tokenizer's vocabulary and merges) are stepped over, not decoded: the config needs only
scalars and short arrays, and transformers reads the tokenizer itself. This is also what
makes a start fast: the `gguf` package's reader decodes every string of them.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from paged_chat.engine.core.errors import ModelLoadError
from paged_chat.engine.regular_files import open_regular

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_MAX_DIMS = 4
_MAX_NESTING = 2
# Arrays longer than this are skipped: nothing the config needs is that long.
_MAX_DECODED_ARRAY = 4096
_LENGTH = struct.Struct("<Q")   # a string's length, before its bytes
_SCALARS: dict[int, str] = {
    gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H", gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q", gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # GGUF order: the fastest-varying dimension first
    qtype: gguf.GGMLQuantizationType
    offset: int              # absolute offset of the data in the file
    nbytes: int


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """`metadata` holds every key; arrays longer than _MAX_DECODED_ARRAY as their length
    only (an int under the key + ".length"). `data_offset`: where tensor data begins."""

    metadata: dict[str, Any]
    float32_keys: frozenset[str]
    tensors: list[TensorInfo]
    data_offset: int


class _Cursor:
    def __init__(self, data: memoryview | bytes, path: Path) -> None:
        self.data = data
        self.pos = 0
        self.path = path

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path} is not a readable GGUF file ({what} at byte "
                              f"{self.pos}): it is probably truncated or corrupt, download it again")

    def need(self, count: int, what: str) -> None:
        if count < 0 or self.pos + count > len(self.data):
            raise self.fail(f"{what} claims {count} bytes, more than the file holds")

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, "a value")
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        self.need(length, "a string")
        raw = bytes(self.data[self.pos:self.pos + length])
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Step over `count` strings (a vocabulary's, its merges': 49k each in the default
        model) in one tight loop: a call per string would dominate reading the header."""
        data, pos, end = self.data, self.pos, len(self.data)
        length_at = _LENGTH.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                raise self.fail("a string claims more bytes than the file holds")
            pos += 8 + length_at(data, pos)[0]
        self.pos = pos
        if pos > end:
            raise self.fail("a string claims more bytes than the file holds")

    def value(self, value_type: int, depth: int = 0) -> Any:
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])
        if value_type == gguf.GGUFValueType.STRING:
            return self.string()
        if value_type != gguf.GGUFValueType.ARRAY or depth >= _MAX_NESTING:
            raise self.fail(f"value type {value_type} is not a GGUF type")
        item_type, count = self.unpack("<I"), self.unpack("<Q")
        item_size = struct.calcsize(_SCALARS[item_type]) if item_type in _SCALARS else 8
        self.need(count * item_size, f"an array of {count} items")
        if count <= _MAX_DECODED_ARRAY:
            return [self.value(item_type, depth + 1) for _ in range(count)]
        if item_type in _SCALARS:
            self.pos += count * item_size
        elif item_type == gguf.GGUFValueType.STRING:
            self.skip_strings(count)
        else:
            raise self.fail("an array of arrays too long to be metadata")
        return _Skipped(count)


@dataclass(frozen=True, slots=True)
class _Skipped:
    length: int


def read_gguf_header(path: Path, max_bytes: int | None = None) -> GGUFHeader:
    """Parse the header of `path`, reading at most `max_bytes` of it (None: whole file),
    checking every count against the bytes present; ModelLoadError if it is not sound."""
    try:
        with open_regular(path) as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            size = len(mapped)
            view = memoryview(mapped)[:max_bytes] if max_bytes is not None else memoryview(mapped)
            try:
                return _parse(_Cursor(view, path), size)
            finally:
                view.release()
    except (OSError, ValueError) as exc:  # ValueError: mmap of an empty file
        raise ModelLoadError(f"{path} is not a readable GGUF file ({exc}): it is probably "
                             f"truncated or corrupt, download it again") from exc


def _preamble(cursor: _Cursor) -> tuple[int, int]:
    """(tensor count, key count) after checking the magic and version."""
    cursor.need(4, "the magic")
    if bytes(cursor.data[:4]) != _MAGIC:
        raise cursor.fail("no GGUF magic")
    cursor.pos = 4
    version = cursor.unpack("<I")
    if version not in _VERSIONS:
        raise cursor.fail(f"GGUF version {version}, expected 2 or 3 (little-endian)")
    return cursor.unpack("<Q"), cursor.unpack("<Q")


def _metadata(cursor: _Cursor, num_keys: int) -> Iterator[tuple[str, int, Any]]:
    for _ in range(num_keys):
        key = cursor.string()
        value_type = cursor.unpack("<I")
        yield key, value_type, cursor.value(value_type)


def _parse(cursor: _Cursor, file_size: int) -> GGUFHeader:
    num_tensors, num_keys = _preamble(cursor)
    # A key is at least 8 + 1 + 4 + 1 bytes, a tensor info at least 8 + 1 + 4 + 8 + 4 + 8.
    cursor.need(num_keys * 14 + num_tensors * 33, f"{num_keys} keys and {num_tensors} tensors")
    metadata: dict[str, Any] = {}
    float32_keys = set()
    for key, value_type, value in _metadata(cursor, num_keys):
        if isinstance(value, _Skipped):
            metadata[f"{key}.length"] = value.length
        else:
            metadata[key] = value
        if value_type == gguf.GGUFValueType.FLOAT32:
            float32_keys.add(key)
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        num_dims = cursor.unpack("<I")
        if not 1 <= num_dims <= _MAX_DIMS:
            raise cursor.fail(f"tensor {name!r} has {num_dims} dimensions")
        shape = tuple(cursor.unpack("<Q") for _ in range(num_dims))
        raw_type, offset = cursor.unpack("<I"), cursor.unpack("<Q")
        infos.append((name, shape, raw_type, offset))
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or not 1 <= alignment <= 1 << 16:
        raise cursor.fail(f"general.alignment={alignment!r}")
    data_offset = -(-cursor.pos // alignment) * alignment
    tensors = [_tensor(cursor, info, data_offset, file_size) for info in infos]
    return GGUFHeader(metadata, frozenset(float32_keys), tensors, data_offset)


def _tensor(cursor: _Cursor, info: tuple[str, tuple[int, ...], int, int], data_offset: int,
            file_size: int) -> TensorInfo:
    name, shape, raw_type, offset = info
    try:
        qtype = gguf.GGMLQuantizationType(raw_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cursor.fail(f"tensor {name!r} has unknown type {raw_type}") from None
    if any(d < 1 for d in shape) or shape[0] % block:
        raise cursor.fail(f"tensor {name!r} has shape {list(shape)}")
    elements = 1
    for dim in shape:
        elements *= dim
    nbytes = elements // block * type_size
    start = data_offset + offset
    if start + nbytes > file_size:
        raise cursor.fail(f"tensor {name!r} ({nbytes} bytes at {start}) lies past the end of "
                          f"the {file_size}-byte file")
    return TensorInfo(name, shape, qtype, start, nbytes)
