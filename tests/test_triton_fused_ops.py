"""engine/models/triton_fused_ops.py against the torch ops of llama.py, under TRITON_INTERPRET=1
when there is no GPU: each kernel alone on ragged shapes, then the decoder on the CUDA
path (those kernels and Triton attention) against the decoder on the torch ops.

The interpreter does not catch out-of-bounds accesses, so inputs are views whose
neighbours in memory are NaN (`poisoned`) and the caches are NaN where no token was
stored: a load a mask should have stopped shows up as NaN in the output, a stray store as
a changed slot. Sizes are not powers of two where the kernels pad them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (extra 'gpu')")

from paged_chat.engine import SamplingParams  # noqa: E402
from paged_chat.engine.attention.metadata import AttentionMetadata  # noqa: E402
from paged_chat.engine.attention.torch_backend import TorchAttention  # noqa: E402
from paged_chat.engine.attention.triton_backend import TritonAttention  # noqa: E402
from paged_chat.engine.models import triton_fused_ops  # noqa: E402
from paged_chat.engine.models.llama import MLP, RMSNorm, rotate_half  # noqa: E402
from paged_chat.engine.worker.model_loading import use_triton_ops  # noqa: E402
from tests.test_triton_kernels import DEVICE, poisoned  # noqa: E402
from tests.tiny_models import build_tiny_model, load_decoder  # noqa: E402

# One bf16 ulp at the values these make: rsqrt and exp differ in their last fp32 bits from
# torch's, which can flip a bf16 rounding, and the interpreter casts fp32 to bf16 by
# truncation (a GPU rounds to nearest, as torch does); fp32 to its rounding.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5),
             torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}
# RoPE after a q/k norm rounds three times in a row (the norm, its weight, the rotation's
# products): three ulps under the interpreter's truncation.
ROPE_TOLERANCE = TOLERANCE | {torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def random_weight(size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (1 + 0.3 * torch.randn(size, generator=generator)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 80, 200])
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
def test_add_rms_norm_matches_torch(dtype, hidden, unit_offset):
    generator = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-6, unit_offset).to(dtype).to(DEVICE)
    norm.weight.data = random_weight(hidden, dtype, hidden)
    delta = poisoned((5, hidden), dtype, generator)
    residual = poisoned((5, hidden), dtype, generator)
    expected_sum = delta + residual
    expected = norm(expected_sum)

    norm.triton_ops = triton_fused_ops
    ours, returned = norm(delta, residual)
    assert returned is residual
    torch.testing.assert_close(residual, expected_sum, **TOLERANCE[dtype])
    torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(norm(residual), expected, **TOLERANCE[dtype])
    assert norm(residual[:0]).shape == (0, hidden)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
def test_norm_add_norm_matches_torch(dtype, unit_offset):
    """Gemma's norm after attention, residual add and norm before the MLP as one kernel."""
    hidden = 80
    generator = torch.Generator().manual_seed(3)
    post, pre = (RMSNorm(hidden, eps, unit_offset).to(dtype).to(DEVICE) for eps in (1e-6, 1e-5))
    post.weight.data, pre.weight.data = (random_weight(hidden, dtype, seed) for seed in (1, 2))
    delta = poisoned((5, hidden), dtype, generator)
    residual = poisoned((5, hidden), dtype, generator)
    expected, expected_sum = pre.add_normed(post, delta, residual)

    post.triton_ops = pre.triton_ops = triton_fused_ops
    ours, returned = pre.add_normed(post, delta, residual)
    assert returned is residual
    # The sum adds the normed delta after its two roundings (values up to ~4 in bf16: two
    # ulps are 1/32 where the sum cancels them to a small number).
    tolerance = TOLERANCE[dtype] | ({"atol": 4e-2} if dtype == torch.bfloat16 else {})
    torch.testing.assert_close(residual, expected_sum, **tolerance)
    torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])


def rope_reference(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                   norms: tuple[RMSNorm, RMSNorm] | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) as llama.py's Attention makes them on the torch ops."""
    tokens = qkv.shape[0]
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q = q.reshape(tokens, heads, head_dim)
    k = k.reshape(tokens, kv_heads, head_dim)
    v = v.reshape(tokens, kv_heads, head_dim)
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
    cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 16), (3, 1, 80), (7, 7, 32)])
