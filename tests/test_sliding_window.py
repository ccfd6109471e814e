"""Sliding-window models through the whole engine: chunked prefill, prefix-cache hits and
batched decode (whose shared-prefix cascade masks the window per layer), greedy tokens
against transformers."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from paged_chat.engine import Engine, EngineConfig, SamplingParams


def test_batched_windowed_decode_with_a_shared_prefix_matches_transformers(mistral_dir):
    reference = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 512, (40,), generator=generator).tolist()
    prompts = [prefix + torch.randint(3, 512, (n,), generator=generator).tolist()
               for n in (3, 9, 17, 26)]
    engine = Engine(EngineConfig(model=str(mistral_dir), device="cpu", dtype="float32",
                                 num_blocks=64, block_size=8, max_num_batched_tokens=24,
                                 kv_cache_dtype="auto"))
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True))
    assert any(output.num_cached_tokens for output in outputs), "no prefix-cache hit"
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + output.token_ids])).logits[0]
        assert output.token_ids == logits[len(prompt) - 1:-1].argmax(-1).tolist()
