"""EngineStats: an immutable snapshot of the engine, cheap enough to take after every step.

The block map is kept compact (numpy arrays, not an object per block) so a panel can draw a
pool of tens of thousands of blocks at its frame rate. Holders of a block are stored
CSR-style: the requests holding block `b` are `request_ids[i]` for `i in
holders[holder_ptr[b]:holder_ptr[b + 1]]`, and `holder_positions` (parallel to `holders`)
says where in that request's table the block sits, so block `b` holds that request's tokens
`[p * block_size, (p + 1) * block_size)`. A table's leading entries that a sliding window
released (`num_released`) hold no block.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from paged_chat.engine.core.block_states import BlockChanges, BlockStates

if TYPE_CHECKING:
    from paged_chat.engine.core.scheduler import Scheduler


@dataclass(slots=True, frozen=True)
class BlockMap:
    """The pool's blocks and who holds them. The holder arrays are built from the tables on
    their first read: snapshots are taken more often than a panel draws one, if it is
    shown at all.

    An engine's map has a cell per allocatable block: cell i is block i + 1, and its tables
    hold cells (the reserved null block 0, of released entries, is -1 there)."""

    ref_counts: np.ndarray          # int32 [num_blocks]: requests holding each block
    cached: np.ndarray              # bool [num_blocks]: has a prefix hash (evictable at ref 0)
    request_ids: tuple[str, ...]
    request_owners: tuple[str | None, ...]   # the owner tag each request was added with
    from_tier: np.ndarray           # bool [num_blocks]: KV read back from a KV tier (host or disk)
    table_ids: np.ndarray           # int64: the requests' tables one after another
    table_lengths: np.ndarray       # int64 [len(request_ids)]: blocks in each table
    table_released: np.ndarray      # int64 [len(request_ids)]: leading entries released
    _holders: list = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def build(cls, ref_counts: np.ndarray, cached: np.ndarray,
              tables: dict[str, list[int]], owners: dict[str, str | None],
              from_tier: np.ndarray | None = None,
              num_released: dict[str, int] | None = None) -> "BlockMap":
        """A snapshot: the tables are copied, so the caller may go on changing them."""
        request_ids = tuple(tables)
        released = num_released or {}
        return cls(ref_counts, cached, request_ids, tuple(owners.get(rid) for rid in request_ids),
                   np.zeros(len(ref_counts), dtype=bool) if from_tier is None else from_tier,
                   _concatenate([tables[rid] for rid in request_ids]),
                   np.fromiter(map(len, tables.values()), dtype=np.int64, count=len(tables)),
                   np.fromiter((released.get(rid, 0) for rid in request_ids), dtype=np.int64,
                               count=len(request_ids)))

    def without_states(self) -> "BlockMap":
        """This map less its per-block arrays (empty), for a stream whose snapshots' block
        changes carry them: `with_states` puts them back on the other side."""
        empty = np.zeros(0, dtype=bool)
        return dataclasses.replace(self, ref_counts=np.zeros(0, dtype=np.int32), cached=empty,
                                   from_tier=empty, _holders=[])

    def with_states(self, states: BlockStates) -> "BlockMap":
        """This map with copies of `states`' per-block arrays."""
        return dataclasses.replace(self, ref_counts=states.ref_counts.copy(),
                                   cached=states.cached.copy(), from_tier=states.from_tier.copy(),
                                   _holders=[])

    @property
    def num_in_use(self) -> int:
        return int(np.count_nonzero(self.ref_counts))

    @property
    def num_cached(self) -> int:
        """Blocks no request holds that keep a prefix hash: evictable."""
        return int(np.count_nonzero(self.cached & (self.ref_counts == 0)))

    @property
    def holder_ptr(self) -> np.ndarray:
        """int32 [num_blocks + 1]"""
        return self._holder_arrays()[0]

    @property
    def holders(self) -> np.ndarray:
        """int32: indices into request_ids"""
        return self._holder_arrays()[1]

    @property
    def holder_positions(self) -> np.ndarray:
        """int32, parallel to holders: index in that request's table"""
        return self._holder_arrays()[2]

    def first_holders(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The cells the tables hold, sorted; for each, the index into request_ids of the
        first request holding it, and how many hold it. From the tables alone: the cost
        follows the blocks in use, not the pool's size."""
        cells, request_index, _ = _held_entries(self.table_ids, self.table_lengths,
                                                self.table_released)
        cells, first, counts = np.unique(cells, return_index=True, return_counts=True)
        return cells, request_index[first], counts

    def _holder_arrays(self) -> list[np.ndarray]:
        if not self._holders:  # two threads may both build it: the same arrays either way
            self._holders[:] = _holder_arrays(self.table_ids, self.table_lengths,
                                              self.table_released, len(self.ref_counts))
        return self._holders


def _concatenate(tables: list[Sequence[int]]) -> np.ndarray:
    """The tables' ids one after another, copied, as int64 (lists or arrays alike)."""
    if not tables:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(tables, dtype=np.int64, casting="unsafe")


def _held_entries(block_ids: np.ndarray, lengths: np.ndarray, released: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The entries that hold a block, of the tables `block_ids` holds one after another,
    `lengths` long, the first `released` of each holding none: their blocks, the index of
    their table, and their index in it."""
    request_index = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    table_starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = (np.arange(len(block_ids)) - table_starts).astype(np.int32)
    held = positions >= np.repeat(released, lengths)
    return block_ids[held], request_index[held], positions[held]


def _holder_arrays(block_ids: np.ndarray, lengths: np.ndarray, released: np.ndarray,
                   num_blocks: int) -> list[np.ndarray]:
    """[holder_ptr, holders, holder_positions] of the module docstring, for the tables
    `block_ids` holds one after another, `lengths` long, the first `released` of each
    holding no block."""
    block_ids, request_index, positions = _held_entries(block_ids, lengths, released)
    order = np.argsort(block_ids, kind="stable")
    counts = np.bincount(block_ids, minlength=num_blocks)
    holder_ptr = np.zeros(num_blocks + 1, dtype=np.int32)
    np.cumsum(counts, out=holder_ptr[1:])
    return [holder_ptr, request_index[order], positions[order]]


@dataclass(slots=True, frozen=True)
class KVTierStats:
    """The KV tiers under the prefix cache (all zero when they are off). Hits and misses count
    full prompt blocks the pool did not have, from requests admitted since the start."""

    host_capacity_bytes: int = 0     # 0: no host tier
    host_bytes: int = 0              # KV held in the host tier now
    host_blocks: int = 0
    disk_capacity_bytes: int = 0     # 0: no disk tier
    disk_bytes: int = 0              # every entry in the tier directory (other models' too)
    disk_blocks: int = 0
    hit_blocks: int = 0              # read back from a tier instead of prefilled
    hit_tokens: int = 0
    host_hit_blocks: int = 0         # of hit_blocks, from host RAM
    disk_hit_blocks: int = 0         # of hit_blocks, from disk
    miss_blocks: int = 0             # in neither the pool nor a tier: prefilled
    miss_tokens: int = 0
    bytes_read: int = 0              # from disk
    bytes_written: int = 0           # to disk
    writes_dropped: int = 0          # the writer's queue was full: not stored
    entries_rejected: int = 0        # header or checksum mismatch: deleted, never loaded
    entries_skipped: int = 0         # not regular files (links, FIFOs, directories): left alone
    blocks_not_finite: int = 0       # KV with a NaN or inf: never stored
    blocks_dropped: int = 0          # KV that a request failed after: forgotten, deleted
    disk_error: str | None = None    # why the disk tier turned itself off, if it did

    @property
    def hit_rate(self) -> float:
        looked_up = self.hit_blocks + self.miss_blocks
        return self.hit_blocks / looked_up if looked_up else 0.0


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_blocks: int
    block_size: int
    blocks_in_use: int
    blocks_cached: int
    blocks_free: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_evictions: int
    batch_size: int
    batch_tokens: int
    prompt_tokens_per_s: float
    generation_tokens_per_s: float
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    kv_slots_wasted: int
    step_time_s: float       # the last step, end to end
    forward_time_s: float    # the model's forward in the last step (the rest is host work)
    blocks: BlockMap
    # The cells whose state changed since the engine's previous snapshot: applied in order
    # to a BlockStates, every snapshot's changes keep the map's arrays (process_transport).
    block_changes: BlockChanges = field(default_factory=BlockChanges.none)
    tier: KVTierStats = KVTierStats()
    # Totals since the engine started (vLLM's counters): every request's whole prompt,
    # cached tokens included, counted once at its first token; and every sampled token.
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    blocks_freed_by_window: int = 0   # released behind a sliding window (every layer windowed)
    # Drafted tokens verified since the engine started, and how many of them were accepted
    # (EngineConfig.num_speculative_tokens; vLLM's spec_decode counters).
    draft_tokens_total: int = 0
    accepted_draft_tokens_total: int = 0
    # a pool-less client's figure for its engine's KV use (a remote's vLLM kv_cache_usage_perc)
    reported_kv_cache_usage: float | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        drafted = self.draft_tokens_total
        return self.accepted_draft_tokens_total / drafted if drafted else 0.0

    @property
    def kv_cache_usage(self) -> float | None:
        """The share of the KV pool in use: from the block counts where there is a pool,
        else what the engine reported (None: nothing)."""
        if self.num_blocks:
            return self.blocks_in_use / self.num_blocks
        return self.reported_kv_cache_usage

    @property
    def kv_waste(self) -> float:
        """Allocated slots holding no token, over allocated slots (internal fragmentation)."""
        allocated = self.blocks_in_use * self.block_size
        return self.kv_slots_wasted / allocated if allocated else 0.0


class RateMeter:
    """Tokens per second over a sliding window; decays to 0 when nothing happens."""

    def __init__(self, window_s: float = 2.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()

    def add(self, count: int, now: float | None = None) -> None:
        self._events.append((time.perf_counter() if now is None else now, count))

    def rate(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        if not self._events:
            return 0.0
        return sum(count for _, count in self._events) / self.window_s


@dataclass(slots=True)
class StepMetrics:
    """What the engine counts as it steps, for its snapshots: token rates over the last
    seconds, the generated tokens since it started, and the last step's batch and time
    (zero after a step that ran nothing)."""

    prompt_rate: RateMeter = field(default_factory=RateMeter)
    generation_rate: RateMeter = field(default_factory=RateMeter)
    generation_tokens_total: int = 0
    batch_size: int = 0
    batch_tokens: int = 0
    step_time_s: float = 0.0

    def record_step(self, batch_size: int, batch_tokens: int, prompt_tokens: int,
                    sampled_tokens: int, step_time_s: float) -> None:
        self.prompt_rate.add(prompt_tokens)
        self.generation_rate.add(sampled_tokens)
        self.generation_tokens_total += sampled_tokens
        self.batch_size, self.batch_tokens, self.step_time_s = batch_size, batch_tokens, step_time_s


def snapshot(num_blocks: int, scheduler: Scheduler, metrics: StepMetrics,
             forward_time_s: float) -> EngineStats:
    """The engine's stats now: its pool of `num_blocks` blocks through the scheduler's KV
    manager and requests, its queues and counters, and the last step's `metrics`."""
    kv_cache = scheduler.kv_cache
    blocks, changes, wasted = kv_cache.block_map(scheduler.requests)
    in_use, cached = kv_cache.block_states.num_in_use, kv_cache.block_states.num_cached
    return EngineStats(
        num_blocks=num_blocks,
        block_size=kv_cache.block_size,
        blocks_in_use=in_use,
        blocks_cached=cached,
        blocks_free=num_blocks - in_use - cached,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting) + len(scheduler.loading) + len(scheduler.compiling),
        num_preemptions=scheduler.num_preemptions,
        num_evictions=kv_cache.pool.num_evictions,
        batch_size=metrics.batch_size,
        batch_tokens=metrics.batch_tokens,
        prompt_tokens_per_s=metrics.prompt_rate.rate(),
        generation_tokens_per_s=metrics.generation_rate.rate(),
        prefix_cache_queried_tokens=scheduler.prefix_cache_queried_tokens,
        prefix_cache_hit_tokens=scheduler.prefix_cache_hit_tokens,
        kv_slots_wasted=wasted,
        step_time_s=metrics.step_time_s,
        forward_time_s=forward_time_s,
        blocks=blocks,
        block_changes=changes,
        tier=kv_cache.tier.stats() if kv_cache.tier is not None else KVTierStats(),
        prompt_tokens_total=scheduler.prompt_tokens_total,
        generation_tokens_total=metrics.generation_tokens_total,
        blocks_freed_by_window=kv_cache.num_window_released,
        draft_tokens_total=scheduler.num_draft_tokens,
        accepted_draft_tokens_total=scheduler.num_accepted_draft_tokens,
    )
