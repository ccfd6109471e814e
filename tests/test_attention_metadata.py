"""AttentionMetadata.build: the one builder of a step's metadata (runner, profiler, device
check and tests all use it)."""

from __future__ import annotations

import numpy as np
import torch

from paged_chat.engine.attention.metadata import AttentionMetadata, StagingBuffer

CPU = torch.device("cpu")


def test_build_derives_positions_slots_and_offsets_from_lengths_and_tables():
    block_size = 4
    tables = [[9, 3], [5, 6, 1, 8], [2, 7], [4, 0, 11, 12, 10]]
    query_lens, seq_lens = [1, 1, 5, 3], [7, 16, 5, 20]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, CPU,
                                   table_width=6)
    positions = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
    owners = [i for i, q in enumerate(query_lens) for _ in range(q)]
    slots = [tables[i][p // block_size] * block_size + p % block_size
             for i, p in zip(owners, positions)]
    assert meta.positions.tolist() == positions
    assert meta.slot_mapping.tolist() == slots
    assert meta.query_start_loc.tolist() == meta.query_start_loc_list == [0, 1, 2, 7, 10]
    assert meta.seq_lens.tolist() == meta.seq_lens_list == seq_lens
    assert meta.num_decodes == 2
    assert meta.block_tables.shape == (4, 6) and meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == [t + [0] * (6 - len(t)) for t in tables]
    assert meta.slot_mapping.dtype == meta.positions.dtype == torch.int64


def test_build_sends_extra_arrays_and_reuses_the_staging_buffer():
    """The runner's staging buffer: the step's tensors are views of one buffer, at the same
    addresses from step to step (what a captured CUDA graph reads), holding the new step."""
    staging = StagingBuffer(CPU, capacity=64)
    first = AttentionMetadata.build([1, 1], [3, 9], [[1], [2, 3, 4]], 4, CPU,
                                    extra=(np.array([11, 12]),), staging=staging)
    second = AttentionMetadata.build([1, 1], [4, 10], [[1], [2, 3, 4]], 4, CPU,
                                     extra=(np.array([13, 14]),), staging=staging)
    assert second.extra[0].tolist() == [13, 14]
    assert second.seq_lens.tolist() == [4, 10] and second.positions.tolist() == [3, 9]
    assert second.block_tables.data_ptr() == first.block_tables.data_ptr()
    assert second.extra[0].data_ptr() == first.extra[0].data_ptr()


def test_build_pads_to_a_fixed_batch_with_decodes_that_store_nothing():
    meta = AttentionMetadata.build([1, 1], [6, 3], [[4, 5], [7]], 4, CPU, table_width=8,
                                   pad_to=4)
    assert meta.num_seqs == 4 and meta.num_decodes == 4
    assert meta.slot_mapping.tolist() == [5 * 4 + 1, 7 * 4 + 2, -1, -1]
    assert meta.seq_lens.tolist() == [6, 3, 1, 1]
    assert meta.block_tables.shape == (4, 8) and meta.block_tables[2:].eq(0).all()
