"""CUDA graphs of decode steps, as far as they run without a GPU: the replay emulated on the
CPU (a replay reruns the captured forward over the captured inputs, which the C kernels
read as a graph's kernels do: lengths, tables and slots from the tensors, none from the
host), the start-up check against eager steps, and the fallback to eager when a capture
raises or a check fails."""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import random_prompts

from paged_chat.engine import SamplingParams
from paged_chat.engine.attention.metadata import StagingBuffer
from paged_chat.engine.worker import runner as runner_module

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def no_progress(stage: str, done: int, total: int) -> None:
    """A ProgressHook that hears nothing."""


class EmulatedCapture:
    """CudaGraphCapture on the CPU: the output is the forward's first result, and a replay
    reruns the forward, whose inputs the runner rewrote in place, into that same tensor.
    `corrupt` plants a wrong replay."""

    def __init__(self, corrupt: Callable[[torch.Tensor], None] | None = None) -> None:
        self.replays = 0
        self.corrupt = corrupt

    def __call__(self, forward: Callable[[], torch.Tensor]
                 ) -> tuple[Callable[[], None], torch.Tensor]:
        output = forward()

        def replay() -> None:
            self.replays += 1
            output.copy_(forward())
            if self.corrupt is not None:
                self.corrupt(output)

        return replay, output


@pytest.fixture
def capture(monkeypatch) -> Callable[..., EmulatedCapture]:
    def plant(corrupt: Callable[[torch.Tensor], None] | None = None) -> EmulatedCapture:
        emulated = EmulatedCapture(corrupt)
        monkeypatch.setattr(runner_module, "CudaGraphCapture", lambda: emulated)
        return emulated
    return plant


def test_decode_graph_inputs_keep_their_addresses_across_steps(make_engine):
    """What a captured CUDA graph relies on: a bucket's inputs are laid out at the same
    addresses whatever the step's real batch, padded with decodes that store nothing; steps
    pick the smallest captured bucket, and only all-decode steps replay."""
    runner = make_engine().runner
    runner._graph_width, runner._graph_staging = 8, StagingBuffer(torch.device("cpu"))
    first = runner._graph_meta(8, [5, 9], [[3, 1], [2]], [11, 12])
    second = runner._graph_meta(8, [6, 10, 2], [[3, 1], [2], [4]], [13, 14, 15])
    for a, b in ((first.block_tables, second.block_tables), (first.seq_lens, second.seq_lens),
                 (first.slot_mapping, second.slot_mapping), (first.extra[0], second.extra[0])):
        assert a.data_ptr() == b.data_ptr()
    assert second.extra[0].tolist() == [13, 14, 15, 0, 0, 0, 0, 0]
    assert second.slot_mapping.tolist()[3:] == [-1] * 5
    as_lists = (second.block_tables.clone(), second.slot_mapping.clone())
    # the tables as the runner has them (BlockIdRows' array): the same layout, same addresses
    third = runner._graph_meta(8, [6, 10, 2], np.array([[3, 1], [2, 0], [4, 0]], dtype=np.int32),
                               [13, 14, 15])
    assert third.block_tables.data_ptr() == first.block_tables.data_ptr()
    assert torch.equal(third.block_tables, as_lists[0])
    assert torch.equal(third.slot_mapping, as_lists[1])
    runner._graphs = {1: None, 4: None, 8: None}
    decode = SimpleNamespace(num_new_tokens=1)
    assert runner._graph_batch([decode] * 3) == 4
    assert runner._graph_batch([decode] * 9) is None
    assert runner._graph_batch([decode, SimpleNamespace(num_new_tokens=5)]) is None


def test_replayed_decode_steps_give_the_eager_tokens(make_engine, capture):
    """Padded batches (5 chats in bucket 8, then fewer as they end), tables of a fixed width
    and staging rewritten in place: the replayed steps give the eager engine's tokens."""
    prompts = random_prompts(5, seed=3)
    lengths = [10, 4, 7, 10, 2]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    eager = [out.token_ids for out in make_engine().generate(prompts, params)]
    emulated = capture()
    engine = make_engine()
    assert engine.runner.use_decode_graphs(8, no_progress)
    assert sorted(engine.runner._graphs) == [1, 2, 4, 8]
    checked = emulated.replays
    assert checked == 4  # the start-up check replays every bucket once
    assert [out.token_ids for out in engine.generate(prompts, params)] == eager
    assert emulated.replays - checked >= max(lengths) - 1  # every decode step replayed


def test_a_capture_that_raises_leaves_eager_steps_and_says_why(make_engine, monkeypatch, caplog):
    def failing_capture() -> Callable:
        def capture(forward: Callable[[], torch.Tensor]) -> None:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return capture

    monkeypatch.setattr(runner_module, "CudaGraphCapture", failing_capture)
    prompts = random_prompts(3, seed=4)
    eager = [out.token_ids for out in make_engine().generate(prompts, GREEDY)]
    engine = make_engine()
    with caplog.at_level(logging.WARNING, logger=runner_module.__name__):
        assert not engine.runner.use_decode_graphs(8, no_progress)
    assert "CUDA graphs are off, every step runs eagerly" in caplog.text
    assert "operation not permitted" in caplog.text
    assert engine.runner._graphs == {}
    assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == eager


def test_graphs_that_disagree_with_eager_steps_are_dropped(make_engine, capture, caplog):
    """A replay that picks other tokens (planted: token 0 wins every row) fails the start-up
    check: the engine runs eagerly, says so, and gives the eager tokens."""
    def token_zero_wins(logits: torch.Tensor) -> None:
        logits[:, 0] = logits.abs().amax() * 10 + 1

    emulated = capture(token_zero_wins)
    prompts = random_prompts(3, seed=5)
    eager = [out.token_ids for out in make_engine().generate(prompts, GREEDY)]
    engine = make_engine()
    with caplog.at_level(logging.WARNING, logger=runner_module.__name__):
        assert not engine.runner.use_decode_graphs(8, no_progress)
    assert "picks other tokens than an eager step" in caplog.text
    assert engine.runner._graphs == {}
    replays = emulated.replays
    assert [out.token_ids for out in engine.generate(prompts, GREEDY)] == eager
    assert emulated.replays == replays
