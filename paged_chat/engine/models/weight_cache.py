"""Converted weights on disk: a GGUF converted once, then read back in seconds.

An entry is one safetensors file of the model's HF tensors in the target dtype (a weight
kept quantized as the uint8/float32 tensors of its quant/layout.py layout, under
"NAME.low", "NAME.scale", ...), named by a key over the digest of the GGUF's bytes (header
and tensor data: file_digest.py), the dtype, whether weights stay quantized and this
cache's format version: a file changed anywhere, even in its data alone, or another dtype
or weights mode is a different entry. The
file is written tensor by tensor while the model loads, under a temporary name, and
renamed into place only when complete. Its metadata holds a checksum of every tensor's
bytes, which the next load recomputes as it reads: a corrupt or truncated entry is
discarded and rebuilt, never trusted. Entries are evicted least recently used first to
keep the total under a size bound.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_chat.engine.core.errors import ModelLoadError
from paged_chat.engine.models.checkpoint import (
    DTYPE_NAMES,
    Checkpoint,
    SafetensorsFile,
    byte_view,
    read_safetensor,
)
from paged_chat.engine.models.quant.layout import QuantizedWeight

# What an entry stores per tensor: its name, shape and dtype.
EntryLayout = dict[str, tuple[tuple[int, ...], torch.dtype]]

# Bump when what an entry holds for the same GGUF and dtype changes (names, layout, values).
_FORMAT_VERSION = "1"
_SUFFIX = ".safetensors"
_CHECKSUM_DIGITS = 8
_HEADER_ALIGNMENT = 8
_QUANTIZED_PARTS = frozenset(("low", "high", "scale", "offset"))  # QuantizedWeight.tensors()


def entry_tensors(name: str, target: torch.Tensor | QuantizedWeight) -> dict[str, torch.Tensor]:
    """The entry's tensors for one checkpoint tensor loaded into `target`, in file order."""
    if isinstance(target, QuantizedWeight):
        return {f"{name}.{suffix}": tensor for suffix, tensor in target.tensors().items()}
    return {name: target}


def combine_checksums(checksums: list[int]) -> str:
    """One checksum for a file from its tensors' CRC-32s, in order."""
    return f"{zlib.crc32(struct.pack(f'<{len(checksums)}I', *checksums)):0{_CHECKSUM_DIGITS}x}"


@dataclass(frozen=True, slots=True)
class CachedWeights:
    """One cache entry, as `paged-chat models` lists it."""

    path: Path
    source: str       # the GGUF file it was converted from
    architecture: str
    dtype: str
    size: int
    last_used: float  # seconds since the epoch
    quantized: str = ""  # the GGUF formats kept quantized ("Q4_1+Q8_0"); "" when none


class CachedCheckpoint(Checkpoint):
    """A cache entry opened for reading; `checksum` is what its tensors must add up to."""

    def __init__(self, file: SafetensorsFile) -> None:
        super().__init__(file.tensors)
        self.path = file.file
        self.checksum = file.metadata.get("checksum", "")

    def tensor_names(self) -> list[str]:
        """HF names: a quantized weight's entry tensors ("NAME.low", ...) are one tensor."""
        names = (name.rpartition(".")[0] if name.rpartition(".")[2] in _QUANTIZED_PARTS
                 else name for name in self.tensors)
        return list(dict.fromkeys(names))

    def read_into(self, name: str, out: torch.Tensor | QuantizedWeight) -> int:
        checksum = 0
        for entry_name, tensor in entry_tensors(name, out).items():
            checksum = read_safetensor(self.tensors[entry_name], tensor, checksum)
        return checksum


