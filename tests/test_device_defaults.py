"""The knobs whose defaults depend on the device: batch sizes and CUDA graphs, GPU-sized on
CUDA, chat-sized on the CPU, and what a user sets kept on either."""

from __future__ import annotations

import pytest

from paged_chat.engine import EngineConfig


def test_cuda_takes_gpu_batch_sizes_and_graphs():
    config = EngineConfig().for_device("cuda")
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.enforce_eager) == \
        (256, 8192, False)


def test_cpu_keeps_its_own_batch_sizes_and_runs_eager():
    config = EngineConfig().for_device("cpu")
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.enforce_eager) == \
        (32, 512, True)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_what_the_user_sets_wins_on_either_device(device):
    config = EngineConfig(max_num_seqs=7, max_num_batched_tokens=300,
                          enforce_eager=True).for_device(device)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.enforce_eager) == \
        (7, 300, True)


def test_the_engine_runs_on_its_devices_defaults(make_engine):
    """An engine built with the knobs unset schedules with its device's values, and says so
    in its config (what the bench and the device check read)."""
    engine = make_engine(max_num_seqs=None, max_num_batched_tokens=None)
    assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (32, 512)
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (32, 512)
    assert engine.config.enforce_eager is True


@pytest.mark.parametrize("name", ["max_num_seqs", "max_num_batched_tokens"])
def test_a_bad_batch_size_is_still_refused(name):
    with pytest.raises(ValueError, match=f"EngineConfig.{name}=0 is invalid"):
        EngineConfig(**{name: 0})
