"""The fused C ops of the decoder (models/fused_ops.py) against the torch ops they replace,
and the engine's greedy tokens with them on against the reference path."""

from __future__ import annotations

import pytest
import torch

from paged_chat.engine import SamplingParams
from paged_chat.engine.models import fused_ops
from paged_chat.engine.models.llama import RMSNorm, rotate_half

pytestmark = pytest.mark.skipif(not fused_ops.available(), reason="no C compiler")


@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 576), (33, 40)])
def test_add_rms_norm_matches_torch(rows, hidden):
    generator = torch.Generator().manual_seed(rows)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=generator)
    delta, residual = (torch.randn(rows, hidden, generator=generator) for _ in range(2))
    expected, expected_residual = norm(delta, residual.clone())
    norm.fused = True
    got, got_residual = norm(delta, residual)
    assert got_residual is residual, "the sum is written into the residual in place"
    torch.testing.assert_close(got_residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    norm.fused = False
    expected_alone = norm(delta)
    norm.fused = True
    torch.testing.assert_close(norm(delta), expected_alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 7])
def test_rope_in_place_matches_torch(tokens):
    heads, kv_heads, dim = 9, 3, 64
    generator = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator)
    cos, sin = (torch.randn(tokens, 1, dim, generator=generator) for _ in range(2))
    q = qkv[:, :heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    expected_q, expected_k = (x * cos + rotate_half(x) * sin for x in (q, k))
    fused_ops.rope_(qkv, heads + kv_heads, dim, cos, sin)
    torch.testing.assert_close(q, expected_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, expected_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before), "V untouched"


@pytest.mark.parametrize("rows,size", [(1, 1536), (6, 13)])
def test_silu_and_mul_matches_torch(rows, size):
    gate_up = torch.randn(rows, 2 * size, generator=torch.Generator().manual_seed(size)) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up,
                               rtol=1e-6, atol=1e-6)


def test_engine_greedy_tokens_match_the_reference_path(make_engine):
    """Fused ops and the CPU attention kernel (the default) against torch ops and the torch
    attention backend: decodes, chunked prefills over the 512-token budget, prefix hits."""
    prompts = [[5 + i % 200 for i in range(n)] for n in (3, 40, 700, 130, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = make_engine(attention_backend="torch", fused_ops=False).generate(prompts, params)
    engine = make_engine()
    assert engine.runner.model.layers[0].mlp.fused
    got = engine.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
