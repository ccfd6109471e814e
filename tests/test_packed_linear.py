"""float32 linear layers on oneDNN's packed weights (engine/models/packed_linear.py): the
same products as `F.linear`, and what the engine packs. The decoder on packed weights
against transformers is in test_model.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import build_tiny_model, load_decoder
from torch import nn

from paged_chat.engine.kv.tier import model_fingerprint
from paged_chat.engine.models.packed_linear import PackedLinear, pack_linears


@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_computes_what_f_linear_does_for_any_number_of_rows(bias):
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(72, 40, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 72, generator=generator))
    packed = PackedLinear(linear.weight, linear.bias)
    assert packed.weight.shape == (40, 72) and packed.weight.layout == torch._mkldnn
    for rows in (1, 3, 17, 100, 513):
        x = torch.randn(rows, 72, generator=generator)
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias),
                                   rtol=1e-5, atol=1e-4)


def test_only_float32_weights_on_the_cpu_are_packed():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16),
                          nn.Sequential(nn.Linear(8, 4)))
    assert pack_linears(model) == 2
    assert [type(module).__name__ for module in (model[0], model[1], model[2][0])] == [
        "PackedLinear", "Linear", "PackedLinear"]


def test_a_float32_engine_on_the_cpu_runs_packed_linears_and_reads_its_weights_unpacked(
        make_engine, smollm2_source, tmp_path):
    """The tied output projection is packed as a copy; the parameter count and the KV tier's
    fingerprint come from the weights as loaded."""
    build_tiny_model("llama", tmp_path, tie_word_embeddings=True)
    smollm2_source.tokenizer.save_pretrained(tmp_path)
    engine = make_engine(model=str(tmp_path), kv_tier_host_bytes="1MiB", kv_tier_disk_bytes=0)
    model = engine.runner.model
    layer = model.layers[0]
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
               layer.mlp.down_proj, model.lm_head)
    assert all(isinstance(linear, PackedLinear) for linear in linears)
    plain = load_decoder(tmp_path)
    assert plain.lm_head is None, "the tiny model ties its output projection to the embeddings"
    assert engine.info.num_parameters == sum(p.numel() for p in plain.parameters())
    assert engine.kv_cache.tier.layout.model_fingerprint == model_fingerprint(
        dict(plain.named_parameters()))
