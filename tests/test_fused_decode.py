"""engine/models/fused_decode.py: a decode step's layers as one C call. It calls the
kernels the per-op path calls, on the same rows, so the default model's greedy tokens and
their log-probabilities are bit for bit the same with and without it, at batches whose
products take either CPU kernel (pc_matmul up to 4 rows, pc_gemm above), and on any
number of threads: its chunks of work go to whichever thread takes them first (more
threads than cores here, so some start late or are descheduled and others take their
share), and a chunk run twice, or not at all, or before the phase it reads from ended,
would change the numbers."""

from __future__ import annotations

import pytest

from paged_chat.engine import Engine, EngineConfig, SamplingParams
from paged_chat.engine.models.fused_decode import FusedDecode
from paged_chat.engine.worker.threads import StepThreads

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot",
           "A paged KV cache", "List three prime numbers:", "Water boils at",
           "The best way to learn a language is"]


@pytest.fixture
def engine(smollm2_engine):
    """The session's default-model engine (each test leaves its fused step as it was)."""
    if smollm2_engine.runner.model.fused_decode is None:
        pytest.skip("no AVX2 build of the C kernels here: the per-op path runs")
    return smollm2_engine


def run(engine: Engine, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    engine.reset_prefix_cache()
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True, logprobs=True))
    return [(out.token_ids, [entry.logprob for entry in out.logprobs]) for out in outputs]


@pytest.mark.parametrize("batch, threads", [(1, None), (3, None), (7, None), (1, 3), (7, 3),
                                           (7, 8), (1, 1)])
def test_fused_decode_steps_equal_the_per_op_path_bit_for_bit(engine, batch, threads,
                                                              monkeypatch):
    if threads is not None:
        monkeypatch.setattr(engine, "threads", StepThreads.from_setting(threads))
    model = engine.runner.model
    fused = model.fused_decode
    calls = []
    original = FusedDecode.__call__
    monkeypatch.setattr(FusedDecode, "__call__",
                        lambda self, *args: calls.append(args[0].shape[0]) or original(self, *args))
    with_fused = run(engine, PROMPTS[:batch])
    assert calls and max(calls) == batch  # every decode step of the batch went through it
    model.fused_decode = None
    try:
        assert run(engine, PROMPTS[:batch]) == with_fused
    finally:
        model.fused_decode = fused


def test_a_model_it_does_not_compute_exactly_keeps_the_per_op_path(chat_model_dir):
    """A float32 safetensors model's linear layers are oneDNN's, not the quantized
    kernels: no fused step."""
    engine = Engine(EngineConfig(model=str(chat_model_dir), device="cpu", dtype="float32",
                                 num_blocks=64))
    assert engine.runner.model.fused_decode is None


def test_the_fused_step_asks_the_attention_backend_whether_it_applies():
    """Not the backend's class: any backend that says the native kernel attends the whole
    step gets it, and the reference backend never does."""
    import torch

    from paged_chat.engine.attention.backend import AttentionBackend
    from paged_chat.engine.attention.cpu_backend import CpuAttention
    from paged_chat.engine.attention.metadata import AttentionMetadata
    from paged_chat.engine.attention.torch_backend import TorchAttention

    tables = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    decodes = AttentionMetadata.build([1, 1], [5, 9], tables, 16, torch.device("cpu"))
    mixed = AttentionMetadata.build([1, 4], [5, 9], tables, 16, torch.device("cpu"))

    class DeclaresNative(AttentionBackend):
        def native_attends_step(self, meta: AttentionMetadata) -> bool:
            return True

    shape = (4, 2, 8, 8 ** -0.5)
    assert FusedDecode.applies(DeclaresNative(*shape), mixed)
    assert not FusedDecode.applies(TorchAttention(*shape), decodes)
    assert FusedDecode.applies(CpuAttention(*shape), decodes)
    assert not FusedDecode.applies(CpuAttention(*shape), mixed)
    assert FusedDecode.applies(CpuAttention(*shape, prefill_in_kernel=True), mixed)
