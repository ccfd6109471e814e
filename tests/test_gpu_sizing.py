"""KV pool sizing on CUDA, as far as it runs without a GPU: the budget arithmetic and the
config's bound on gpu_memory_utilization."""

from __future__ import annotations

import pytest
import torch

from paged_chat.engine import EngineConfig
from paged_chat.engine.kv.pool_sizing import kv_budget, worst_case_sampling
from paged_chat.engine.worker.sampler import sample

GiB = 2**30


@pytest.mark.parametrize("fraction", [1.0, 1, 1.2, 0, -0.5])
def test_gpu_memory_utilization_must_be_below_one(fraction):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=.*expected a fraction in \(0, 1\)"):
        EngineConfig(gpu_memory_utilization=fraction)


def test_kv_budget_counts_what_the_whole_card_already_uses():
    """80 GiB card, 90%: other processes and the CUDA context (20 GiB in use beyond this
    process's 2 GiB of weights: free is 58 GiB) and a 3 GiB step peak come off, and 3% of
    the card stays free for fragmentation."""
    budget = kv_budget(total=80 * GiB, free=58 * GiB, step_peak=3 * GiB, utilization=0.9)
    assert budget == int(80 * GiB * 0.9) - 22 * GiB - 3 * GiB - int(80 * GiB * 0.03)
    # Sizing from the card's total (the old way) would have handed out the 20 GiB in use.
    assert budget < int(80 * GiB * 0.9) - 2 * GiB - 3 * GiB - 20 * GiB + 1
    assert kv_budget(total=24 * GiB, free=2 * GiB, step_peak=GiB, utilization=0.9) < 0


def test_worst_case_sampling_turns_every_buffer_on():
    """The profile's sampler batch uses penalties and every filter, and runs."""
    batch = worst_case_sampling(4, 100, torch.device("cpu"))
    assert batch.seen is not None and batch.output_counts is not None
    assert batch.top_k is not None and batch.top_p is not None and batch.min_p is not None
    assert sample(torch.zeros(4, 100), batch).shape == (4,)


def test_decode_graph_inputs_keep_their_addresses_across_steps(make_engine):
    """What a captured CUDA graph relies on, checked on the CPU: a bucket's inputs are laid
    out at the same addresses whatever the step's real batch, padded with decodes that store
    nothing; steps pick the smallest captured bucket, and only all-decode steps replay."""
    from types import SimpleNamespace

    from paged_chat.engine.attention.metadata import StagingBuffer

    runner = make_engine().runner
    runner._graph_width, runner._graph_staging = 8, StagingBuffer(torch.device("cpu"))
    first = runner._graph_meta(8, [5, 9], [[3, 1], [2]], [11, 12])
    second = runner._graph_meta(8, [6, 10, 2], [[3, 1], [2], [4]], [13, 14, 15])
    for a, b in ((first.block_tables, second.block_tables), (first.seq_lens, second.seq_lens),
                 (first.slot_mapping, second.slot_mapping), (first.extra[0], second.extra[0])):
        assert a.data_ptr() == b.data_ptr()
    assert second.extra[0].tolist() == [13, 14, 15, 0, 0, 0, 0, 0]
    assert second.slot_mapping.tolist()[3:] == [-1] * 5
    runner._graphs = {1: None, 4: None, 8: None}
    decode = SimpleNamespace(num_new_tokens=1)
    assert runner._graph_batch([decode] * 3) == 4
    assert runner._graph_batch([decode] * 9) is None
    assert runner._graph_batch([decode, SimpleNamespace(num_new_tokens=5)]) is None
