"""The KV cache's bookkeeping: block tables over the BlockPool, the prefix-cache walk, and
what goes to and comes from the KV tier. It never copies KV itself (the runner does, for
`kv_transfer.KVTransfer`): it only decides, so nothing the scheduler calls does I/O.

Tables and what a query reads of them (full attention or a sliding window on every layer)
are the `single_type_kv_manager`'s; this adds the prefix hashes, full blocks indexed as
they fill, and the tier:

- Down: blocks go down to the tier when they leave the pool's keeping: a request's hashed
  blocks when it frees them (finish, abort, preemption, a window leaving them behind), and
  cached blocks when eviction takes them. Each is listed in `offloads`; the engine copies
  them out before the next forward (the only thing that could overwrite them) and the tier
  writes them to disk off the step.
- Up: the prefix-cache walk goes on past the pool's last hit into the blocks the tier
  holds. Such a request takes its blocks (pool hits and fresh ones for the tier's) and
  waits for a `TierRead`, not scheduled, while the read runs off the step; once its KV is
  in (`finish_tier_read`), those blocks count as computed and are indexed, and it is
  scheduled like any waiting request. A read that comes back short (a block missing or
  corrupt) gives every block back: the request starts over, and the tier, which has
  forgotten the bad block, serves the run before it.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_chat.engine.core.block_states import BlockChanges, BlockStates
from paged_chat.engine.core.request import Request
from paged_chat.engine.core.stats import BlockMap
from paged_chat.engine.kv.block_id_rows import BlockIdRows
from paged_chat.engine.kv.block_pool import NULL_BLOCK, BlockPool, KVBlock
from paged_chat.engine.kv.single_type_kv_manager import (
    FullAttentionManager,
    SingleTypeKVManager,
    SlidingWindowManager,
)
from paged_chat.engine.kv.tier import KVTier

if TYPE_CHECKING:
    import torch


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """128-bit digest of a whole prefix: the parent block's digest and this block's tokens."""
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def salt_root(cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block: empty, or the digest of its cache salt
    (personalised, so no salt's digest is a block's), which keeps each salt's chains apart."""
    if cache_salt is None:
        return b""
    return hashlib.blake2b(cache_salt.encode(), digest_size=16, person=b"cache-salt").digest()


class TierReadState(enum.Enum):
    IN_FLIGHT = "in flight"
    DONE = "done"           # every block read: the request's prefix is in place
    SHORT = "short"         # a block was missing or rejected: the request starts over


