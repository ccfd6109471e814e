"""A step reads the device once: the sampled ids (and the logprobs asked for) come to the
host in one copy (`DeviceToHost.fetch`), and nothing else in the runner's work or the
sampler's reads a tensor on the host.

There is no device here, so the runner is run as it runs on one (`sample_on_host` False: the
sampler's device path) over CPU tensors, and every way a step could read a tensor on the
host is watched: scalar reads (`item`, `bool`, `int`: aten._local_scalar_dense), the ops
whose output size CUDA must read back (nonzero, mask indexing, masked_select,
repeat_interleave without its size), and tolist/numpy/cpu, which bypass the dispatcher.
The model's forward is left out (the kernel-count test watches it): its launches read
nothing on a device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import pytest
import torch
from helpers import random_prompts
from torch.utils._python_dispatch import TorchDispatchMode

from paged_chat.engine import SamplingParams
from paged_chat.engine.worker.device_to_host import DeviceToHost
from paged_chat.engine.worker.sampler import SamplingBatch, sample

aten = torch.ops.aten
_SIZE_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
               aten.repeat_interleave.Tensor, aten.item.default}
_BYPASSING = ("tolist", "numpy", "cpu", "item")


class HostReads(TorchDispatchMode):
    """Names every host read of a tensor while active and not paused."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            bool_index = func in (aten.index.Tensor, aten.index_put_.default,
                                  aten.index_put.default) \
                and any(i is not None and i.dtype == torch.bool for i in args[1])
            sized = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
            if (func in _SIZE_READS and func is not aten.repeat_interleave.Tensor) or sized \
                    or bool_index:
                self.reads.append(str(func))
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        paused, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = paused


@pytest.fixture
def host_reads(monkeypatch) -> Iterator[HostReads]:
    watch = HostReads()
    for name in _BYPASSING:
        method = getattr(torch.Tensor, name)

        def watched(self, *args, _method=method, _name=name, **kwargs):
            if not watch.paused:
                watch.reads.append(f"Tensor.{_name}")
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, watched)
    yield watch


def paused_in(watch: HostReads, function: Callable) -> Callable:
    def call(*args, **kwargs):
        with watch.pause():
            return function(*args, **kwargs)
    return call


MIXED = [SamplingParams(temperature=0.0),
         SamplingParams(temperature=0.2, top_p=0.9, seed=1),       # the chat defaults
         SamplingParams(temperature=0.7, top_k=5, seed=2),
         SamplingParams(temperature=1.0, min_p=0.05, seed=3),
         SamplingParams(temperature=0.8, top_k=50, top_p=0.5, repetition_penalty=1.2,
                        frequency_penalty=0.3, presence_penalty=0.2, seed=4)]


def mixed_batch(host_reads: bool) -> SamplingBatch:
    return SamplingBatch.build(MIXED, [5, 6, 7, 8, 9], [3, 1, 4, 1, 5],
                               [[1, 2, 3, 4]] * len(MIXED), [2] * len(MIXED), 300,
                               torch.device("cpu"), host_reads=host_reads)


def test_the_device_path_samples_the_host_path_s_tokens():
    torch.manual_seed(6)
    for trial in range(20):
        logits = torch.randn(len(MIXED), 300) * (1 + trial % 4)
        on_host = sample(logits.clone(), mixed_batch(True))
        on_device = sample(logits.clone(), mixed_batch(False))
        assert torch.equal(on_host, on_device)


def test_sampling_on_a_device_reads_nothing_on_the_host(host_reads):
    torch.manual_seed(7)
    logits = torch.randn(len(MIXED), 300)
    with host_reads.pause():
        batch = mixed_batch(False)  # built from the host's settings
    batch.logprob_rows, batch.num_top_logprobs = torch.tensor([1, 3]), 4
    with host_reads:
        sample(logits, batch)
    assert host_reads.reads == []
    with host_reads.pause():
        host_batch = mixed_batch(True)  # the CPU's path reads: the watch sees it
    with host_reads:
        sample(logits, host_batch)
    assert host_reads.reads


