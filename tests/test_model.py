"""The decoder against Hugging Face transformers on the same weights (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    ARCHITECTURES,
    PagedSequence,
    build_tiny_model,
    greedy_reference,
    load_decoder,
    run_paged,
)

from paged_chat.engine.models.packed_linear import pack_for_cpu


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("packed", [False, True], ids=["aten", "packed"])
def test_logits_and_greedy_tokens_match_transformers(architecture, tied, packed, tmp_path):
    """`packed`: the linear layers on oneDNN's packed weights, as the engine runs fp32 on the CPU."""
    reference = build_tiny_model(architecture, tmp_path, tie_word_embeddings=tied)
    model = load_decoder(tmp_path)
    if packed:
        pack_for_cpu(model)
    prompt = torch.randint(3, model.config.vocab_size, (37,),
                           generator=torch.Generator().manual_seed(2))
    expected, reference_logits = greedy_reference(reference, prompt, steps=32)
    ours = run_paged(model, expected, [prompt])

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
    model = load_decoder(tmp_path)
    config = model.config
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_theta == 5e5
    prompt = torch.randint(3, config.vocab_size, (150,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = reference(prompt[None]).logits[0]
    ours = PagedSequence(model, len(prompt)).feed(prompt.tolist())
    assert (ours - expected).abs().max() / expected.abs().max() < 1e-4


# Windows that are not multiples of PAGED_BLOCK_SIZE, prompts several windows long.
WINDOWED = {
    "mistral": dict(sliding_window=13),
    "qwen2": dict(use_sliding_window=True, sliding_window=11, max_window_layers=1),
    "gemma3_text": dict(sliding_window=9, num_layers=3,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


@pytest.mark.parametrize("architecture", WINDOWED)
def test_sliding_window_chunked_prefill_and_decode_match_transformers(architecture, tmp_path):
    reference = build_tiny_model(architecture, tmp_path, **WINDOWED[architecture])
    model = load_decoder(tmp_path)
    assert any(model.config.layer_windows), "the window was not read from the config"
    prompt = torch.randint(3, model.config.vocab_size, (45,),
                           generator=torch.Generator().manual_seed(4))
    expected, reference_logits = greedy_reference(reference, prompt, steps=16)
    # Chunks that end inside blocks: chunked prefill across block boundaries.
    ours = run_paged(model, expected, [prompt[:10], prompt[10:27], prompt[27:]])

    scale = reference_logits.abs().max()
    assert (ours - reference_logits[:-1]).abs().max() / scale < 1e-4
    assert torch.equal(ours[len(prompt) - 1:].argmax(-1), expected[len(prompt):])
