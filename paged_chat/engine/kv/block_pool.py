"""The pool of KV blocks: ref counts, an O(1) LRU free queue, and the prefix-cache index.

The pool's `num_blocks` blocks have ids 1..num_blocks; block 0 of the KV cache is the null
block (`NULL_BLOCK`), reserved as vLLM reserves it: never allocated, never in the free
queue, counted neither free, cached nor in use. Padding and released entries of block
tables point at it. Every block of the pool is in exactly one of three states:

- in use: `ref_count > 0`; not in the free queue. It may have a hash (then other requests
  with the same prefix can share it).
- cached: `ref_count == 0`, has a hash, in the free queue. Its K/V are still valid, so a
  request with the same prefix can take it back; it is evicted only when the queue's
  head reaches it.
- free: `ref_count == 0`, no hash, in the free queue.

The free queue is a doubly linked list threaded through the blocks themselves, so popping
the head, appending at the tail and unlinking a block from the middle (a cache hit on a
cached block) are all O(1). Freed blocks go to the tail, so the head is always the least
recently used; eviction is lazy: a block loses its hash only when it is popped for reuse.

`cached_blocks` maps a block hash to the block holding that content. A hash is chained
over the parent block's hash and this block's token ids (128-bit BLAKE2b), so equal
hashes mean equal whole prefixes, not just equal blocks; a first block's parent is its
request's cache salt (kv_cache_manager.salt_root), so prefixes of different salts never
match. Only full blocks are hashed.

Every change of a block's ref count, hash or `from_tier` marks it, and `take_changes`
returns the marked blocks' state (the stats' incremental block map: core.block_states), so
what a snapshot costs follows the blocks that changed, not the pool's size.

With `track_evictions`, `allocate` lists each evicted block's (hash, block id) in
`evicted`: its KV is intact until the next forward, so the owner of a KV tier can copy
it out first (and must clear the list).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from paged_chat.engine.core.block_states import BlockChanges


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    from_tier: bool = False     # its KV was read back from a KV tier, not computed
    prev_free: "KVBlock | None" = None
    next_free: "KVBlock | None" = None


# Block 0, reserved: the stand-in, in a request's block table, for a block its sliding
# window has left behind and that went back to the pool (no query of that request attends
# its positions again), and what the padding of a table points at. Attention still indexes
# the cache with its id and masks those keys. Never in the pool or its queue.
NULL_BLOCK = KVBlock(0)

# The stats read these of every changed block: map() with an attrgetter is ~2x a
# generator's speed.
_REF_COUNT, _FROM_TIER = attrgetter("ref_count"), attrgetter("from_tier")


class FreeBlockQueue:
    """Doubly linked list of blocks with ref_count 0, least recently used at the head."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)     # sentinels: no None checks in the hot paths
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        assert block is not self._tail, "popleft from an empty free queue"
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_blocks += 1

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_blocks -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """The cache's `num_blocks` allocatable KV blocks (ids 1..num_blocks: 0 is NULL_BLOCK)
    and the prefix-cache index over them. `blocks[i]` is block `i + 1`."""

    def __init__(self, num_blocks: int, enable_caching: bool,
                 track_evictions: bool = False) -> None:
        self.blocks = [KVBlock(i) for i in range(NULL_BLOCK.block_id + 1, num_blocks + 1)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached_blocks: dict[bytes, KVBlock] = {}
        self.num_evictions = 0
        self.track_evictions = track_evictions
        self.evicted: list[tuple[bytes, int]] = []
        self._changed: set[KVBlock] = set()   # since the last take_changes

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out: free plus cached (evictable)."""
        return self.free_queue.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached_blocks.get(block_hash) if self.enable_caching else None

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the LRU end, evicting cached content as needed."""
        assert count <= self.num_free_blocks, f"asked for {count} blocks, {self.num_free_blocks} free"
        taken = []
        for _ in range(count):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                if self.track_evictions:
                    self.evicted.append((block.block_hash, block.block_id))
                del self.cached_blocks[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_count = 1
            block.from_tier = False
            taken.append(block)
        self._changed.update(taken)
        return taken

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take another reference to each block (a prefix hit), reviving cached ones."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1
        self._changed.update(blocks)

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go to the queue's tail.

        Pass a request's blocks in eviction order: callers give the tail of a sequence
        first, so its prefix (the part most likely to be shared) is evicted last.
        """
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)
        self._changed.update(blocks)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Index a full block under its prefix hash (first one wins on a duplicate)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block
            self._changed.add(block)

    def uncache(self, blocks: list[KVBlock]) -> None:
        """Take blocks out of the prefix-cache index (their KV is not to be trusted)."""
        for block in blocks:
            if block.block_hash is not None:
                del self.cached_blocks[block.block_hash]
                block.block_hash = None
                self._changed.add(block)

    def mark_from_tier(self, blocks: list[KVBlock]) -> None:
        """Their KV was read back from a KV tier (until they are allocated again)."""
        for block in blocks:
            block.from_tier = True
        self._changed.update(blocks)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (weights changed, or a test wants a cold cache)."""
        for block in self.cached_blocks.values():
            block.block_hash = None
        self._changed.update(self.cached_blocks.values())
        self.cached_blocks.clear()

    def take_changes(self) -> BlockChanges:
        """The state of every block whose ref count, hash or `from_tier` changed since the
        last call (cells: block id - 1), and forget them."""
        changed, self._changed = list(self._changed), set()
        count = len(changed)
        return BlockChanges(
            np.fromiter((block.block_id - 1 for block in changed), dtype=np.int64, count=count),
            np.fromiter(map(_REF_COUNT, changed), dtype=np.int32, count=count),
            np.fromiter((block.block_hash is not None for block in changed), dtype=bool,
                        count=count),
            np.fromiter(map(_FROM_TIER, changed), dtype=bool, count=count))

    def check_invariants(self) -> None:
        """Assert the three-state invariant of the module docstring (tests call this)."""
        in_queue = {block.block_id for block in self.free_queue}
        assert len(in_queue) == self.free_queue.num_blocks, "free queue count is off"
        assert NULL_BLOCK.block_id not in in_queue and NULL_BLOCK.ref_count == 0, (
            "the null block was handed out")
        assert NULL_BLOCK.block_hash is None and NULL_BLOCK not in self.cached_blocks.values()
        for block in self.blocks:
            assert block.ref_count >= 0
            assert (block.ref_count == 0) == (block.block_id in in_queue), (
                f"block {block.block_id}: ref_count {block.ref_count}, in free queue "
                f"{block.block_id in in_queue}")
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) is block
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash
