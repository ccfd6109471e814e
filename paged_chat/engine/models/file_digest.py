"""A model file's content digest, hashed once and remembered while the file is unchanged.

The digest is the sha256 of every byte of the file. It is kept in a small record beside the
file's size, mtime, inode and device, under the cache dir: a later load whose stat matches
the record reads it back instead of hashing gigabytes again; any write to the file (which
moves its mtime), a replaced file (a new inode) or a resize hashes it anew. A file that
changed while it was being hashed is hashed again next time rather than remembered.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from io import FileIO
from pathlib import Path

from paged_chat.engine.regular_files import open_regular

# (stage, done, total), as loader.ProgressHook: here in MiB, as the stage's name says.
DigestProgress = Callable[[str, int, int], None]

HASHING_STAGE = "checking the model file (MiB)"
_MIB = 2**20
_CHUNK_BYTES = 16 * _MIB
# Bump when what a record holds or how the digest is computed changes.
_RECORD_VERSION = 1


def file_digest(path: Path, records: Path | None, report: DigestProgress) -> str:
    """The sha256 (hex) of `path`'s bytes: read from its record under `records` while the
    file's size, mtime, inode and device match it, else hashed (with progress reported in
    MiB) and recorded. A record that cannot be read or written costs a hash, not the load."""
    record_path = None if records is None else records / _record_name(path)
    with open_regular(path, buffered=False) as file:
        signature = _signature(os.fstat(file.fileno()))
        if record_path is not None and (remembered := _read_record(record_path, signature)):
            return remembered
        digest = _hash(file, signature["size"], report)
        unchanged = _signature(os.fstat(file.fileno())) == signature
    if record_path is not None and unchanged:
        _write_record(record_path, signature, digest)
    return digest


def _record_name(path: Path) -> str:
    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32] + ".json"


def _signature(stat: os.stat_result) -> dict[str, int]:
    return {"version": _RECORD_VERSION, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "inode": stat.st_ino, "device": stat.st_dev}


def _hash(file: FileIO, size: int, report: DigestProgress) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    done, total = 0, math.ceil(size / _MIB)
    report(HASHING_STAGE, 0, total)
    while count := file.readinto(buffer):
        digest.update(view[:count])
        done += count
        report(HASHING_STAGE, min(math.ceil(done / _MIB), total), total)
    return digest.hexdigest()


def _read_record(record_path: Path, signature: dict[str, int]) -> str | None:
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("signature") != signature:
        return None
    digest = record.get("sha256")
    return digest if isinstance(digest, str) else None


def _write_record(record_path: Path, signature: dict[str, int], digest: str) -> None:
    partial = record_path.with_name(f".partial-{os.getpid()}-{record_path.name}")
    try:
        record_path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"signature": signature, "sha256": digest}))
        os.replace(partial, record_path)
    except OSError:
        partial.unlink(missing_ok=True)
