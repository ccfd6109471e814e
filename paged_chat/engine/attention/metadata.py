"""What every attention backend needs to run one step over a flat, unpadded batch, and the
one place it is built (`AttentionMetadata.build`): the runner, the engine's profiler,
the device check and the tests all go through it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

# Bytes: every array in a staging buffer starts 16-byte aligned, as a fresh allocation does;
# Triton specialises its kernels on pointer alignment, so a step's arrays must not move in
# and out of it (each change would compile another kernel variant).
_ALIGN = 16


class StagingBuffer:
    """Carries a step's small host arrays to the device in one copy.

    The arrays are packed into one host byte buffer (pinned on CUDA, so the copy is
    asynchronous) and copied with a single `copy_` into one device buffer that lives as long
    as this object: the step's tensors are views of it, at the same addresses step after
    step (what a captured CUDA graph reads), updated in place. Both buffers grow (once) when
    a step needs more. On the CPU the host buffer is the device buffer: no copy at all.

    Invariant: the views one `transfer` returns are valid until the next `transfer`.
    """

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self._copied: torch.cuda.Event | None = None
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        cuda = self.device.type == "cuda"
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=cuda)
        self._host_bytes = self.host.numpy()
        self.on_device = torch.empty(capacity, dtype=torch.uint8, device=self.device) if cuda \
            else self.host

    def transfer(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Device tensors holding `arrays` (same dtypes and shapes), after one copy."""
        offsets, total = [], 0
        for array in arrays:
            offsets.append(total)
            total += -(-array.nbytes // _ALIGN) * _ALIGN
        if total > self.host.numel():
            self._allocate(max(total, 2 * self.host.numel()))
        if self._copied is not None:  # the last step's copy may still read the host buffer
            self._copied.synchronize()
        host = self._host_bytes
        for array, offset in zip(arrays, offsets):
            host[offset:offset + array.nbytes] = np.ascontiguousarray(array).view(np.uint8).ravel()
        if self.on_device is not self.host:
            self.on_device[:total].copy_(self.host[:total], non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        return [self.on_device[offset:offset + array.nbytes].view(_TORCH_DTYPES[array.dtype])
                .view(array.shape) for array, offset in zip(arrays, offsets)]


_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step batch layout, shared by all layers.

    The step's tokens are one flat sequence of `num_tokens`. Sequence `i` owns the query
    tokens `query_start_loc[i]:query_start_loc[i + 1]`; after this step it has
    `seq_lens[i]` tokens of context (cached prefix + these new ones), whose K/V live in the
    blocks `block_tables[i, :ceil(seq_lens[i] / block_size)]`. New token `t` sits at
    position `positions[t]` of its sequence and writes its K/V to the flat slot
    `slot_mapping[t]` (block id * block_size + offset).

    Sequences are ordered decodes first: the first `num_decodes` have exactly one query
    token, so backends can run them as one batched matrix product and loop only over the
    (few) prefill chunks. The `*_list` fields are host copies of the same numbers, so
    backends never sync with the device to read a length. `per_step` holds whatever a
    backend derives from these once per step (masks, gather indices) for every layer.
    `extra` holds the arrays the builder's caller sent along in the same copy (the runner's
    token ids and logits rows), in the order given.
    """

    slot_mapping: torch.Tensor      # [num_tokens] int64
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32
    block_tables: torch.Tensor      # [num_seqs, max_blocks_per_seq] int32, padded with 0
    num_decodes: int
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    block_size: int
    positions: torch.Tensor | None = None   # [num_tokens] int64
    extra: tuple[torch.Tensor, ...] = ()
    per_step: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @classmethod
    def build(cls, query_lens: Sequence[int], seq_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]] | np.ndarray | torch.Tensor,
              block_size: int, device: torch.device, *,
              extra: Sequence[np.ndarray] = (),
              slot_mapping: torch.Tensor | None = None,
              table_width: int | None = None,
              pad_to: int | None = None,
              staging: StagingBuffer | None = None) -> "AttentionMetadata":
        """The metadata of a step whose sequence `i` gets `query_lens[i]` new tokens and then
        holds `seq_lens[i]`, its K/V in the blocks of `block_tables[i]` (ragged lists, or an
        array already padded), decodes first.

        Positions and (unless given) slots follow from the lengths and the tables. Every
        device tensor comes out of one host-to-device copy through `staging` (a fresh
        buffer when None; the runner passes its persistent one). `table_width` pads the
        tables to a fixed number of columns (at least the widest row). `pad_to` appends
        dummy decodes up to that many sequences (a CUDA graph's fixed batch): one token at
        position 0, a context of 1, slot -1 (nothing stored), table row of block 0.
        """
        if pad_to is not None:
            padding = pad_to - len(query_lens)
            assert padding >= 0 and slot_mapping is None
            query_lens = [*query_lens, *[1] * padding]
            seq_lens = [*seq_lens, *[1] * padding]
            block_tables = _padded_rows(block_tables, padding)
        query_lens_np = np.asarray(query_lens, dtype=np.int64)
        seq_lens_np = np.asarray(seq_lens, dtype=np.int64)
        assert (query_lens_np >= 1).all() and (seq_lens_np >= query_lens_np).all()
        starts = np.zeros(len(query_lens_np) + 1, dtype=np.int64)
        np.cumsum(query_lens_np, out=starts[1:])
        tables = _table_array(block_tables, table_width)
        first_position = np.repeat(seq_lens_np - query_lens_np - starts[:-1], query_lens_np)
        positions = np.arange(starts[-1], dtype=np.int64) + first_position
        arrays = [positions, starts.astype(np.int32), seq_lens_np.astype(np.int32), tables]
        if slot_mapping is None:
            seq_index = np.repeat(np.arange(len(query_lens_np)), query_lens_np)
            slots = (tables[seq_index, positions // block_size].astype(np.int64) * block_size
                     + positions % block_size)
            if pad_to is not None:
                slots[len(slots) - padding:] = -1
            arrays.append(slots)
        arrays.extend(extra)
        tensors = (staging or StagingBuffer(device, capacity=1)).transfer(arrays)
        positions_t, starts_t, seq_lens_t, tables_t, *rest = tensors
        if slot_mapping is None:
            slot_mapping, *rest = rest
        not_decode = np.flatnonzero(query_lens_np != 1)
        return cls(
            slot_mapping=slot_mapping.to(device), query_start_loc=starts_t, seq_lens=seq_lens_t,
            block_tables=tables_t,
            num_decodes=int(not_decode[0]) if not_decode.size else len(query_lens_np),
            query_start_loc_list=starts.tolist(), seq_lens_list=seq_lens_np.tolist(),
            block_size=block_size, positions=positions_t, extra=tuple(rest))


def _padded_rows(block_tables: Sequence[Sequence[int]] | np.ndarray | torch.Tensor,
                 padding: int) -> Sequence[Sequence[int]] | np.ndarray:
    """`block_tables` with `padding` more rows of block 0; an array stays an array (a graph's
    step pads every step: no Python list per row)."""
    if isinstance(block_tables, torch.Tensor):
        block_tables = block_tables.to("cpu", torch.int32).numpy()
    if isinstance(block_tables, np.ndarray):  # [rows, width]
        padding_rows = np.zeros((padding, block_tables.shape[1]), dtype=np.int32)
        return np.concatenate([block_tables.astype(np.int32, copy=False), padding_rows])
    return [*map(list, block_tables), *[[0]] * padding]


def _table_array(block_tables: Sequence[Sequence[int]] | np.ndarray | torch.Tensor,
                 width: int | None) -> np.ndarray:
    """Block tables as int32 [num_seqs, width], rows padded with block 0."""
    if isinstance(block_tables, torch.Tensor):
        block_tables = block_tables.to("cpu", torch.int32).numpy()
    if isinstance(block_tables, np.ndarray):
        array = block_tables.astype(np.int32, copy=False)
        if width is None or width == array.shape[1]:
            return array
        assert width >= array.shape[1]
        return np.pad(array, ((0, 0), (0, width - array.shape[1])))
    lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    width = width or max(1, int(lengths.max()))
    assert width >= lengths.max(), "a block table is wider than table_width"
    array = np.zeros((len(block_tables), width), dtype=np.int32)
    flat = (np.concatenate(block_tables, dtype=np.int32, casting="unsafe") if len(block_tables)
            else np.zeros(0, dtype=np.int32))
    array[np.arange(width) < lengths[:, None]] = flat  # row-major: the tables in order
    return array
