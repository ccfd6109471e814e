"""Per-request block tables over the BlockPool, and the prefix-cache walk.

A request's block table is the list of blocks holding its positions in order: block `i`
holds positions `[i * block_size, (i + 1) * block_size)`. Tables grow on demand, one block
at a time as tokens arrive, and go back to the pool whole when the request finishes, is
aborted, errors or is preempted.

With a KV tier (host RAM, disk) below the pool, the prefix-cache walk goes on past the
pool's last hit: blocks the tier holds are read back into fresh blocks before the
request's first chunk is scheduled, and count as computed. Blocks go down to the tier
when they leave the pool's keeping: a request's hashed blocks when it frees them (finish,
abort, preemption), and cached blocks when eviction takes them. Their KV is copied out at
that moment (the next forward may overwrite it); the tier writes it to disk off the step.

When every layer of the model has a sliding window (Mistral), the blocks a request's window
has left behind go back to the pool as soon as the request's next query is past them, as
vLLM does: a query at position p attends only the keys p - window < k <= p (`window` the
smallest over the layers), so a block whose last position is at most
`first_query - window` is never read again. Its table entry becomes `NULL_BLOCK`, so
positions keep their place in the table; those entries are always a leading run, and the
request keeps the hashes of every block (`Request.block_hashes`), so its later full blocks
chain to the right parents. A released block that was hashed stays in the prefix cache,
evictable, like any block a finished request frees. Admission counts only the blocks from
the window on, so such a request can outgrow the pool (`kv_pool_sizing.longest_sequence`). While any
layer attends globally nothing is released.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import Counter
from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch

from paged_chat.engine.block_pool import NULL_BLOCK, BlockPool, KVBlock
from paged_chat.engine.kv_tier import KVTier
from paged_chat.engine.request import Request


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """128-bit digest of a whole prefix: the parent block's digest and this block's tokens."""
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockKV(Protocol):
    """Copies whole blocks' KV out of and into the pool (the ModelRunner owns the tensor)."""

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor: ...

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None: ...


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 tier: KVTier | None = None, block_kv: BlockKV | None = None,
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: the window of every layer (the smallest), or None when some
        layer attends to the whole context; with it, blocks behind the window are released."""
        assert tier is None or (enable_caching and block_kv is not None), (
            "a KV tier needs the prefix cache and a way to copy blocks")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching, track_evictions=tier is not None)
        self.tier = tier
        self.block_kv = block_kv
        self.sliding_window = sliding_window
        self.tables: dict[str, list[KVBlock]] = {}
        self.block_id_rows = BlockIdRows()     # the same tables as ids, for the step's arrays
        self._num_hashed: dict[str, int] = {}
        # Per request, how many leading table entries are NULL_BLOCK (absent: none).
        self.num_released: dict[str, int] = {}
        self.num_window_released = 0    # blocks released behind a sliding window, ever

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
        end = self._usable_run((block is not None for block in hits), 0)
        num_out = self._num_out_of_window(end * self.block_size)
        return [NULL_BLOCK] * num_out + hits[num_out:end]

    def _usable_run(self, available: Iterable[bool], start: int) -> int:
        """The furthest block `end` such that the blocks from `start` on that the window of
        position `end * block_size` sees are all available (`available` says so of block
        `start`, then `start + 1`, ...); `start` when there is none. Without a window that is
        the leading run of available blocks, and `available` is read up to its first miss."""
        if self.sliding_window is None:
            return start + sum(1 for _ in itertools.takewhile(bool, available))
        run, run_ends = 0, []    # run_ends[i]: how many available blocks in a row end at i
        for ok in available:
            run = run + 1 if ok else 0
            run_ends.append(run)
        for end in range(start + len(run_ends), start, -1):
            first_seen = max(start, self._num_out_of_window(end * self.block_size))
            if run_ends[end - 1 - start] >= end - first_seen:
                return end
        return start

    def allocate(self, request: Request, num_new_tokens: int,
                 cached_prefix: list[KVBlock] | None = None,
                 tier_kv: list[torch.Tensor | None] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and after the
        `cached_prefix`, taken over here, and the `tier_kv` blocks, written into fresh
        blocks here). Returns False, changing nothing, when the pool is short.
        With a sliding window, the blocks behind the window of the first new token are
        released first (even when False is returned: nothing reads them again), and the
        prefix and tier blocks behind it are left out (NULL_BLOCK), neither taken nor read.
        """
        table = self.tables.get(request.request_id)
        num_tokens = request.num_computed_tokens + num_new_tokens
        if (table is not None and not cached_prefix and not tier_kv and self.sliding_window is None
                and num_tokens <= len(table) * self.block_size):
            # A running request whose last block has room (most decode steps): nothing to take.
            self._cache_full_blocks(request, num_tokens)
            return True
        cached_prefix, tier_kv = cached_prefix or [], tier_kv or []
        first_query = (request.num_computed_tokens
                       + (len(cached_prefix) + len(tier_kv)) * self.block_size)
        num_tokens = first_query + num_new_tokens
        self._release_out_of_window(request, first_query)
        num_new_blocks = self._blocks_to_allocate(request, num_tokens, first_query, cached_prefix)
        if num_new_blocks is None:
            assert not tier_kv, "read_tier_prefix reads only what fits"
            return False
        table = self.tables.setdefault(request.request_id, [])
        num_held = len(table)
        num_out = max(0, self._num_out_of_window(first_query) - len(table))
        live_prefix = cached_prefix[num_out:]
        assert NULL_BLOCK not in live_prefix, "find_cached_prefix left out a block in the window"
        live_tier_kv = tier_kv[max(0, num_out - len(cached_prefix)):]
        if num_out:
            table.extend([NULL_BLOCK] * num_out)
            self.num_released[request.request_id] = len(table)
        self.pool.touch(live_prefix)
        table.extend(live_prefix)
        if num_new_blocks > 0:
            fresh = self.pool.allocate(num_new_blocks)
            self._offload_evicted()
            self._restore(fresh[:len(live_tier_kv)], live_tier_kv)
            table.extend(fresh)
        self.block_id_rows.extend(request.request_id, [block.block_id for block in table[num_held:]])
        self._cache_full_blocks(request, num_tokens)
        return True

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first, so its prefix is evicted last (their KV
        goes down to the tier first, when there is one)."""
        table = self.tables.pop(request.request_id, [])
        self.block_id_rows.release(request.request_id)
        self._num_hashed.pop(request.request_id, None)
        self._give_back(table[self.num_released.pop(request.request_id, 0):])

    def _give_back(self, blocks: list[KVBlock]) -> None:
        """Drop the request's reference to `blocks` (their hashed ones' KV goes down to the
        tier first, when there is one), last block first."""
        if self.tier is not None:
            self._offload([(block.block_hash, block.block_id) for block in blocks
                           if block.block_hash is not None])
        self.pool.free(blocks[::-1])

    def _num_out_of_window(self, first_query: int) -> int:
        """How many leading blocks no query at `first_query` or later attends to: block i
        ends at position (i + 1) * block_size - 1, which the window of `first_query` sees
        while it is above `first_query - window`."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query - self.sliding_window + 1) // self.block_size

    def _release_out_of_window(self, request: Request, first_query: int) -> None:
        """Give back the blocks of the request's table that its window has now left."""
        table = self.tables.get(request.request_id)
        if table is None:
            return
        released = self.num_released.get(request.request_id, 0)
        num_out = min(self._num_out_of_window(first_query), len(table))
        if num_out <= released:
            return
        self._give_back(table[released:num_out])
        table[released:num_out] = [NULL_BLOCK] * (num_out - released)
        self.block_id_rows.clear(request.request_id, released, num_out)
        self.num_released[request.request_id] = num_out
        self.num_window_released += num_out - released

    def check_invariants(self) -> None:
        """Assert the pool's invariants and that the tables account for every reference:
        a block's ref count is the number of tables holding it, none twice (soak and fault
        tests call this between steps; a leak or a double free shows up here first)."""
        self.pool.check_invariants()
        holders: Counter[int] = Counter()
        for request_id, table in self.tables.items():
            released = self.num_released.get(request_id, 0)
            assert all(block is NULL_BLOCK for block in table[:released]), (
                f"{request_id}: a released entry holds a block")
            held = table[released:]
            assert NULL_BLOCK not in held, f"{request_id}: a NULL_BLOCK past the released run"
            assert len({block.block_id for block in held}) == len(held), (
                f"{request_id} holds a block twice")
            holders.update(block.block_id for block in held)
            assert self.block_id_rows.of(request_id).tolist() == [b.block_id for b in table], (
                f"{request_id}: its row of block ids is not its table")
        assert self.num_released.keys() <= self.tables.keys(), "released count of no table"
        for block in self.pool.blocks:
            assert block.ref_count == holders[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {holders[block.block_id]} tables")

    def _blocks_to_allocate(self, request: Request, num_tokens: int, first_query: int,
                            cached_prefix: list[KVBlock]) -> int | None:
        """Fresh blocks the request's table needs to hold `num_tokens` once it has taken over
        `cached_prefix` (those from the window of `first_query` on), or None when the pool
        cannot give that many."""
        num_held = len(self.tables.get(request.request_id, ()))
        num_out = self._num_out_of_window(first_query)
        count = self.blocks_needed(num_tokens) - max(num_held + len(cached_prefix), num_out)
        revived = sum(1 for block in cached_prefix[max(0, num_out - num_held):]
                      if block.ref_count == 0)
        return count if count <= self.pool.num_free_blocks - revived else None

    # ---- the KV tier ------------------------------------------------------------------

    def read_tier_prefix(self, request: Request, cached_prefix: list[KVBlock],
                         budget: int) -> list[torch.Tensor | None] | None:
        """The KV of the request's full blocks right after its `cached_prefix` (the pool's
        hits) that the tier holds, read back now; [] without a tier or a hit.

        Reads only when the pool has room for those blocks and a first chunk of up to
        `budget` tokens, so `allocate` cannot then fail; returns None (the request waits,
        as one whose chunk does not fit) when it has not. A block that turns out missing
        or corrupt ends the run: the rest is prefilled. With a sliding window, the blocks
        behind the window of the run's end are neither needed in the tier nor read: None
        stands for each.
        """
        if self.tier is None:
            return []
        start, max_blocks = len(cached_prefix), (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        end = self._usable_run((block_hash in self.tier for block_hash in hashes[start:max_blocks]),
                               start)
        num_cached = end * self.block_size
        num_tokens = num_cached + min(request.num_tokens - num_cached, budget)
        if self._blocks_to_allocate(request, num_tokens, num_cached, cached_prefix) is None:
            return None
        first_read = max(start, self._num_out_of_window(num_cached))
        tier_kv = self.tier.load(hashes[first_read:end])
        if len(tier_kv) < end - first_read:
            if first_read > start:    # the window of any shorter run sees a skipped block
                tier_kv = []
            end = start + len(tier_kv)
        self.tier.record_misses(max_blocks - end)
        return [None] * (end - start - len(tier_kv)) + tier_kv

    def _restore(self, blocks: list[KVBlock], tier_kv: list[torch.Tensor]) -> None:
        if tier_kv:
            self.block_kv.write_blocks([block.block_id for block in blocks], torch.stack(tier_kv))
            for block in blocks:
                block.from_tier = True

    def _offload_evicted(self) -> None:
        if self.pool.evicted:
            evicted, self.pool.evicted = self.pool.evicted, []
            self._offload(evicted)

    def _offload(self, blocks: list[tuple[bytes, int]]) -> None:
        """Copy out the KV of (hash, block id) pairs the tier does not hold yet and hand it
        over; what the tier has no room for now is dropped."""
        blocks = [(block_hash, block_id) for block_hash, block_id in blocks
                  if block_hash not in self.tier][:self.tier.room()]
        if blocks:
            hashes, block_ids = zip(*blocks)
            self.tier.store(list(hashes), self.block_kv.read_blocks(list(block_ids)))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the blocks that are full once this step's tokens are written.

        Safe at schedule time: attention stores a step's K/V before it reads any, so a
        request that hits one of these blocks later in the same step reads written data.
        """
        if not self.pool.enable_caching:
            return
        num_full = num_tokens // self.block_size
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
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, tokens[index * size:(index + 1) * size]))


class BlockIdRows:
    """Each block table's ids as one row of an int32 array, kept in step with the tables.

    A step hands the runner the tables of every scheduled request as ids, padded into one
    array. Building it from the KVBlock lists costs ~30k attribute reads per step at batch
    256 with 2k-token contexts, and joining per-request arrays ~0.15 ms more. The manager
    writes a row only where its table changes (a block added: once every `block_size`
    tokens of a decode; blocks released behind a window), so a step only copies rows.

    Invariants: a row holds its table's ids (NULL_BLOCK's is 0) and 0 past its length, so
    rows pad with block 0 as `AttentionMetadata` expects; a freed row goes back cleared.
    Views that `of` gave out keep their ids while the request runs: a table only grows at
    its end, and a wider or longer array is a new one.
    """

    def __init__(self) -> None:
        self._ids = np.zeros((16, 16), dtype=np.int32)
        self._lengths = np.zeros(16, dtype=np.int64)
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(15, -1, -1))

    def extend(self, request_id: str, block_ids: list[int]) -> None:
        """Append ids to the request's row (a new row for a request without one)."""
        row = self._row_of.get(request_id)
        if row is None:
            row = self._row_of[request_id] = self._take_row()
        start = int(self._lengths[row])
        end = start + len(block_ids)
        if end > self._ids.shape[1]:
            self._resize(self._ids.shape[0], max(end, 2 * self._ids.shape[1]))
        self._ids[row, start:end] = block_ids
        self._lengths[row] = end

    def clear(self, request_id: str, start: int, end: int) -> None:
        """Set entries [start, end) of the request's row to NULL_BLOCK's id (0)."""
        self._ids[self._row_of[request_id], start:end] = NULL_BLOCK.block_id

    def release(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._ids[row, :self._lengths[row]] = 0
            self._lengths[row] = 0
            self._free_rows.append(row)

    def of(self, request_id: str) -> np.ndarray:
        """The request's ids (a view; empty when it holds no table)."""
        row = self._row_of.get(request_id)
        return _NO_IDS if row is None else self._ids[row, :self._lengths[row]]

    def array(self, request_ids: list[str]) -> np.ndarray:
        """The requests' rows in order, copied, cut to the longest table: [n, widest]."""
        rows = np.fromiter(map(self._row_of.__getitem__, request_ids), dtype=np.int64,
                           count=len(request_ids))
        width = max(1, int(self._lengths[rows].max())) if len(rows) else 1
        return self._ids[rows, :width]

    def _take_row(self) -> int:
        if not self._free_rows:
            rows = self._ids.shape[0]
            self._resize(2 * rows, self._ids.shape[1])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _resize(self, rows: int, width: int) -> None:
        ids = np.zeros((rows, width), dtype=np.int32)
        ids[:self._ids.shape[0], :self._ids.shape[1]] = self._ids
        lengths = np.zeros(rows, dtype=np.int64)
        lengths[:len(self._lengths)] = self._lengths
        self._ids, self._lengths = ids, lengths


_NO_IDS = np.zeros(0, dtype=np.int32)
