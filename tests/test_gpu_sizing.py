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
