"""KV tiers under the block pool's prefix cache: host RAM and disk.

A full block's KV (every layer's K and V for its `block_size` slots) is stored under its
chained prefix hash, so a hit means the same tokens at the same positions. What else the
KV depends on (the model's weights, the dtype, the block size, the cache layout) is a
`TierLayout`: entries of another layout are never loaded.

- Host tier: a bounded LRU of CPU tensors (pinned on CUDA: kv_transfer copies the pool's
  blocks into pinned memory), in front of the disk tier.
- Disk tier: one file per block under `<cache_dir>/kv-tier`, bounded in bytes, LRU by
  last use (file mtime across processes). Every file is a fixed header (magic, version,
  model fingerprint, block hash, dtype, block size, layout, shape, length) then the
  payload's CRC-32 then the payload. A read checks all of it: a mismatch, a short file or
  a bad checksum is deleted, never loaded. An entry is sized by its header, not its
  st_size (a sparse file claims any size it likes).
- Only regular files are entries, and no link is followed: the directory is opened with
  O_NOFOLLOW and every entry relative to it through `regular_files.open_regular` (no link
  followed, and a FIFO opens at once and is refused by its fstat). What is not a regular file is skipped and counted,
  never deleted, and never turns the tier off.
- Only finite KV is stored: a block with a NaN or inf (a forward that overflowed) is
  dropped before it is written; `drop` forgets blocks whose KV led a request to fail.

Reads and writes never stall a step: reads run on the engine's reader thread (see
kv_transfer); for a write the engine hands over tensors it has already copied out of the
pool; a writer thread serializes them, writes a temp file, fsyncs and renames it into
place (a torn write is never read back). The queue is bounded in bytes: a full queue
drops the write. A disk error (full, read-only, the directory gone) turns the disk tier
off with one `KVTierWarning` and a reason in the stats; the engine goes on without it.

Several processes may share the directory: each keeps its own index (scanned at start,
then its own writes), so a file another process evicted is a plain miss, and the byte
bound holds per process, not across them.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import os
import queue
import stat
import struct
import threading
import time
import warnings
import weakref
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_chat.engine.core.config import EngineConfig
from paged_chat.engine.core.errors import KVTierWarning
from paged_chat.engine.core.stats import KVTierStats
from paged_chat.engine.regular_files import NotARegularFileError, open_regular

TIER_DIR = "kv-tier"
ENTRY_SUFFIX = ".kv"
_TEMP_SUFFIX = ".tmp"
_MAGIC = b"PCKVTIER"
_VERSION = 1
# magic, version, model fingerprint, block hash, dtype name, layout name, block size,
# shape (layers, 2, kv_heads, block_size, head_dim), payload length
_HEADER = struct.Struct("<8sH16s16s16s16sI5IQ")
_CHECKSUM = struct.Struct("<I")
_SAMPLES_PER_TENSOR = 4096
_MAX_PENDING_BYTES = 256 * 2**20
# A temp file older than this belongs to a process that died mid-write.
_STALE_TEMP_S = 600.0
_DEFAULT_CUDA_HOST_BYTES = 2 * 2**30


def model_fingerprint(weights: dict[str, torch.Tensor]) -> bytes:
    """128-bit digest of the loaded weights' names, shapes, dtypes and a strided sample of
    each tensor's values (in the dtype the engine runs, so one checkpoint in two dtypes
    differs). Hashing every byte would cost a pass over the whole model at every
    start; any fine-tune or other checkpoint changes the sampled values too."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        tensor = weights[name]
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        digest.update(flat[::step].float().cpu().numpy().tobytes())
    return digest.digest()


