"""How many kernels one decode step launches on the path CUDA takes (the Triton kernels of
models/triton_fused_ops.py, Triton attention, and the runner's sampling with the sampling
kernel, worker/sampling_kernel.py, at the chat defaults), counted on a GPU or, without one,
under the interpreter (tests/kernel_count.py): launches cost ~5-8 us each on a GPU, so a
step of small kernels is bound by their number, not by the bytes it reads.

Splits are planned as for a 132-SM GPU from 16 keys on, so the decode attention splits and
its merge kernel is counted too: the most a layer launches.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (extra 'gpu')")

from paged_chat.engine import SamplingParams  # noqa: E402
from paged_chat.engine.attention import triton_backend  # noqa: E402
from paged_chat.engine.attention import triton_paged_attention as triton_kernels  # noqa: E402
from paged_chat.engine.attention.metadata import AttentionMetadata, StagingBuffer  # noqa: E402
from paged_chat.engine.attention.triton_backend import TritonAttention  # noqa: E402
from paged_chat.engine.core.request import Request  # noqa: E402
from paged_chat.engine.core.scheduler import ScheduledRequest  # noqa: E402
from paged_chat.engine.models.llama import LlamaForCausalLM  # noqa: E402
from paged_chat.engine.models.model_config import ModelConfig  # noqa: E402
from paged_chat.engine.worker.device_to_host import DeviceToHost  # noqa: E402
from paged_chat.engine.worker.input_batch import SamplingRows  # noqa: E402
from paged_chat.engine.worker.model_loading import use_triton_ops  # noqa: E402
from paged_chat.engine.worker.runner import ModelRunner  # noqa: E402
from tests.kernel_count import KernelCounter, count_by_layer  # noqa: E402
from tests.test_triton_kernels import DEVICE  # noqa: E402

MAX_KERNELS_PER_LAYER = 12
# Embedding, the final norm, the LM head and the runner's sampling (its batch, the draw, the
# packing for the step's one copy to the host).
MAX_KERNELS_OUTSIDE_LAYERS = 30
# The step's copy of its sampling indices to the device and of its results to the host: on
# the CPU host memory is the device's, so the run here makes neither.
CUDA_ONLY_COPIES = 2
CHAT_DEFAULTS = SamplingParams(temperature=0.2, top_p=0.9)
BLOCK_SIZE = 16
# Three decodes: contexts that end mid-block, one past the split threshold.
SEQ_LENS = [40, 17, 33]


def tiny_model(architecture: str, num_layers: int = 2) -> LlamaForCausalLM:
    """The default model's kind of decoder (tied embeddings, GQA), tiny, in bf16 as on CUDA."""
    config = ModelConfig.from_hf({
        "model_type": architecture, "vocab_size": 256, "hidden_size": 96,
        "intermediate_size": 160, "num_hidden_layers": num_layers, "num_attention_heads": 6,
        "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True,
        "sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"]})
    model = LlamaForCausalLM.empty(config, torch.bfloat16, DEVICE)
    generator = torch.Generator().manual_seed(0)
    for param in model.parameters():
        param.data.copy_(0.1 * torch.randn(param.shape, generator=generator).to(DEVICE))
    model.build_rope_tables(256)
    return model


