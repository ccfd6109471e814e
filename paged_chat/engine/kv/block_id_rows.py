"""The block tables as ids, one row of one array per table: what a step hands attention."""

from __future__ import annotations

import numpy as np

from paged_chat.engine.kv.block_pool import NULL_BLOCK


class BlockIdRows:
    """Each block table's ids as one row of an int32 array, kept in step with the tables.

    A step hands the runner the tables of every scheduled request as ids, padded into one
    array. Building it from the KVBlock lists would read every block of every table each
    step, and joining per-request arrays costs more again. The manager
    writes a row only where its table changes (a block added: once every `block_size`
    tokens of a decode; blocks released behind a window), so a step only copies rows.

    Invariants: a row holds its table's ids (NULL_BLOCK's is 0) and 0 past its length, so
    rows pad with the null block as `AttentionMetadata` expects; a freed row goes back
    cleared. The runner owns the rows (its step reads them); the KV manager writes them.
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
            self._ids[row, :self._lengths[row]] = NULL_BLOCK.block_id
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