@dataclass(slots=True, frozen=True)
class TierLayout:
    """What a stored block must match to be loaded.

    `block_shape` is one block's KV as the tier stores it: (layers, 2, kv_heads,
    block_size, head_dim); `kv_layout` names the pool's axis order it was read from.
    """

    model_fingerprint: bytes
    dtype: torch.dtype
    block_shape: tuple[int, int, int, int, int]
    kv_layout: str = "layer,kv,head,block,slot,dim"

    def __post_init__(self) -> None:
        assert len(self.model_fingerprint) == 16 and len(self.block_shape) == 5

    @property
    def block_size(self) -> int:
        return self.block_shape[3]

    @property
    def block_nbytes(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return torch.Size(self.block_shape).numel() * element_size

    def header(self, block_hash: bytes) -> bytes:
        layout = hashlib.blake2b(self.kv_layout.encode(), digest_size=16).digest()
        return _HEADER.pack(_MAGIC, _VERSION, self.model_fingerprint, block_hash,
                            str(self.dtype).encode(), layout, self.block_size,
                            *self.block_shape, self.block_nbytes)

    def entry_name(self, block_hash: bytes) -> str:
        """The file of a block: its hash and this layout together, so models never share one."""
        return hashlib.blake2b(self.header(block_hash), digest_size=16).hexdigest() + ENTRY_SUFFIX

    @property
    def entry_nbytes(self) -> int:
        return _HEADER.size + _CHECKSUM.size + self.block_nbytes

    def decode(self, block_hash: bytes, data: bytearray) -> torch.Tensor | None:
        """The block's KV from a file's bytes (viewed, not copied), or None when anything
        does not match."""
        header = self.header(block_hash)
        payload_start = len(header) + _CHECKSUM.size
        if len(data) != self.entry_nbytes or not data.startswith(header):
            return None
        checksum = zlib.crc32(memoryview(data)[payload_start:])
        if _CHECKSUM.unpack_from(data, len(header))[0] != checksum:
            return None
        return torch.frombuffer(data, dtype=self.dtype, offset=payload_start).view(self.block_shape)

    def encode(self, block_hash: bytes, kv: torch.Tensor) -> list[bytes | memoryview]:
        assert kv.shape == self.block_shape and kv.dtype == self.dtype and kv.device.type == "cpu"
        payload = memoryview(kv.contiguous().view(torch.uint8).numpy()).cast("B")
        return [self.header(block_hash), _CHECKSUM.pack(zlib.crc32(payload)), payload]


class HostTier:
    """Block KV in host RAM, LRU, at most `capacity_bytes`. The engine's thread stores and
    the reader thread reads: one lock keeps the LRU whole."""

    def __init__(self, capacity_bytes: int, block_nbytes: int) -> None:
        self.capacity_blocks = capacity_bytes // block_nbytes
        self.block_nbytes = block_nbytes
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.entries

    def get(self, block_hash: bytes) -> torch.Tensor | None:
        with self._lock:
            kv = self.entries.get(block_hash)
            if kv is not None:
                self.entries.move_to_end(block_hash)
            return kv

    def put(self, block_hash: bytes, kv: torch.Tensor) -> None:
        if self.capacity_blocks == 0:
            return
        with self._lock:
            self.entries[block_hash] = kv
            self.entries.move_to_end(block_hash)
            while len(self.entries) > self.capacity_blocks:
                self.entries.popitem(last=False)

    def drop(self, block_hash: bytes) -> None:
        with self._lock:
            self.entries.pop(block_hash, None)

    @property
    def nbytes(self) -> int:
        return len(self.entries) * self.block_nbytes


@dataclass(slots=True)
class _Write:
    name: str
    block_hash: bytes
    kv: torch.Tensor


class DiskTier:
    """Block KV files in one directory, LRU within `capacity_bytes`, written by a thread.

    `pending` holds what is queued and not yet on disk, so a block is findable (and never
    queued twice) from the moment it is handed over. `index` holds the regular files whose
    header parses, sized by it. Every file operation is relative to `_dir_fd`, the
    directory opened without following a link, so neither it nor an entry is ever one.
    """

    def __init__(self, directory: Path, capacity_bytes: int, layout: TierLayout,
                 max_pending_bytes: int = _MAX_PENDING_BYTES) -> None:
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.layout = layout
        self.max_pending_blocks = max(1, max_pending_bytes // layout.block_nbytes)
        self.index: OrderedDict[str, int] = OrderedDict()   # file name -> bytes, LRU first
        self.pending: dict[str, torch.Tensor] = {}
        self.nbytes = 0
        self.bytes_read = self.bytes_written = 0
        self.writes_dropped = self.entries_rejected = self.entries_skipped = 0
        self.error: str | None = None
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._dir_fd: int | None = None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError as error:
            self._turn_off(NotADirectoryError(
                f"{TIER_DIR} is a symbolic link or not a directory (a link is never followed)")
                if error.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST) else error)
            return
        weakref.finalize(self, os.close, self._dir_fd)
        try:
            self._scan()
        except OSError as error:
            self._turn_off(error)
            return
        self._thread = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @property
    def enabled(self) -> bool:
        return self.error is None

    def __contains__(self, block_hash: bytes) -> bool:
        name = self.layout.entry_name(block_hash)
        with self._lock:
            return self.enabled and (name in self.pending or name in self.index)

    def read(self, block_hash: bytes) -> torch.Tensor | None:
        """The block's KV, or None when it is missing, not a regular file (skipped) or its
        entry is rejected (and deleted)."""
        name = self.layout.entry_name(block_hash)
        with self._lock:
            kv = self.pending.get(name)
            if kv is not None or not self.enabled or name not in self.index:
                return kv
            self.index.move_to_end(name)
        data = bytearray(self.layout.entry_nbytes + 1)  # one byte more tells a longer file
        try:
            file = open_regular(name, dir_fd=self._dir_fd, follow_links=False)
        except OSError as error:  # evicted by another process, the directory gone, a link, a FIFO
            self.entries_skipped += isinstance(error, NotARegularFileError)
            self._forget(name)
            return None
        with file:
            try:
                del data[file.readinto(data):]
            except OSError:
                self._forget(name)
                return None
            kv = self.layout.decode(block_hash, data)
            if kv is not None:
                with contextlib.suppress(OSError):  # a read-only directory keeps what it has
                    os.utime(file.fileno())  # the recency the next process's scan sees
        if kv is None:
            self.entries_rejected += 1
            self._forget(name)
            self._unlink(name)
            return None
        self.bytes_read += len(data)
        return kv

    def submit(self, block_hash: bytes, kv: torch.Tensor) -> bool:
        """Queue a write; False (the write dropped) when the tier is off or the queue is full."""
        name = self.layout.entry_name(block_hash)
        with self._lock:
            if not self.enabled:
                return False
            if len(self.pending) >= self.max_pending_blocks:
                self.writes_dropped += 1
                return False
            self.pending[name] = kv
        self._queue.put(_Write(name, block_hash, kv))
        return True

    def drop(self, block_hash: bytes) -> bool:
        """Forget a block and delete its entry (a queued write of it is not done); False when
        the entry is still on disk (the directory is read-only)."""
        name = self.layout.entry_name(block_hash)
        with self._lock:
            self.pending.pop(name, None)
        self._forget(name)
        return self._dir_fd is None or self._unlink(name)

    def room(self) -> int:
        """How many more writes the queue takes now."""
        return max(0, self.max_pending_blocks - len(self.pending)) if self.enabled else 0

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write is done (or dropped); True when it was in time."""
        give_up = time.monotonic() + timeout_s
        while self.pending and self._thread is not None and self._thread.is_alive():
            if time.monotonic() > give_up:
                return False
            time.sleep(0.005)
        return not self.pending

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued writes (within `timeout_s`) and stop the writer thread."""
        if self._thread is None:
            return
        self.flush(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._thread = None
        atexit.unregister(self.close)

    def _scan(self) -> None:
        """Index the directory's entries, least recently used first; clear dead temp files.
        What is not a regular file is skipped; an entry whose header does not parse or whose
        size is not the one it declares is deleted."""
        entries = []
        now = time.time()
        with os.scandir(self._dir_fd) as items:
            for item in items:
                try:
                    status = item.stat(follow_symlinks=False)
                except FileNotFoundError:   # deleted meanwhile by another process
                    continue
                if not item.name.endswith((ENTRY_SUFFIX, _TEMP_SUFFIX)):
                    continue
                if not stat.S_ISREG(status.st_mode):
                    self.entries_skipped += 1
                elif item.name.endswith(_TEMP_SUFFIX):
                    if now - status.st_mtime > _STALE_TEMP_S:
                        self._unlink(item.name)
                elif (size := self._declared_size(item.name, status.st_size)) is None:
                    self.entries_rejected += 1
                    self._unlink(item.name)
                else:
                    entries.append((status.st_mtime, item.name, size))
        for _, name, size in sorted(entries):
            self.index[name] = size
            self.nbytes += size
        self._evict_to(self.capacity_bytes)

    def _declared_size(self, name: str, st_size: int) -> int | None:
        """The size an entry's header declares (any layout's), None when it has no header
        or is not that size."""
        try:
            with open_regular(name, dir_fd=self._dir_fd, follow_links=False) as file:
                header = file.read(_HEADER.size)
        except OSError:     # gone meanwhile, or unreadable
            return None
        if len(header) < _HEADER.size:
            return None
        magic, version, *_, payload_nbytes = _HEADER.unpack(header)
        size = _HEADER.size + _CHECKSUM.size + payload_nbytes
        return size if magic == _MAGIC and version == _VERSION and size == st_size else None

    def _write_loop(self) -> None:
        while (write := self._queue.get()) is not None:
            try:
                if self.enabled and write.name in self.pending:    # not dropped meanwhile
                    self._write(write)
            except Exception as error:  # a disk fault, or a bug: either way the engine goes on
                self._turn_off(error)
            finally:
                with self._lock:
                    self.pending.pop(write.name, None)

    def _write(self, write: _Write) -> None:
        parts = self.layout.encode(write.block_hash, write.kv)
        size = sum(len(part) for part in parts)
        if size > self.capacity_bytes:
            return
        temp = f"{write.name}.{os.getpid()}{_TEMP_SUFFIX}"
        self._unlink(temp)  # one a dead process of the same pid left (or a link in its place)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644,
                     dir_fd=self._dir_fd)
        try:
            for part in parts:
                view = memoryview(part)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError:
            os.close(fd)
            self._unlink(temp)
            raise
        os.close(fd)
        try:
            os.replace(temp, write.name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except IsADirectoryError:   # a directory under an entry's name: not ours to remove
            self._unlink(temp)
            self.writes_dropped += 1
            return
        with self._lock:
            self.nbytes += size - self.index.pop(write.name, 0)
            self.index[write.name] = size
            self.bytes_written += size
        self._evict_to(self.capacity_bytes)

    def _evict_to(self, capacity_bytes: int) -> None:
        while True:
            with self._lock:
                if self.nbytes <= capacity_bytes or not self.index:
                    return
                name, size = self.index.popitem(last=False)
                self.nbytes -= size
            self._unlink(name)

    def _unlink(self, name: str) -> bool:
        """Delete a file of the directory (a link itself, never its target); False when it
        could not be (read-only), True when it is gone."""
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except (FileNotFoundError, IsADirectoryError):  # gone, or not ours: never indexed
            return True
        except OSError:
            return False
        return True

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self.index.pop(name, None)
            if size is not None:
                self.nbytes -= size

    def _turn_off(self, error: Exception) -> None:
        """Stop using the directory for good, saying why once."""
        code = getattr(error, "errno", None)
        reason = errno.errorcode.get(code, "") if code else ""
        with self._lock:
            if self.error is not None:
                return
            self.error = f"the disk KV tier at {self.directory} is off: {error}" + (
                f" ({reason})" if reason and reason not in str(error) else "")
        warnings.warn(self.error, KVTierWarning, stacklevel=2)


class KVTier:
    """The host tier in front of the disk tier, keyed by block hash under one TierLayout.

    A stored block goes to both (the host tier is a faster copy of what is on disk); a
    read tries the host tier first and keeps what it read from disk there.
    """

    def __init__(self, layout: TierLayout, host_bytes: int, disk_dir: Path | None,
                 disk_bytes: int) -> None:
        self.layout = layout
        self.host = HostTier(host_bytes, layout.block_nbytes) if host_bytes > 0 else None
        self.disk = DiskTier(disk_dir, disk_bytes, layout) if disk_dir and disk_bytes > 0 else None
        self.host_hit_blocks = self.disk_hit_blocks = self.miss_blocks = 0
        self.blocks_not_finite = self.blocks_dropped = 0

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    def __contains__(self, block_hash: bytes) -> bool:
        return ((self.host is not None and block_hash in self.host)
                or (self.disk is not None and block_hash in self.disk))

    def room(self) -> int:
        """How many blocks `store` keeps now (the host tier takes all; the disk queue may not)."""
        if self.host is not None and self.host.capacity_blocks:
            return self.host.capacity_blocks
        return self.disk.room() if self.disk is not None else 0

    def store(self, block_hashes: list[bytes], kv: torch.Tensor,
              finite: torch.Tensor | None = None) -> None:
        """Keep blocks' KV, `kv[i]` for `block_hashes[i]`: a CPU tensor nobody writes again
        (pinned on CUDA, as kv_transfer copies it). A block holding a NaN or inf is not kept:
        `finite` says which are (per block, checked where the KV was), else it is checked here."""
        assert kv.device.type == "cpu" and len(kv) == len(block_hashes)
        if finite is None:
            finite = torch.isfinite(kv).flatten(1).all(1)
        if not finite.all():
            self.blocks_not_finite += len(kv) - int(finite.sum())
            block_hashes = [h for h, ok in zip(block_hashes, finite.tolist()) if ok]
            kv = kv[finite]
        for block_hash, block_kv in zip(block_hashes, kv):
            if self.host is not None:
                self.host.put(block_hash, block_kv)
            if self.disk is not None:
                self.disk.submit(block_hash, block_kv)

    def load(self, block_hashes: list[bytes]) -> list[torch.Tensor]:
        """The KV of the leading blocks that every tier can still serve, in order (a block
        that turns out missing or rejected ends the run). Reads the disk: the engine calls
        it on its reader thread (kv_transfer), never in a step."""
        loaded = []
        for block_hash in block_hashes:
            kv = self.host.get(block_hash) if self.host is not None else None
            if kv is not None:
                self.host_hit_blocks += 1
            elif self.disk is not None and (kv := self.disk.read(block_hash)) is not None:
                self.disk_hit_blocks += 1
                if self.host is not None:
                    self.host.put(block_hash, kv)
            else:
                break
            loaded.append(kv)
        return loaded

    def drop(self, block_hashes: list[bytes]) -> None:
        """Forget blocks whose KV led a request to fail, in every tier. An entry the disk tier
        cannot delete (a read-only directory) is only forgotten by this process: say once
        how to remove it."""
        self.blocks_dropped += len(block_hashes)
        if self.host is not None:
            for block_hash in block_hashes:
                self.host.drop(block_hash)
        undeleted = [h for h in block_hashes if self.disk is not None and not self.disk.drop(h)]
        if undeleted:
            warnings.warn(
                f"the disk KV tier at {self.disk.directory} keeps blocks that made a request "
                "fail and cannot delete them; `paged-chat cache clear` removes them",
                KVTierWarning, stacklevel=2)

    def record_misses(self, num_blocks: int) -> None:
        self.miss_blocks += num_blocks

    def flush(self, timeout_s: float = 30.0) -> bool:
        return self.disk.flush(timeout_s) if self.disk is not None else True

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> KVTierStats:
        host, disk, block_size = self.host, self.disk, self.block_size
        hits = self.host_hit_blocks + self.disk_hit_blocks
        return KVTierStats(
            host_capacity_bytes=host.capacity_blocks * host.block_nbytes if host else 0,
            host_bytes=host.nbytes if host else 0,
            host_blocks=len(host.entries) if host else 0,
            disk_capacity_bytes=disk.capacity_bytes if disk else 0,
            disk_bytes=disk.nbytes if disk else 0,
            disk_blocks=len(disk.index) if disk else 0,
            hit_blocks=hits,
            hit_tokens=hits * block_size,
            host_hit_blocks=self.host_hit_blocks,
            disk_hit_blocks=self.disk_hit_blocks,
            miss_blocks=self.miss_blocks,
            miss_tokens=self.miss_blocks * block_size,
            bytes_read=disk.bytes_read if disk else 0,
            bytes_written=disk.bytes_written if disk else 0,
            writes_dropped=disk.writes_dropped if disk else 0,
            entries_rejected=disk.entries_rejected if disk else 0,
            entries_skipped=disk.entries_skipped if disk else 0,
            blocks_not_finite=self.blocks_not_finite,
            blocks_dropped=self.blocks_dropped,
            disk_error=disk.error if disk else None,
        )


def clear_disk_tier(cache_dir: str | Path) -> tuple[int, int]:
    """Delete every disk tier entry under a cache dir; return (files, bytes) freed."""
    directory = Path(cache_dir) / TIER_DIR
    files = freed = 0
    if not directory.is_dir() or directory.is_symlink():
        return 0, 0
    for item in os.scandir(directory):
        if item.name.endswith((ENTRY_SUFFIX, _TEMP_SUFFIX)) and item.is_file(follow_symlinks=False):
            size = item.stat(follow_symlinks=False).st_size
            Path(item.path).unlink(missing_ok=True)
            files, freed = files + 1, freed + size
    return files, freed


def build_kv_tier(config: EngineConfig, fingerprint: bytes, kv_cache: torch.Tensor
                  ) -> KVTier | None:
    """The host and disk KV tiers the config asks for, or None (they need the prefix cache).
    `kv_cache` is the pool they sit under: its dtype, device and layout."""
    host_bytes = config.kv_tier_host_bytes
    on_cuda = kv_cache.device.type == "cuda"
    if host_bytes is None:
        host_bytes = _DEFAULT_CUDA_HOST_BYTES if on_cuda else 0
    disk_dir = Path(config.cache_dir) / TIER_DIR if config.cache_dir else None
    wanted = host_bytes or (disk_dir and config.kv_tier_disk_bytes)
    if not config.enable_prefix_caching or not wanted:
        return None
    num_layers, _, kv_heads, _, block_size, head_dim = kv_cache.shape
    block_shape = (num_layers, 2, kv_heads, block_size, head_dim)
    layout = TierLayout(fingerprint, kv_cache.dtype, block_shape)
    return KVTier(layout, host_bytes, disk_dir, config.kv_tier_disk_bytes)
