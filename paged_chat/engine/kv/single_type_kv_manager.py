"""Block tables for one kind of attention over the BlockPool (vLLM's single-type managers).

A request's block table is the list of blocks holding its positions in order: block `i`
holds positions `[i * block_size, (i + 1) * block_size)`. Tables grow at their end, one
block at a time as tokens arrive, and go back to the pool whole when the request finishes,
is aborted, errors or is preempted. Each table is mirrored, as block ids, in a row of the
runner's `BlockIdRows`, written here wherever the table changes.

What depends on the kind of attention is which positions a query still reads, so which
leading blocks of a table can go (`num_skipped_blocks`) and which run of cached blocks a
prefix hit needs (`longest_hit`); everything else is one piece, in `SingleTypeKVManager`:

- `FullAttentionManager`: a query reads the whole context; nothing is released.
- `SlidingWindowManager` (every layer has a window, as Mistral): a query at position p
  attends only the keys p - window < k <= p (`window` the smallest over the layers), so a
  block whose last position is at most `first_query - window` is never read again; it goes
  back to the pool as soon as the request's next query is past it, as vLLM does. Its table
  entry becomes `NULL_BLOCK`, so positions keep their place in the table; those entries are
  always a leading run (`num_released`). A released block that was hashed stays in the
  prefix cache, evictable, like any block a finished request frees. Admission counts only
  the blocks from the window on, so such a request can outgrow the pool
  (`kv_pool_sizing.longest_sequence`).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable

from paged_chat.engine.kv.block_id_rows import BlockIdRows
from paged_chat.engine.kv.block_pool import NULL_BLOCK, BlockPool, KVBlock


class SingleTypeKVManager:
    """Every request's block table (`tables`) over one pool, and its row of ids in `rows`.

    Invariants: a table's first `num_released[request_id]` entries (absent: none) are
    NULL_BLOCK and no later one is; a block's ref count is the number of tables holding it
    past their released run, none twice; `rows` holds each table's ids.
    """

    releases_blocks = False    # whether a table's leading blocks can go back while it runs

    def __init__(self, pool: BlockPool, block_size: int, rows: BlockIdRows) -> None:
        self.pool = pool
        self.block_size = block_size
        self.rows = rows
        self.tables: dict[str, list[KVBlock]] = {}
        self.num_released: dict[str, int] = {}
        self.num_window_released = 0    # blocks released behind a sliding window, ever

    def num_skipped_blocks(self, first_query: int) -> int:
        """How many leading blocks no query at position `first_query` or later reads."""
        raise NotImplementedError

    def longest_hit(self, available: Iterable[bool], start: int) -> int:
        """The furthest block `end` such that every block from `start` on that a query at
        position `end * block_size` reads is available (`available` says so of block
        `start`, then `start + 1`, ...); `start` when there is none."""
        raise NotImplementedError

    def blocks_to_allocate(self, request_id: str, num_tokens: int, first_query: int,
                           prefix: list[KVBlock]) -> int | None:
        """Fresh blocks the table needs to hold `num_tokens` once it has taken over `prefix`
        (those a query at `first_query` reads), or None when the pool cannot give that many."""
        num_held = len(self.tables.get(request_id, ()))
        num_skipped = self.num_skipped_blocks(first_query)
        count = -(-num_tokens // self.block_size) - max(num_held + len(prefix), num_skipped)
        revived = sum(1 for block in prefix[max(0, num_skipped - num_held):]
                      if block.ref_count == 0)
        return count if count <= self.pool.num_free_blocks - revived else None

    def append(self, request_id: str, prefix: list[KVBlock], num_new_blocks: int,
               first_query: int) -> list[KVBlock]:
        """Extend the table: NULL_BLOCK for what a query at `first_query` no longer reads,
        the rest of `prefix` (taken over), then `num_new_blocks` fresh ones (returned)."""
        table = self.tables.setdefault(request_id, [])
        num_held = len(table)
        num_skipped = max(0, self.num_skipped_blocks(first_query) - num_held)
        live_prefix = prefix[num_skipped:]
        assert NULL_BLOCK not in live_prefix, "a prefix hit left out a block the window reads"
        if num_skipped:
            table.extend([NULL_BLOCK] * num_skipped)
            self.num_released[request_id] = len(table)
        self.pool.touch(live_prefix)
        table.extend(live_prefix)
        fresh = self.pool.allocate(num_new_blocks) if num_new_blocks > 0 else []
        table.extend(fresh)
        self.rows.extend(request_id, [block.block_id for block in table[num_held:]])
        return fresh

    def remove_skipped_blocks(self, request_id: str, first_query: int) -> list[KVBlock]:
        """Take the blocks of the table that no query from `first_query` on reads out of it
        (NULL_BLOCK in their place); return them, for the caller to give back."""
        table = self.tables.get(request_id)
        if table is None:
            return []
        released = self.num_released.get(request_id, 0)
        num_out = min(self.num_skipped_blocks(first_query), len(table))
        if num_out <= released:
            return []
        blocks = table[released:num_out]
        table[released:num_out] = [NULL_BLOCK] * (num_out - released)
        self.rows.clear(request_id, released, num_out)
        self.num_released[request_id] = num_out
        self.num_window_released += num_out - released
        return blocks

    def free(self, request_id: str) -> list[KVBlock]:
        """Drop the request's table; return the blocks it held, for the caller to give back."""
        table = self.tables.pop(request_id, [])
        self.rows.release(request_id)
        return table[self.num_released.pop(request_id, 0):]

    def check_invariants(self) -> None:
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
            assert self.rows.of(request_id).tolist() == [b.block_id for b in table], (
                f"{request_id}: its row of block ids is not its table")
        assert self.num_released.keys() <= self.tables.keys(), "released count of no table"
        for block in self.pool.blocks:
            assert block.ref_count == holders[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {holders[block.block_id]} tables")


class FullAttentionManager(SingleTypeKVManager):
    """Every layer attends to the whole context: a table keeps every block it took."""

    def num_skipped_blocks(self, first_query: int) -> int:
        return 0

    def longest_hit(self, available: Iterable[bool], start: int) -> int:
        """The leading run of available blocks (`available` is read up to its first miss)."""
        return start + sum(1 for _ in itertools.takewhile(bool, available))


class SlidingWindowManager(SingleTypeKVManager):
    """Every layer attends to at most the last `sliding_window` positions."""

    releases_blocks = True

    def __init__(self, pool: BlockPool, block_size: int, rows: BlockIdRows,
                 sliding_window: int) -> None:
        super().__init__(pool, block_size, rows)
        self.sliding_window = sliding_window

    def num_skipped_blocks(self, first_query: int) -> int:
        """Block i ends at position (i + 1) * block_size - 1, which the window of
        `first_query` sees while it is above `first_query - window`."""
        return max(0, first_query - self.sliding_window + 1) // self.block_size

    def longest_hit(self, available: Iterable[bool], start: int) -> int:
        run, run_ends = 0, []    # run_ends[i]: how many available blocks in a row end at i
        for ok in available:
            run = run + 1 if ok else 0
            run_ends.append(run)
        for end in range(start + len(run_ends), start, -1):
            first_seen = max(start, self.num_skipped_blocks(end * self.block_size))
            if run_ends[end - 1 - start] >= end - first_seen:
                return end
        return start