@dataclass(slots=True, eq=False)
class TierRead:
    """The KV tier's KV of `block_hashes`, read off the step into `blocks` (fresh blocks of
    the request's table, in order). Until it is done none of them is indexed, so no other
    request can hit a block whose KV is not in yet."""

    request: Request
    block_hashes: list[bytes]
    blocks: list[KVBlock]
    num_cached_tokens: int    # once done: pool hits, blocks a window skips, blocks read
    num_tier_tokens: int      # of those, the ones past the pool's hits
    state: TierReadState = TierReadState.IN_FLIGHT
    future: Future[list[torch.Tensor]] | None = None    # the reader's, set when it starts


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 tier: KVTier | None = None, sliding_window: int | None = None,
                 rows: BlockIdRows | None = None) -> None:
        """`sliding_window`: the window of every layer (the smallest), or None when some
        layer attends to the whole context; with it, blocks behind the window are released.
        `rows`: where the tables' ids go (the runner's), a fresh one when not given."""
        assert tier is None or enable_caching, "a KV tier needs the prefix cache"
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching, track_evictions=tier is not None)
        self.block_states = BlockStates(num_blocks)   # as of the last block_map
        self.tier = tier
        rows = BlockIdRows() if rows is None else rows
        self.single_type_manager: SingleTypeKVManager = (
            FullAttentionManager(self.pool, block_size, rows) if sliding_window is None
            else SlidingWindowManager(self.pool, block_size, rows, sliding_window))
        self._num_hashed: dict[str, int] = {}
        # (block hash, block id) whose KV goes down to the tier before the next forward.
        self.offloads: list[tuple[bytes, int]] = []
        # Prefix hashes whose tier entries the tier must forget before the next schedule.
        self.tier_drops: list[bytes] = []
        self.tier_reads: dict[str, TierRead] = {}    # by request id, until it is admitted
        self.new_tier_reads: list[TierRead] = []     # issued, for the reader to start

    @property
    def tables(self) -> dict[str, list[KVBlock]]:
        return self.single_type_manager.tables

    @property
    def num_released(self) -> dict[str, int]:
        """Per request, how many leading table entries are NULL_BLOCK (absent: none)."""
        return self.single_type_manager.num_released

    @property
    def num_window_released(self) -> int:
        return self.single_type_manager.num_window_released

    @property
    def block_id_rows(self) -> BlockIdRows:
        return self.single_type_manager.rows

    def block_map(self, requests: dict[str, Request]) -> tuple[BlockMap, BlockChanges, int]:
        """The pool's block map, each table tagged with its request's owner; the blocks whose
        state changed since the previous call (applied to `block_states`, which the map's
        arrays are copies of); and how many slots the tables hold past their requests'
        computed tokens. The map's cells are the pool's blocks: cell i is block i + 1
        (block 0 is the null block). Costs the changes and the tables, plus one copy of the
        per-block arrays."""
        changes = self.pool.take_changes()
        self.block_states.apply(changes)
        tables = {rid: self.block_id_rows.of(rid) - 1 for rid in self.tables}
        wasted = sum(len(table) * self.block_size - requests[rid].num_computed_tokens
                     for rid, table in tables.items() if rid in requests)
        owners = {rid: requests[rid].owner for rid in tables if rid in requests}
        states = self.block_states
        blocks = BlockMap.build(states.ref_counts.copy(), states.cached.copy(), tables, owners,
                                states.from_tier.copy(), self.num_released)
        return blocks, changes, wasted

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.tables.get(request_id, ())]

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of the request's leading full blocks that is already cached.

        Stops short of the last token: it is always recomputed, so that even a fully
        cached prompt yields logits to sample from. With a sliding window only the blocks
        within the window of the first token after the run need to be cached: those
        before it come back as NULL_BLOCK (their KV is never read), so a long history
        whose oldest blocks were evicted still hits.
        """
        if not self.pool.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits = [self.pool.lookup(block_hash) for block_hash in request.block_hashes[:max_blocks]]
        manager = self.single_type_manager
        end = manager.longest_hit((block is not None for block in hits), 0)
        num_skipped = manager.num_skipped_blocks(end * self.block_size)
        return [NULL_BLOCK] * num_skipped + hits[num_skipped:end]

    def allocate(self, request: Request, num_new_tokens: int,
                 cached_prefix: list[KVBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and after the
        `cached_prefix`, taken over here). Returns False, changing nothing, when the pool is
        short. With a sliding window, the blocks behind the window of the first new token
        are released first (even when False is returned: nothing reads them again), and the
        prefix blocks behind it are left out (NULL_BLOCK), not taken.
        """
        manager = self.single_type_manager
        table = manager.tables.get(request.request_id)
        num_tokens = request.num_computed_tokens + num_new_tokens
        if (table is not None and not cached_prefix and not manager.releases_blocks
                and num_tokens <= len(table) * self.block_size):
            # A running request whose last block has room (most decode steps): nothing to take.
            self._cache_full_blocks(request, num_tokens)
            return True
        cached_prefix = cached_prefix or []
        first_query = request.num_computed_tokens + len(cached_prefix) * self.block_size
        num_tokens = first_query + num_new_tokens
        self._give_back(manager.remove_skipped_blocks(request.request_id, first_query))
        count = manager.blocks_to_allocate(request.request_id, num_tokens, first_query,
                                           cached_prefix)
        if count is None:
            return False
        manager.append(request.request_id, cached_prefix, count, first_query)
        self._collect_evicted()
        self._cache_full_blocks(request, num_tokens)
        return True

    def free(self, request: Request, keep_kv: bool = True) -> None:
        """Return the request's blocks, tail first, so its prefix is evicted last (their KV
        goes down to the tier first, when there is one); a tier read in flight for it is
        dropped (its blocks were never indexed: nothing of it is kept). Without `keep_kv`
        (the request failed: its KV may be what failed it) its blocks also leave the prefix
        cache, so none is hit again or goes down to the tier."""
        self.tier_reads.pop(request.request_id, None)
        self._num_hashed.pop(request.request_id, None)
        blocks = self.single_type_manager.free(request.request_id)
        if not keep_kv:
            self.pool.uncache(blocks)
        self._give_back(blocks)

    def drop_restored_kv(self, request: Request) -> bool:
        """For a request that failed: when KV read back from the tier is in its blocks, list
        every block of its prefix for the tier to forget (`tier_drops`, done by KVTransfer
        before the next schedule) and return True (the caller recomputes it without them);
        False when none of its KV came from the tier."""
        table = self.tables.get(request.request_id, ())
        if self.tier is None or not any(block.from_tier for block in table):
            return False
        self.tier_drops += request.block_hashes
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, and every block due to go down to the tier: after a
        failed step nobody can vouch that the blocks it indexed were written."""
        self.pool.reset_prefix_cache()
        self.offloads.clear()

    def take_offloads(self) -> list[tuple[bytes, int]]:
        offloads, self.offloads = self.offloads, []
        return offloads

    def check_invariants(self) -> None:
        """Assert the pool's invariants and that the tables account for every reference:
        a block's ref count is the number of tables holding it, none twice (soak and fault
        tests call this between steps; a leak or a double free shows up here first)."""
        self.pool.check_invariants()
        self.single_type_manager.check_invariants()
        assert self.tier_reads.keys() <= self.tables.keys(), "a tier read holds no table"
        for read in self.tier_reads.values():
            table = self.tables[read.request.request_id]
            assert all(block in table for block in read.blocks), "a tier read's block left"
            assert read.state is not TierReadState.IN_FLIGHT or all(
                block.block_hash is None for block in read.blocks), "a block in flight is indexed"

    # ---- the KV tier ------------------------------------------------------------------

    def tier_blocks_to_read(self, request: Request, cached_prefix: list[KVBlock],
                            budget: int) -> int | None:
        """How many of the request's full blocks right after its `cached_prefix` (the
        pool's hits, as `find_cached_prefix` found them) the tier can serve: 0 without a
        tier or a hit. None when the pool has no room for them and a first chunk of up to
        `budget` tokens (the request waits, as one whose chunk does not fit). With a
        sliding window, the count includes the blocks behind the window of the run's end,
        which are neither needed in the tier nor read. Looks only at the tiers' indexes."""
        if self.tier is None:
            return 0
        start, max_blocks = len(cached_prefix), (request.num_tokens - 1) // self.block_size
        manager = self.single_type_manager
        end = manager.longest_hit((block_hash in self.tier for block_hash
                                   in request.block_hashes[start:max_blocks]), start)
        num_cached = end * self.block_size
        num_tokens = num_cached + min(request.num_tokens - num_cached, budget)
        if manager.blocks_to_allocate(request.request_id, num_tokens, num_cached,
                                      cached_prefix) is None:
            return None
        return end - start

    def start_tier_read(self, request: Request, cached_prefix: list[KVBlock],
                        num_tier_blocks: int) -> None:
        """Take the request's `cached_prefix` and fresh blocks for the `num_tier_blocks` the
        tier serves after it (as `tier_blocks_to_read` counted, which checked the room), and
        issue their read (`new_tier_reads`)."""
        end = len(cached_prefix) + num_tier_blocks
        num_cached = end * self.block_size
        manager = self.single_type_manager
        count = manager.blocks_to_allocate(request.request_id, num_cached, num_cached,
                                           cached_prefix)
        assert count is not None, "tier_blocks_to_read checked the room"
        fresh = manager.append(request.request_id, cached_prefix, count, num_cached)
        self._collect_evicted()
        read = TierRead(request, request.block_hashes[end - len(fresh):end], fresh, num_cached,
                        num_tier_blocks * self.block_size)
        self.tier_reads[request.request_id] = read
        self.new_tier_reads.append(read)

    def take_new_tier_reads(self) -> list[TierRead]:
        reads, self.new_tier_reads = self.new_tier_reads, []
        return [read for read in reads if self.tier_reads.get(read.request.request_id) is read]

    def finish_tier_read(self, read: TierRead, complete: bool) -> None:
        """The read is over. `complete`: every block's KV is in its block now, so they count
        as computed and are indexed. Else the request must start over (state SHORT)."""
        assert self.tier_reads.get(read.request.request_id) is read, "a dropped read finished"
        if not complete:
            read.state = TierReadState.SHORT
            return
        self.pool.mark_from_tier(read.blocks)
        self._cache_full_blocks(read.request, read.num_cached_tokens)
        read.state = TierReadState.DONE

    def tier_read_state(self, request: Request) -> TierReadState:
        return self.tier_reads[request.request_id].state

    def admit_tier_read(self, request: Request) -> TierRead:
        """The done read of a request the scheduler now schedules, forgotten here."""
        read = self.tier_reads.pop(request.request_id)
        assert read.state is TierReadState.DONE
        return read

    def record_tier_misses(self, request: Request, num_cached_tokens: int) -> None:
        """Count the full prompt blocks of a request being admitted that neither the pool nor
        the tier had (they are prefilled)."""
        if self.tier is not None:
            max_blocks = (request.num_tokens - 1) // self.block_size
            self.tier.record_misses(max_blocks - num_cached_tokens // self.block_size)

    # ---- helpers ----------------------------------------------------------------------

    def _give_back(self, blocks: list[KVBlock]) -> None:
        """Drop the request's reference to `blocks` (their hashed ones' KV due to go down to
        the tier, when there is one), last block first."""
        if self.tier is not None:
            self.offloads += [(block.block_hash, block.block_id) for block in blocks
                              if block.block_hash is not None]
        self.pool.free(blocks[::-1])

    def _collect_evicted(self) -> None:
        if self.pool.evicted:
            self.offloads += self.pool.evicted
            self.pool.evicted = []

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the blocks that are full of the request's tokens once this step's are written.

        Safe at schedule time: attention stores a step's K/V before it reads any, so a
        request that hits one of these blocks later in the same step reads written data.
        """
        if not self.pool.enable_caching:
            return
        # Slots past the request's tokens hold drafts, which may yet be rejected: only the
        # tokens accepted into the request count toward full blocks.
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        first = self._num_hashed.get(request.request_id, 0)
        if num_full <= first:
            return
        self._extend_hashes(request, num_full)
        table = self.tables[request.request_id]
        for index in range(max(first, self.num_released.get(request.request_id, 0)), num_full):
            self.pool.cache(table[index], request.block_hashes[index])
        self._num_hashed[request.request_id] = num_full

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        hashes, size, tokens = request.block_hashes, self.block_size, request.all_token_ids
        for index in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else salt_root(request.params.cache_salt)
            hashes.append(hash_block(parent, tokens[index * size:(index + 1) * size]))
