"""The KV tier's traffic with the pool, done between steps for the engine.

The KV manager only decides (see kv_cache_manager): which blocks' KV goes down to the tier
(`offloads`) and which tier reads a waiting request needs (`TierRead`). This does them,
with the runner's block copies:

- `offload()` has the tier forget what the manager dropped (`tier_drops`: KV that made a
  request fail), then copies the listed blocks out and hands them to the tier, whose writer
  thread puts them on disk. It must run before the next forward (which may overwrite them)
  and the next schedule (which must not find dropped entries): the engine calls it after
  scheduling and at the end of a step.
- `start_reads()` hands the reads just issued to a reader thread, so a read from disk runs
  beside the steps, never inside one.
- `complete_reads()`, before scheduling, copies each finished read's KV into its blocks and
  tells the manager, after which the scheduler schedules that request.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import torch

from paged_chat.engine.kv.kv_cache_manager import KVCacheManager, TierReadState


class BlockKV(Protocol):
    """Copies whole blocks' KV out of and into the pool (the ModelRunner owns the tensor)."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None: ...


class KVTransfer:
    def __init__(self, kv_cache: KVCacheManager, block_kv: BlockKV) -> None:
        self.kv_cache = kv_cache
        self.block_kv = block_kv
        self._reader = (ThreadPoolExecutor(1, thread_name_prefix="kv-tier-reader")
                        if kv_cache.tier is not None else None)

    def offload(self) -> None:
        """Have the tier forget the blocks the manager dropped (KV that made a request fail),
        then copy out the KV of the blocks due to go down that the tier does not hold yet and
        hand it over; what the tier has no room for now is dropped."""
        tier = self.kv_cache.tier
        if self.kv_cache.tier_drops:
            drops, self.kv_cache.tier_drops = self.kv_cache.tier_drops, []
            tier.drop(drops)
        offloads = self.kv_cache.take_offloads()
        if tier is None or not offloads:
            return
        blocks = dict(offloads)     # a block freed, then evicted, is listed twice
        hashes = [block_hash for block_hash in blocks if block_hash not in tier][:tier.room()]
        if hashes:
            tier.store(hashes, self.block_kv.read_blocks([blocks[h] for h in hashes]))

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
        if self.kv_cache.tier is not None:
            self.kv_cache.tier.flush()

    def close(self) -> None:
        """Copy out what is due to go down, stop the reader (a read in flight finishes), then
        finish the tier's queued disk writes and stop its writer (which also stops at exit)."""
        self.offload()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        if self.kv_cache.tier is not None:
            self.kv_cache.tier.close()