class WeightCache:
    """The entries under `root`, at most `max_bytes` in all."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes

    @staticmethod
    def key(file_digest: str, dtype: torch.dtype, quantized: bool) -> str:
        """The entry's name for a GGUF whose bytes have `file_digest`, read into `dtype`."""
        text = f"{_FORMAT_VERSION}:{file_digest}:{DTYPE_NAMES[dtype]}"
        if quantized:
            text += ":quantized"
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def open(self, key: str, layout: EntryLayout) -> CachedCheckpoint | None:
        """The entry for `key` if its header is whole and lists exactly `layout`; else
        None, with a broken entry removed."""
        path = self.root / f"{key}{_SUFFIX}"
        if not path.is_file():
            return None
        try:
            entry = CachedCheckpoint(SafetensorsFile(path))
        except (ModelLoadError, OSError):
            self.discard(path)
            return None
        stored = {name: (t.shape, t.dtype) for name, t in entry.tensors.items()}
        if stored != {name: (shape, DTYPE_NAMES[dtype]) for name, (shape, dtype) in layout.items()}:
            self.discard(path)
            return None
        return entry

    def writer(self, key: str, layout: EntryLayout, source: Path, architecture: str,
               quantized: str = "") -> "EntryWriter | None":
        """A writer for a new entry, or None when the entry alone would exceed the bound."""
        size = sum(_nbytes(shape, dtype) for shape, dtype in layout.values())
        if size > self.max_bytes:
            return None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            return EntryWriter(self, self.root / f"{key}{_SUFFIX}", layout,
                               {"source": str(source), "architecture": architecture,
                                "quantized": quantized})
        except OSError:  # a read-only or full cache dir costs the cache, not the load
            return None

    def touch(self, path: Path) -> None:
        """Mark an entry used now (its mtime orders the LRU)."""
        try:
            os.utime(path)
        except OSError:
            pass

    def discard(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def evict(self, keep: Path) -> None:
        """Remove the least recently used entries until the total fits, never `keep`."""
        entries = sorted(list_cached_weights(self.root), key=lambda e: e.last_used)
        total = sum(e.size for e in entries)
        for entry in entries:
            if total <= self.max_bytes:
                break
            if entry.path != keep:
                self.discard(entry.path)
                total -= entry.size


class EntryWriter:
    """Streams one entry: the header first (every offset is known from the shapes), then
    each tensor as it is loaded, then the checksum into the header, then the rename. A
    write that fails (disk full) drops the entry and lets the load go on. One checksum
    per checkpoint tensor: the CRC-32 of its entry tensors' bytes in order."""

    def __init__(self, cache: WeightCache, path: Path, layout: EntryLayout,
                 metadata: dict[str, str]) -> None:
        self.cache = cache
        self.path = path
        self.names = list(layout)
        self.written = 0
        self.checksums: list[int] = []
        header: dict[str, object] = {"__metadata__": {
            **metadata, "checksum": "0" * _CHECKSUM_DIGITS}}
        offset = 0
        for name, (shape, dtype) in layout.items():
            end = offset + _nbytes(shape, dtype)
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, end]}
            offset = end
        self.header = header
        self.partial = path.with_name(f".partial-{os.getpid()}-{path.name}")
        self.file = open(self.partial, "wb")
        self._write_header()

    def _write_header(self) -> None:
        text = json.dumps(self.header, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % _HEADER_ALIGNMENT)
        self.file.seek(0)
        self.file.write(struct.pack("<Q", len(text)) + text)

    def write(self, name: str, target: torch.Tensor | QuantizedWeight) -> None:
        checksum = 0
        for entry_name, tensor in entry_tensors(name, target).items():
            assert entry_name == self.names[self.written], "tensors must come in layout order"
            self.written += 1
            data = byte_view(tensor.detach().cpu().contiguous())
            checksum = zlib.crc32(data, checksum)
            if not self.file.closed:
                try:
                    self.file.write(data)
                except OSError:
                    self.abort()
        self.checksums.append(checksum)

    def commit(self) -> None:
        """Put the finished entry in place, then evict to the bound."""
        assert self.written == len(self.names), "not every tensor was written"
        if self.file.closed:
            return
        self.header["__metadata__"]["checksum"] = combine_checksums(self.checksums)
        try:
            self._write_header()
            self.file.close()
            os.replace(self.partial, self.path)
        except OSError:
            self.abort()
            return
        self.cache.evict(keep=self.path)

    def abort(self) -> None:
        self.file.close()
        self.partial.unlink(missing_ok=True)


def list_cached_weights(root: Path) -> list[CachedWeights]:
    """Every complete entry under `root`, most recently used first; unreadable ones skipped."""
    entries = []
    for path in root.glob(f"*{_SUFFIX}") if root.is_dir() else ():
        try:
            header = SafetensorsFile(path)
            stat = path.stat()
        except (ModelLoadError, OSError):
            continue
        quantized = header.metadata.get("quantized", "")
        dtypes = {t.dtype for name, t in header.tensors.items()
                  if name.rpartition(".")[2] not in _QUANTIZED_PARTS}
        entries.append(CachedWeights(path, header.metadata.get("source", "?"),
                                     header.metadata.get("architecture", "?"),
                                     ",".join(sorted(dtypes)), stat.st_size, stat.st_mtime,
                                     quantized))
    return sorted(entries, key=lambda e: e.last_used, reverse=True)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize
