"""The decoder against Hugging Face transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import GenerationConfig

from paged_chat.engine.attention.metadata import AttentionMetadata
from paged_chat.engine.attention.torch_backend import TorchAttention
from paged_chat.engine.models.llama import LlamaForCausalLM
from paged_chat.engine.models.model_config import ModelConfig
from tiny_models import ARCHITECTURES, build_tiny_model

BLOCK_SIZE = 8


class PagedSequence:
    """One sequence run through the decoder with a shuffled (non-contiguous) block table."""

    def __init__(self, model: LlamaForCausalLM, config: ModelConfig, max_tokens: int) -> None:
        num_blocks = 2 * -(-max_tokens // BLOCK_SIZE)
        self.model = model
        self.attention = TorchAttention(config.num_heads, config.num_kv_heads, config.head_dim,
                                        config.head_dim ** -0.5)
        self.cache = torch.zeros(config.num_layers, 2,
                                 *self.attention.kv_cache_shape(num_blocks, BLOCK_SIZE))
        self.table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
        self.length = 0

    @torch.inference_mode()
    def feed(self, token_ids: list[int]) -> torch.Tensor:
        """Append tokens; return the logits of every one of them."""
        count = len(token_ids)
        positions = torch.arange(self.length, self.length + count)
        slots = self.table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        self.length += count
        meta = AttentionMetadata.build([count], [self.length], self.table[None], BLOCK_SIZE,
                                       torch.device("cpu"), slot_mapping=slots)
        return self.model(torch.tensor(token_ids), positions, self.cache, meta, self.attention,
                          torch.arange(count))


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("tied", [False, True])
def test_logits_and_greedy_tokens_match_transformers(architecture, tied, tmp_path):
    reference = build_tiny_model(architecture, tmp_path, tie_word_embeddings=tied)
    config = ModelConfig.from_hf(reference.config.to_dict())
    weights = load_file(tmp_path / "model.safetensors")
    if tied:
        weights.pop("lm_head.weight", None)
    model = LlamaForCausalLM.from_weights(config, weights, torch.float32, torch.device("cpu"), 1024)
    prompt = torch.randint(3, config.vocab_size, (37,), generator=torch.Generator().manual_seed(2))
    steps = 32

    with torch.inference_mode():
        expected = reference.generate(prompt[None], generation_config=GenerationConfig(
            max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0))[0]
        reference_logits = reference(expected[None]).logits[0]
    sequence = PagedSequence(model, config, len(expected))
    logits = [sequence.feed(prompt.tolist())]
    for token in expected[len(prompt):-1].tolist():
        logits.append(sequence.feed([token]))
    ours = torch.cat(logits)

    scale = reference_logits.abs().max()
    assert (ours - reference_logits[:-1]).abs().max() / scale < 1e-4
    greedy = ours[len(prompt) - 1:].argmax(-1)
    top2 = reference_logits[len(prompt) - 1:-1].topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3 * scale
    assert torch.equal(greedy[clear], expected[len(prompt):][clear])


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    reference = build_tiny_model("llama", tmp_path, rope_parameters={**scaling, "rope_theta": 5e5})
    config = ModelConfig.from_hf(reference.config.to_dict())
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_theta == 5e5
    model = LlamaForCausalLM.from_weights(config, load_file(tmp_path / "model.safetensors"),
                                          torch.float32, torch.device("cpu"), 1024)
    prompt = torch.randint(3, config.vocab_size, (150,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = reference(prompt[None]).logits[0]
    ours = PagedSequence(model, config, len(prompt)).feed(prompt.tolist())
    assert (ours - expected).abs().max() / expected.abs().max() < 1e-4