def sampling_on_the_device(engine, sampling_kernel: bool, monkeypatch) -> list[int]:
    """The engine's runner samples as on CUDA: no reads on the host, with the sampling
    kernel (under TRITON_INTERPRET here) or the torch ops. Returns the rows of each launch
    of the kernel, as they happen."""
    engine.runner.sample_on_host = False
    engine.runner.sampling_kernel = sampling_kernel
    launches: list[int] = []
    if sampling_kernel:
        pytest.importorskip("triton", reason="the sampling kernel needs the triton package")
        from paged_chat.engine.worker import sampling_kernel as kernel_module

        launch = kernel_module.sample_in_kernel

        def counted(logits, *args, **kwargs):
            launches.append(len(logits))
            return launch(logits, *args, **kwargs)

        monkeypatch.setattr(kernel_module, "sample_in_kernel", counted)
    return launches


@pytest.mark.parametrize("sampling_kernel", [False, True], ids=["torch", "kernel"])
def test_a_decode_step_reads_the_device_once(make_engine, host_reads, monkeypatch,
                                             sampling_kernel):
    """Chats at the defaults, greedy ones, one asking for logprobs, one with penalties: each
    decode step makes one copy to the host, and no other read."""
    fetches: list[int] = []
    fetch = DeviceToHost.fetch

    def counted(self, values):
        fetches[-1] += 1
        with host_reads.pause():
            return fetch(self, values)

    monkeypatch.setattr(DeviceToHost, "fetch", counted)
    engine = make_engine()
    sampling_on_the_device(engine, sampling_kernel, monkeypatch)
    engine.use_forward(paused_in(host_reads, engine.runner.model))
    params = [SamplingParams(temperature=0.2, top_p=0.9, seed=1),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=0.9, top_k=20, repetition_penalty=1.3, seed=2)]
    for prompt, p in zip(random_prompts(len(params), seed=8), params):
        engine.add_request(prompt, dataclasses.replace(p, max_tokens=6, ignore_eos=True))
    execute = engine.runner.execute
    decode_steps = 0

    def watched_execute(scheduled):
        nonlocal decode_steps
        fetches.append(0)
        with host_reads:
            output = execute(scheduled)
        if all(item.num_new_tokens == 1 for item in scheduled):
            decode_steps += 1
            assert fetches[-1] == 1
            assert host_reads.reads == [], host_reads.reads
        host_reads.reads.clear()
        return output

    engine.runner.execute = watched_execute
    while engine.has_unfinished():
        engine.step()
    assert decode_steps >= 4


@pytest.mark.parametrize("sampling_kernel", [False, True], ids=["torch", "kernel"])
def test_the_device_path_gives_the_engine_the_host_path_s_outputs(make_engine, sampling_kernel,
                                                                   monkeypatch):
    """Seeded draws, penalties, a grammar and logprobs: an engine sampling as on a device
    (with the sampling kernel: its one launch a step) gives the same tokens and logprobs as
    one sampling on the host."""
    params = [SamplingParams(temperature=0.2, top_p=0.9, seed=1, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.9, top_k=20, repetition_penalty=1.3,
                             frequency_penalty=0.2, seed=2, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=8, ignore_eos=True,
                             logprobs=True, top_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=4, choice=["ab", "cd"])]
    prompts = random_prompts(len(params), seed=9)
    runs = []
    for on_host in (True, False):
        engine = make_engine()
        if not on_host:
            launches = sampling_on_the_device(engine, sampling_kernel, monkeypatch)
        runs.append([(out.token_ids, out.logprobs) for out in engine.generate(prompts, params)])
    on_host, on_device = runs
    assert bool(launches) == sampling_kernel
    assert [tokens for tokens, _ in on_device] == [tokens for tokens, _ in on_host]
    for (_, host_logprobs), (_, device_logprobs) in zip(on_host, on_device):
        assert (host_logprobs is None) == (device_logprobs is None)
        for host_entry, device_entry in zip(host_logprobs or [], device_logprobs or []):
            assert device_entry.top_token_ids == host_entry.top_token_ids
            assert device_entry.logprob == pytest.approx(host_entry.logprob, abs=1e-6)