def sampling_runner(vocab_size: int, sampling_kernel: bool) -> ModelRunner:
    """A ModelRunner with only what its sampling reads (`_sample`), sampling as on CUDA: no
    reads on the host, with the sampling kernel or the torch ops."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = DEVICE
    runner.sample_on_host = False
    runner.sampling_kernel = sampling_kernel
    runner._sampling_rows = SamplingRows(vocab_size, DEVICE)
    runner._sampling_staging = StagingBuffer(DEVICE)
    runner._to_host = DeviceToHost(DEVICE)
    return runner


def count_decode_step(model: LlamaForCausalLM, monkeypatch, sampling_kernel: bool = True,
                      params: SamplingParams = CHAT_DEFAULTS) -> KernelCounter:
    """The kernels of one decode step of `model` with Triton attention, its rows sampled with
    `params` after a step that gave them their sampling rows, by region: "layer 0",
    "layer 1"... and "step" (everything outside the layers)."""
    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: 132)
    monkeypatch.setattr(triton_kernels, "MIN_KEYS_PER_SPLIT", 16)
    config = model.config
    attention = TritonAttention(config.num_heads, config.num_kv_heads, config.head_dim,
                                config.attention_scale)
    num_blocks = 1 + sum(-(-length // BLOCK_SIZE) for length in SEQ_LENS)
    cache = torch.zeros(config.num_layers, 2, *attention.kv_cache_shape(num_blocks, BLOCK_SIZE),
                        dtype=torch.bfloat16, device=DEVICE)
    tables, first = [], 1
    for length in SEQ_LENS:
        count = -(-length // BLOCK_SIZE)
        tables.append(list(range(first, first + count)) + [0] * (3 - count))
        first += count
    meta = AttentionMetadata.build([1] * len(SEQ_LENS), SEQ_LENS, tables, BLOCK_SIZE, DEVICE)
    input_ids = torch.tensor([5, 6, 7], device=DEVICE)
    logits_indices = torch.arange(len(SEQ_LENS), device=DEVICE)
    runner = sampling_runner(config.vocab_size, sampling_kernel)
    samplers = [ScheduledRequest(Request(f"chat-{row}", [1, 2, 3], params, row, 0.0), 1, True)
                for row in range(len(SEQ_LENS))]
    with torch.inference_mode():
        runner._sample(torch.zeros(len(SEQ_LENS), config.vocab_size, device=DEVICE), samplers)
    with torch.inference_mode(), KernelCounter() as counter, count_by_layer(model, counter):
        logits = model(input_ids, meta.positions, cache, meta, attention, logits_indices)
        tokens = runner._sample(logits, samplers)
    assert logits.shape == (len(SEQ_LENS), config.vocab_size) and logits.isfinite().all()
    assert all(0 <= token < config.vocab_size for token in tokens), tokens
    assert "_merge_splits_kernel" in counter.names("layer 0"), "the decode did not split"
    return counter


@pytest.mark.parametrize("params", [CHAT_DEFAULTS, SamplingParams(temperature=0.0)],
                         ids=["chat-defaults", "greedy"])
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "gemma3_text"])
def test_a_decode_step_on_the_cuda_path_is_a_few_kernels_a_layer(architecture, params,
                                                                 monkeypatch):
    """llama: the default model's kind; qwen2 adds the QKV bias, qwen3 the q/k norms,
    Gemma 3 its norms after attention and the MLP and a sliding window."""
    model = tiny_model(architecture)
    assert use_triton_ops(model, TritonAttention(6, 2, 16, 0.25))
    counter = count_decode_step(model, monkeypatch, params=params)
    regions = counter.by_region()
    for layer in range(model.config.num_layers):
        assert regions[f"layer {layer}"] <= MAX_KERNELS_PER_LAYER, counter.names(f"layer {layer}")
    assert regions["step"] + CUDA_ONLY_COPIES <= MAX_KERNELS_OUTSIDE_LAYERS, counter.names("step")
    assert "_sample_kernel" in counter.names("step")
    assert set(regions) == {"step", "layer 0", "layer 1"}


def test_the_torch_ops_take_many_more(monkeypatch):
    """The counter sees what the fused kernels save: the same step on the torch ops (the
    reference path, what CUDA ran before them) is over the bound, in a layer and outside."""
    counter = count_decode_step(tiny_model("llama"), monkeypatch, sampling_kernel=False)
    assert counter.by_region()["layer 0"] > 2 * MAX_KERNELS_PER_LAYER, counter.names("layer 0")
    assert counter.by_region()["step"] > MAX_KERNELS_OUTSIDE_LAYERS, counter.names("step")
