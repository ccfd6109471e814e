"""Per-request block tables over the BlockPool, and the prefix-cache walk.

A request's block table is the list of blocks holding its positions in order: block `i`
holds positions `[i * block_size, (i + 1) * block_size)`. Tables grow on demand, one block
at a time as tokens arrive, and go back to the pool whole when the request finishes, is
aborted, errors or is preempted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter

from paged_chat.engine.block_pool import BlockPool, KVBlock
from paged_chat.engine.request import Request


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """128-bit digest of a whole prefix: the parent block's digest and this block's tokens."""
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[str, list[KVBlock]] = {}
        self._num_hashed: dict[str, int] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.tables.get(request_id, ())]

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of the request's leading full blocks that is already cached.

        Stops short of the last token: it is always recomputed, so that even a fully
        cached prompt yields logits to sample from.
        """
        if not self.pool.enable_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, request: Request, num_new_tokens: int,
                 cached_prefix: list[KVBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and after the
        `cached_prefix`, taken over here). Returns False, changing nothing, when the pool
        is short."""
        cached_prefix = cached_prefix or []
        table = self.tables.setdefault(request.request_id, [])
        num_tokens = (request.num_computed_tokens + len(cached_prefix) * self.block_size
                      + num_new_tokens)
        num_new_blocks = self.blocks_needed(num_tokens) - len(table) - len(cached_prefix)
        revived = sum(1 for block in cached_prefix if block.ref_count == 0)
        if num_new_blocks > self.pool.num_free_blocks - revived:
            if not table:
                del self.tables[request.request_id]
            return False
        self.pool.touch(cached_prefix)
        table.extend(cached_prefix)
        if num_new_blocks > 0:
            table.extend(self.pool.allocate(num_new_blocks))
        self._cache_full_blocks(request, num_tokens)
        return True

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first, so its prefix is evicted last."""
        table = self.tables.pop(request.request_id, [])
        self._num_hashed.pop(request.request_id, None)
        self.pool.free(table[::-1])

    def check_invariants(self) -> None:
        """Assert the pool's invariants and that the tables account for every reference:
        a block's ref count is the number of tables holding it, none twice (soak and fault
        tests call this between steps; a leak or a double free shows up here first)."""
        self.pool.check_invariants()
        holders: Counter[int] = Counter()
        for request_id, table in self.tables.items():
            assert len({block.block_id for block in table}) == len(table), (
                f"{request_id} holds a block twice")
            holders.update(block.block_id for block in table)
        for block in self.pool.blocks:
            assert block.ref_count == holders[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {holders[block.block_id]} tables")

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
        for index in range(first, num_full):
            self.pool.cache(table[index], request.block_hashes[index])
        self._num_hashed[request.request_id] = num_full

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        hashes, size, tokens = request.block_hashes, self.block_size, request.all_token_ids
        for index in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, tokens[index * size:(index + 1) * size]))


class BlockIdTables:
    """The block ids of each request's table, kept as int lists between steps.

    A step needs every running request's table as ids (for the runner, for the stats);
    walking each table's KVBlocks for them costs ~30k attribute reads per step at batch 256
    with 2k-token contexts. Tables only grow at their end while a request runs, so the ids
    are extended by the new blocks alone. A table that was dropped and rebuilt (preemption,
    finish) must be `forget`-ten: its new blocks may be as many as the old.
    """

    def __init__(self, tables: dict[str, list[KVBlock]]) -> None:
        self._tables = tables
        self._ids: dict[str, list[int]] = {}

    def of(self, request_id: str) -> list[int]:
        table = self._tables.get(request_id, ())
        ids = self._ids.setdefault(request_id, [])
        if len(ids) < len(table):
            ids.extend(block.block_id for block in table[len(ids):])
        assert len(ids) == len(table), f"{request_id}'s table shrank without forget()"
        return ids

    def forget(self, requests: list[Request]) -> None:
        for request in requests:
            self._ids.pop(request.request_id, None)
