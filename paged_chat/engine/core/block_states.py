"""The block map's per-block state, kept incrementally: the pool lists the blocks whose state
changed (`BlockChanges`, vLLM's BlockStored/BlockRemoved in one record), and a `BlockStates`
applies them to whole arrays, so a snapshot costs the changes and one copy of the arrays,
never a walk of the pool. A consumer that applies every change of a stream, in order, to
a `BlockStates` of the same size holds the pool's state (the process transport's parent
does, so only changes cross its pipe).

Cells, as in the block map: cell i is block i + 1 (block 0 is the null block).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True, frozen=True)
class BlockChanges:
    """The state now of the cells that changed since the previous changes of a stream."""

    cells: np.ndarray        # int64 [n], each cell at most once
    ref_counts: np.ndarray   # int32 [n]
    cached: np.ndarray       # bool [n]: has a prefix hash
    from_tier: np.ndarray    # bool [n]: KV read back from a KV tier

    @classmethod
    def none(cls) -> "BlockChanges":
        return cls(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32),
                   np.zeros(0, dtype=bool), np.zeros(0, dtype=bool))

    def __len__(self) -> int:
        return len(self.cells)


class BlockStates:
    """Every cell's ref count and flags, and how many cells are in use (ref > 0) and cached
    (ref 0 with a hash: evictable), kept current by `apply` in O(changes)."""

    def __init__(self, num_blocks: int) -> None:
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)
        self.cached = np.zeros(num_blocks, dtype=bool)
        self.from_tier = np.zeros(num_blocks, dtype=bool)
        self.num_in_use = 0
        self.num_cached = 0

    def apply(self, changes: BlockChanges) -> None:
        cells = changes.cells
        if not len(cells):
            return
        self.num_in_use -= int(np.count_nonzero(self.ref_counts[cells]))
        self.num_cached -= _count_cached(self.ref_counts[cells], self.cached[cells])
        self.ref_counts[cells] = changes.ref_counts
        self.cached[cells] = changes.cached
        self.from_tier[cells] = changes.from_tier
        self.num_in_use += int(np.count_nonzero(changes.ref_counts))
        self.num_cached += _count_cached(changes.ref_counts, changes.cached)


def _count_cached(ref_counts: np.ndarray, cached: np.ndarray) -> int:
    return int(np.count_nonzero(cached & (ref_counts == 0)))
