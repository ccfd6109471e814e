"""The KV tier's traffic with the pool, done between steps for the engine.

The KV manager only decides (see kv_cache_manager): which blocks' KV goes down to the tier
(`offloads`) and which tier reads a waiting request needs (`TierRead`). This does them,
with the runner's block copies:

- `offload()` has the tier forget what the manager dropped (`tier_drops`: KV that made a
  request fail), then copies the listed blocks out and hands them to the tier, whose writer
  thread puts them on disk. The copy out of the pool must be issued before the next forward
  (which may overwrite them) and the drops done before the next schedule (which must not
  find dropped entries): the engine calls it after scheduling and at the end of a step.
  On CUDA nothing of it waits: the blocks are gathered into a copy on the device (queued
  before any later forward, so a block freed and reused meanwhile cannot change it), checked
  for NaN and inf there, and copied to pinned host memory without blocking, an event
  recorded after. Each `offload()` hands the tier the copies whose event has passed, in
  order; until then a block is not in the tier (a lookup misses it, as if never stored),
  and a drop meanwhile keeps it out. On the CPU the copy is done when issued.
- `settle()` waits for the copies in flight and hands them over: for an engine going idle,
  and before a flush or close.
- `start_reads()` hands the reads just issued to a reader thread, so a read from disk runs
  beside the steps, never inside one.
- `complete_reads()`, before scheduling, copies each finished read's KV into its blocks and
  tells the manager, after which the scheduler schedules that request.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from paged_chat.engine.kv.kv_cache_manager import KVCacheManager, TierReadState


class BlockKV(Protocol):
    """Copies whole blocks' KV out of and into the pool (the ModelRunner owns the tensor)."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None: ...


@dataclass(slots=True, eq=False)
class HostCopy:
    """Blocks' KV on its way to host memory: `kv` and `finite` (per block: no NaN or inf)
    hold it once `done()`; `source`, the device copy, is kept alive until then."""

    block_hashes: list[bytes]
    kv: torch.Tensor
    finite: torch.Tensor
    event: torch.cuda.Event | None = None     # None: done when made
    source: torch.Tensor | None = None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def start_host_copy(block_hashes: list[bytes], kv: torch.Tensor) -> HostCopy:
    """Copy `kv` (blocks' KV that no later step touches) to host memory: on CUDA into pinned
    memory, queued on the current stream and not waited for; on the CPU it is there."""
    finite = torch.isfinite(kv).flatten(1).all(1)
    if kv.device.type != "cuda":
        return HostCopy(block_hashes, kv, finite)
    host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
    host_finite = torch.empty(finite.shape, dtype=torch.bool, pin_memory=True)
    host.copy_(kv, non_blocking=True)
    host_finite.copy_(finite, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return HostCopy(block_hashes, host, host_finite, event, kv)


class KVTransfer:
    def __init__(self, kv_cache: KVCacheManager, block_kv: BlockKV) -> None:
        self.kv_cache = kv_cache
        self.block_kv = block_kv
        self._reader = (ThreadPoolExecutor(1, thread_name_prefix="kv-tier-reader")
                        if kv_cache.tier is not None else None)
        self._copies: deque[HostCopy] = deque()   # in flight, oldest first
        self._in_flight: set[bytes] = set()        # their hashes, less those dropped since

    def offload(self) -> None:
        """Have the tier forget the blocks the manager dropped (KV that made a request fail),
        then start copying out the KV of the blocks due to go down that the tier neither
        holds nor awaits yet (what it has no room for now is dropped), and hand the tier the
        copies done by now."""
        tier = self.kv_cache.tier
        if self.kv_cache.tier_drops:
            drops, self.kv_cache.tier_drops = self.kv_cache.tier_drops, []
            self._in_flight.difference_update(drops)
            tier.drop(drops)
        offloads = self.kv_cache.take_offloads()
        if tier is not None and offloads:
            blocks = dict(offloads)     # a block freed, then evicted, is listed twice
            room = max(0, tier.room() - len(self._in_flight))
            hashes = [block_hash for block_hash in blocks
                      if block_hash not in tier and block_hash not in self._in_flight][:room]
            if hashes:
                kv = self.block_kv.read_blocks([blocks[h] for h in hashes])
                self._copies.append(start_host_copy(hashes, kv))
                self._in_flight.update(hashes)
        while self._copies and self._copies[0].done():
            self._store(self._copies.popleft())

    def settle(self) -> None:
        """Wait for the copies in flight and hand them to the tier."""
        while self._copies:
            copy = self._copies.popleft()
            copy.wait()
            self._store(copy)

    def _store(self, copy: HostCopy) -> None:
        """Hand a finished copy's blocks to the tier, less those dropped while it ran."""
        kept = [index for index, block_hash in enumerate(copy.block_hashes)
                if block_hash in self._in_flight]
        self._in_flight.difference_update(copy.block_hashes)
        kv, finite = copy.kv, copy.finite
        if len(kept) < len(copy.block_hashes):
            index = torch.tensor(kept, dtype=torch.long)
            kv, finite = kv[index], finite[index]
        if kept:
            self.kv_cache.tier.store([copy.block_hashes[i] for i in kept], kv, finite)

    def start_reads(self) -> None:
        for read in self.kv_cache.take_new_tier_reads():
            read.future = self._reader.submit(self.kv_cache.tier.load, read.block_hashes)

    def complete_reads(self) -> None:
        """Put the KV of every read that has finished into its blocks; a read that came
        back short writes nothing."""
        for read in list(self.kv_cache.tier_reads.values()):
            if read.state is not TierReadState.IN_FLIGHT or not read.future.done():
                continue
            kv = read.future.result()
            complete = len(kv) == len(read.blocks)
            if complete and kv:
                self.block_kv.write_blocks([block.block_id for block in read.blocks],
                                           torch.stack(kv))
            self.kv_cache.finish_tier_read(read, complete)

    def wait_for_reads(self, timeout_s: float) -> None:
        """Return when a read in flight has finished, or after `timeout_s`: for a step that
        has nothing to run but reads to wait for."""
        futures = [read.future for read in self.kv_cache.tier_reads.values()
                   if read.state is TierReadState.IN_FLIGHT and read.future is not None]
        if futures:
            concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def flush(self) -> None:
        """Copy out what is due to go down and wait until the tier's queued disk writes are
        done (a process about to end leaves its chats' blocks for the next one)."""
        self.offload()
        self.settle()
        if self.kv_cache.tier is not None:
            self.kv_cache.tier.flush()

    def close(self) -> None:
        """Copy out what is due to go down, stop the reader (a read in flight finishes), then
        finish the tier's queued disk writes and stop its writer (which also stops at exit)."""
        self.offload()
        self.settle()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        if self.kv_cache.tier is not None:
            self.kv_cache.tier.close()