@pytest.mark.parametrize("qk_norm", [None, "llama", "gemma"])
def test_rope_and_store_matches_torch(dtype, heads, kv_heads, head_dim, qk_norm):
    """Q rotated in place, rotated K and V in their slots, slot -1 stores nothing, K and V
    of the QKV output untouched, every other cache slot untouched (still NaN)."""
    generator = torch.Generator().manual_seed(head_dim + heads)
    width = (heads + 2 * kv_heads) * head_dim
    tokens, block_size, num_blocks = 6, 16, 5
    qkv = poisoned((tokens, width), dtype, generator)
    positions = torch.tensor([0, 17, 5, 300, 31, 8], device=DEVICE)
    slots = torch.tensor([3, 40, -1, 79, 16, 64], device=DEVICE)
    model_cos, model_sin = rope_tables(head_dim, 512, dtype)
    norms = None
    if qk_norm is not None:
        norms = tuple(RMSNorm(head_dim, 1e-6, qk_norm == "gemma").to(dtype).to(DEVICE)
                      for _ in range(2))
        for seed, norm in enumerate(norms):
            norm.weight.data = random_weight(head_dim, dtype, seed)
    expected_q, expected_k, expected_v = rope_reference(qkv, positions, model_cos, model_sin,
                                                        heads, kv_heads, head_dim, norms)
    shape = (kv_heads, num_blocks, block_size, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    value_cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    expected_caches = [key_cache.clone(), value_cache.clone()]
    stored = slots >= 0
    for cache, new in zip(expected_caches, (expected_k, expected_v)):
        cache.view(kv_heads, -1, head_dim)[:, slots[stored]] = new[stored].transpose(0, 1)
    kv_before = qkv[:, heads * head_dim:].clone()

    query = triton_fused_ops.rope_and_store(
        qkv, positions, model_cos, model_sin, key_cache, value_cache, slots, heads, kv_heads,
        head_dim, None if norms is None else (norms[0].weight, norms[1].weight), 1e-6,
        qk_norm == "gemma")
    assert query.data_ptr() == qkv.data_ptr() and query.shape == (tokens, heads, head_dim)
    torch.testing.assert_close(query, expected_q, **ROPE_TOLERANCE[dtype])
    assert torch.equal(qkv[:, heads * head_dim:], kv_before)
    for ours, expected in zip((key_cache, value_cache), expected_caches):
        assert torch.equal(ours.isnan(), expected.isnan()), "a store outside its slot"
        torch.testing.assert_close(ours, expected, equal_nan=True, **ROPE_TOLERANCE[dtype])


def rope_tables(head_dim: int, positions: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables as LlamaForCausalLM.build_rope_tables makes them."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(positions).float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [40, 1100])  # one column block padded; two, the last ragged
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu_tanh"])
def test_act_and_mul_matches_torch(dtype, size, gelu):
    generator = torch.Generator().manual_seed(size)
    mlp = MLP(SimpleNamespace(hidden_size=8, intermediate_size=size, gemma=gelu))
    gate_up = poisoned((3, 2 * size), dtype, generator).mul_(3)  # NaN neighbours kept
    mlp.gate_up_proj = mlp.down_proj = torch.nn.Identity()  # the activation alone
    expected = mlp(gate_up)
    mlp.triton_ops = triton_fused_ops
    torch.testing.assert_close(mlp(gate_up), expected, **TOLERANCE[dtype])


def run_steps(model, attention, steps: list[list[tuple[int, int]]], num_blocks: int = 24
              ) -> list[torch.Tensor]:
    """Run the decoder over a batch of sequences step by step: each step gives, per
    sequence (in batch order), (its index, new tokens); returns each step's logits of the
    last token of every sequence. Token ids and block tables are fixed by the seed."""
    config = model.config
    generator = torch.Generator().manual_seed(7)
    block_size = 8
    cache = torch.zeros(config.num_layers, 2, *attention.kv_cache_shape(num_blocks, block_size),
                        dtype=model.norm.weight.dtype, device=DEVICE)
    order = 1 + torch.randperm(num_blocks - 1, generator=generator)
    tables = order[:(num_blocks - 1) // 3 * 3].view(3, -1).int()
    lengths = [0, 0, 0]
    logits = []
    for step in steps:
        query_lens = [new for _, new in step]
        positions = torch.cat([torch.arange(lengths[seq], lengths[seq] + new)
                               for seq, new in step])
        slot_rows = torch.cat([torch.full((new,), seq) for seq, new in step])
        slots = tables[slot_rows, positions // block_size] * block_size + positions % block_size
        for seq, new in step:
            lengths[seq] += new
        meta = AttentionMetadata.build(query_lens, [lengths[seq] for seq, _ in step],
                                       tables[[seq for seq, _ in step]], block_size, DEVICE,
                                       slot_mapping=slots.to(DEVICE))
        token_ids = torch.randint(3, config.vocab_size, (len(positions),), generator=generator)
        last = torch.cumsum(torch.tensor(query_lens), 0) - 1
        with torch.inference_mode():
            logits.append(model(token_ids.to(DEVICE), meta.positions, cache, meta, attention,
                                last.to(DEVICE)))
    return logits


# Prefill chunks (one ends mid-block), then decodes with a chunk mixed in, then decodes.
STEPS = [[(0, 11), (1, 5)], [(0, 1), (1, 1), (2, 9)], [(0, 1), (1, 1), (2, 1)],
         [(2, 1), (0, 1), (1, 1)]]


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "gemma3_text"])
def test_decoder_on_the_cuda_path_matches_the_torch_ops(architecture, tmp_path):
    """The whole decoder, prefill and decode, with the Triton kernels and attention's
    `attend` (the CUDA path) against the torch ops and the torch attention."""
    build_tiny_model(architecture, tmp_path, head_dim=16, num_heads=6, num_kv_heads=2)
    reference = load_decoder(tmp_path).to(DEVICE)
    config = reference.config
    torch_attention = TorchAttention(config.num_heads, config.num_kv_heads, config.head_dim,
                                     config.attention_scale)
    assert not use_triton_ops(reference, torch_attention)
    expected = run_steps(reference, torch_attention, STEPS)

    model = load_decoder(tmp_path).to(DEVICE)
    triton_attention = TritonAttention(config.num_heads, config.num_kv_heads, config.head_dim,
                                       config.attention_scale)
    assert use_triton_ops(model, triton_attention)
    ours = run_steps(model, triton_attention, STEPS)
    for step, (got, want) in enumerate(zip(ours, expected)):
        scale = want.abs().max()
        assert (got - want).abs().max() / scale < 1e-4, f"step {step}"


@contextlib.contextmanager
def recorded_fused_launches() -> Iterator[list[tuple[Any, dict[str, Any], dict[str, Any]]]]:
    """Launch the fused ops' kernels as usual, recording (kernel, arguments by name, launch
    options) per launch, as device_check.captured_launches does for the attention's."""
    launches: list[tuple[Any, dict[str, Any], dict[str, Any]]] = []
    names = ("_add_rms_norm_kernel", "_rope_and_store_kernel", "_act_and_mul_kernel")
    originals = {name: getattr(triton_fused_ops, name) for name in names}

    class Recorder:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            def record(*args: Any, **kwargs: Any) -> None:
                options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
                named = dict(zip(self.kernel.arg_names, args)) | {
                    k: v for k, v in kwargs.items() if k not in options}
                launches.append((self.kernel, named, options))
                self.kernel[grid](*args, **kwargs)
            return record

    for name, kernel in originals.items():
        setattr(triton_fused_ops, name, Recorder(kernel))
    try:
        yield launches
    finally:
        for name, kernel in originals.items():
            setattr(triton_fused_ops, name, kernel)


def test_engine_on_the_cuda_path_compiles_nothing_after_warm_up(make_engine):
    """An engine whose model runs the fused kernels (as on CUDA) generates the torch
    backend's greedy tokens, and after `ModelRunner.warm_up` a generation that mixes
    decodes, chunked prefill ending mid-block and a prefix hit launches no variant of them
    the warm-up did not compile (a pause of a second or more each on a GPU)."""
    from benchmarks.device_check import variant_key

    shared = list(range(3, 23))
    prompts = [shared + [40, 41, 42], list(range(100, 131)), shared + [50, 51]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    settings = dict(max_num_batched_tokens=24, num_blocks=32, fused_ops=False)
    expected = make_engine(attention_backend="torch", **settings).generate(prompts, params)
    engine = make_engine(attention_backend="triton", max_model_len=160, **settings)
    assert use_triton_ops(engine.runner.model, engine.runner.attention)
    with recorded_fused_launches() as launches:
        engine.runner.warm_up()
        warmed = {variant_key(*launch) for launch in launches}
        launches.clear()
        outputs = engine.generate(prompts, params)
        seen = {variant_key(*launch) for launch in launches}
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert engine.stats().prefix_cache_hit_tokens > 0
    assert {variant[0] for variant in seen} == {
        "_add_rms_norm_kernel", "_rope_and_store_kernel", "_act_and_mul_kernel"}
    assert seen <= warmed, seen - warmed


@pytest.mark.perf
def test_kernels_compile_without_spills(tmp_path):
    """The interpreter never lowers the kernels; triton's compiler does, without a GPU:
    every variant of real models' shapes (head dims 64 to 256, q/k norms, Gemma) compiles
    for sm_80, sm_89 and sm_90 in bf16 and fp32 with no register spill (~1 minute)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    report = tmp_path / "compiled.json"
    result = subprocess.run([sys.executable, "-m", "benchmarks.triton_fused_ops_compile",
                             "--json", str(report)], env=env, capture_output=True, text=True,
                            timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    compiled = json.loads(report.read_text())
    assert {(c["arch"], c["kernel"]) for c in compiled} == {
        (arch, kernel) for arch in (80, 89, 90)
        for kernel in ("_add_rms_norm_kernel", "_rope_and_store_kernel", "_act_and_mul_kernel")}
    assert all(c["spill_bytes"] == 0 for c in compiled)


def test_a_padded_decode_step_as_a_cuda_graph_replays_it(tmp_path, monkeypatch):
    """The CUDA path on a decode step laid out as a captured graph replays it (batch padded
    with dummy decodes at slot -1, fixed-width tables, splits planned for the longest
    context): the padding stores nothing and the real rows get the unpadded step's logits."""
    from paged_chat.engine.attention import triton_backend
    from paged_chat.engine.attention import triton_paged_attention as triton_kernels

    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: 132)
    monkeypatch.setattr(triton_kernels, "MIN_KEYS_PER_SPLIT", 16)
    build_tiny_model("llama", tmp_path, head_dim=16, num_heads=6, num_kv_heads=2)
    model = load_decoder(tmp_path).to(DEVICE)
    config = model.config
    attention = TritonAttention(config.num_heads, config.num_kv_heads, config.head_dim,
                                config.attention_scale)
    assert use_triton_ops(model, attention)
    block_size, tables = 8, [[3, 1, 6], [2, 5]]
    cache = torch.zeros(config.num_layers, 2, *attention.kv_cache_shape(8, block_size),
                        device=DEVICE)
    prompts = [list(range(3, 22)), list(range(40, 53))]
    with torch.inference_mode():
        prefill = AttentionMetadata.build([19, 13], [19, 13], tables, block_size, DEVICE)
        model(torch.tensor(sum(prompts, [])).to(DEVICE), prefill.positions, cache, prefill,
              attention, torch.tensor([18, 31]).to(DEVICE))
        steps = {}
        for padded in (False, True):
            step_cache = cache.clone()
            layout = dict(table_width=6, pad_to=4) if padded else {}
            meta = AttentionMetadata.build([1, 1], [20, 14], tables, block_size, DEVICE, **layout)
            if padded:
                attention.plan_graph(meta, step_cache, longest=48)
            rows = meta.num_seqs
            input_ids = torch.tensor([7, 9] + [0] * (rows - 2)).to(DEVICE)
            logits = model(input_ids, meta.positions, step_cache, meta, attention,
                           torch.arange(rows).to(DEVICE))
            steps[padded] = (logits[:2], step_cache)
    assert [launch.num_splits for launch in meta.per_step["triton_launches"]] == [2]
    torch.testing.assert_close(steps[True][0], steps[False][0], atol=1e-5, rtol=1e-5)
    # Each layer's matmuls over 4 rows may round differently from over 2: close, not equal.
    torch.testing.assert_close(steps[True][1], steps[False][1], atol=1e-5, rtol=1e-5)
    written = torch.zeros(cache.shape[:-1], dtype=torch.bool, device=DEVICE)
    for table, position in zip(tables, (19, 13)):
        written[..., table[position // block_size], position % block_size] = True
    for _, step_cache in steps.values():
        assert torch.equal(step_cache[~written], cache[~written]), "stored outside its slots"
        assert not torch.equal(step_cache[written], cache[written]), "stored nothing"
