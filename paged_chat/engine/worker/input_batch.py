"""The sampling settings of every request the runner samples for, kept across steps (vLLM's
persistent input batch, for what sampling reads; the block tables persist the same way in
kv.block_id_rows): a request's settings are written to a row of a device table once, when it
first samples, and a step sends only its rows' indices and output positions."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from paged_chat.engine.core.request import Request
from paged_chat.engine.worker.sampler import (
    NUM_COLUMNS,
    SamplingBatch,
    SettingsRows,
    as_int64,
    sampling_columns,
    seed_streams,
)


class SamplingRows:
    """A row per request: its settings (`sampler.sampling_columns`' layout) and its seed's
    stream (`sampler.seed_streams`), on the host and on the device.

    Invariants: a row belongs to at most one request, held while it has the row (so its
    `id` names no other); the device table equals the host's once `batch` has run; a row
    goes back only once its request has finished, when a new request needs one.
    """

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 64) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._row_of: dict[int, int] = {}  # id(request) -> row
        self._owners: list[Request | None] = []
        self._free: list[int] = []
        self._changed = False
        self._copied: torch.cuda.Event | None = None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        """Tables of `capacity` rows, keeping the rows already written."""
        cuda = self.device.type == "cuda"
        old = len(self._owners)
        host = torch.zeros(capacity, NUM_COLUMNS, dtype=torch.float32, pin_memory=cuda)
        streams = torch.zeros(capacity, dtype=torch.int64, pin_memory=cuda)
        if old:
            self._wait_for_copy()
            host[:old], streams[:old] = self._host_table, self._host_streams
        self._host_table, self._host_streams = host, streams
        self._host_array = host.numpy()
        self._table = host.to(self.device) if cuda else host
        self._streams = streams.to(self.device) if cuda else streams
        self._owners.extend([None] * (capacity - old))
        self._free.extend(range(capacity - 1, old - 1, -1))

    def rows(self, requests: Sequence[Request]) -> np.ndarray:
        """The requests' rows (int64), a new one written for a request without one."""
        rows = np.empty(len(requests), dtype=np.int64)
        for index, request in enumerate(requests):
            row = self._row_of.get(id(request))
            rows[index] = self._add(request) if row is None else row
        return rows

    def batch(self, rows: np.ndarray, rows_on_device: torch.Tensor,
              output_indices: torch.Tensor, host_reads: bool) -> SamplingBatch:
        """The SamplingBatch of `rows` (as `rows` gave them; the same on the device), each at
        its output index (int64, on the device): one gather from the device tables."""
        self._update_device()
        return SamplingBatch.from_columns(self._host_array[rows], self._table[rows_on_device],
                                          self._streams[rows_on_device], output_indices,
                                          self.vocab_size, host_reads)

    def kernel_batch(self, rows: np.ndarray, rows_on_device: torch.Tensor,
                     output_indices: torch.Tensor) -> SamplingBatch:
        """`batch`, for the sampling kernel, which reads the device tables itself: nothing
        gathered (but the penalties, where a row uses them)."""
        self._update_device()
        return SamplingBatch.for_kernel(
            self._host_array[rows],
            SettingsRows(self._table, self._streams, rows_on_device, output_indices))

    def _update_device(self) -> None:
        """Copy the host tables to the device if a row was written since the last copy."""
        if self._changed and self.device.type == "cuda":
            self._table.copy_(self._host_table, non_blocking=True)
            self._streams.copy_(self._host_streams, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        self._changed = False

    def _add(self, request: Request) -> int:
        if not self._free:
            self._release_finished()
        if not self._free:
            self._allocate(2 * len(self._owners))
        self._wait_for_copy()  # the last copy to the device may still read the host table
        row = self._free.pop()
        self._row_of[id(request)] = row
        self._owners[row] = request
        self._host_array[row] = sampling_columns([request.params], self.vocab_size)[0]
        seed = np.array([as_int64(request.sampling_seed)], dtype=np.int64)
        self._host_streams[row] = int(seed_streams(seed)[0])
        self._changed = True
        return row

    def _release_finished(self) -> None:
        for row, owner in enumerate(self._owners):
            if owner is not None and owner.is_finished:
                del self._row_of[id(owner)]
                self._owners[row] = None
                self._free.append(row)

    def _wait_for_copy(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
